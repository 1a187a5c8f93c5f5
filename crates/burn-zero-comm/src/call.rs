//! Fingerprints of collective calls, used to check that every rank runs the same schedule.

use std::fmt;

use burn::tensor::DType;

/// The kind of a collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// Every rank contributes a block; every rank receives all blocks in rank order.
    AllGather,
    /// Every rank contributes a full buffer; rank `r` receives block `r` of the reduction.
    ReduceScatter(ReduceOp),
    /// Every rank contributes a buffer; every rank receives the reduction.
    AllReduce(ReduceOp),
    /// Every rank receives the buffer of `root`.
    Broadcast {
        /// The rank whose buffer is sent.
        root: usize,
    },
    /// Every rank waits until all ranks arrive.
    Barrier,
    /// Every rank receives a handle on a new group over the same ranks.
    Duplicate,
}

/// How a reduction combines the ranks' values, element by element, in rank order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// `x0 + x1 + … + x(n-1)`, added left to right.
    Sum,
    /// The rank-order sum divided by the world size.
    Mean,
    /// The element-wise maximum (NaN propagates).
    Max,
    /// The element-wise minimum (NaN propagates).
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

impl fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CollectiveOp::AllGather => f.write_str("all_gather"),
            CollectiveOp::ReduceScatter(op) => write!(f, "reduce_scatter({op})"),
            CollectiveOp::AllReduce(op) => write!(f, "all_reduce({op})"),
            CollectiveOp::Broadcast { root } => write!(f, "broadcast(root {root})"),
            CollectiveOp::Barrier => f.write_str("barrier"),
            CollectiveOp::Duplicate => f.write_str("duplicate"),
        }
    }
}

/// One rank's call of a collective: what every rank must agree on before data moves.
///
/// `seq` is 1-based and counts the collectives this rank has issued in its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveCall {
    /// 1-based position of the call in the rank's schedule.
    pub seq: u64,
    /// The operation.
    pub op: CollectiveOp,
    /// Element type of the buffer (`None` for a barrier).
    pub dtype: Option<DType>,
    /// Number of elements the rank passes in.
    pub numel: usize,
}

impl CollectiveCall {
    /// Whether two ranks' calls are the same collective (same op, dtype and size).
    pub fn matches(&self, other: &CollectiveCall) -> bool {
        self.op == other.op && self.dtype == other.dtype && self.numel == other.numel
    }

    /// `17th`, `1st`, `22nd`: the ordinal of `seq`.
    pub fn ordinal(&self) -> String {
        let n = self.seq;
        let suffix = match (n % 10, n % 100) {
            (1, r) if r != 11 => "st",
            (2, r) if r != 12 => "nd",
            (3, r) if r != 13 => "rd",
            _ => "th",
        };
        format!("{n}{suffix}")
    }
}

impl fmt::Display for CollectiveCall {
    /// Formats as `all_gather of 4096 f32 as its 17th collective`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dtype {
            Some(dtype) => write!(
                f,
                "{} of {} {} as its {} collective",
                self.op,
                self.numel,
                dtype_name(dtype),
                self.ordinal()
            ),
            None => write!(f, "{} as its {} collective", self.op, self.ordinal()),
        }
    }
}

/// Short lower-case name of a dtype, as in `f32`, `bf16`.
pub fn dtype_name(dtype: DType) -> String {
    match dtype {
        DType::F64 => "f64".into(),
        DType::F32 => "f32".into(),
        DType::Flex32 => "flex32".into(),
        DType::F16 => "f16".into(),
        DType::BF16 => "bf16".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_reads_as_a_sentence() {
        let call = CollectiveCall {
            seq: 17,
            op: CollectiveOp::AllGather,
            dtype: Some(DType::F32),
            numel: 4096,
        };
        assert_eq!(
            call.to_string(),
            "all_gather of 4096 f32 as its 17th collective"
        );
        let barrier = CollectiveCall {
            seq: 2,
            op: CollectiveOp::Barrier,
            dtype: None,
            numel: 0,
        };
        assert_eq!(barrier.to_string(), "barrier as its 2nd collective");
    }

    #[test]
    fn ordinals() {
        let names: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111]
            .into_iter()
            .map(|seq| {
                CollectiveCall {
                    seq,
                    op: CollectiveOp::Barrier,
                    dtype: None,
                    numel: 0,
                }
                .ordinal()
            })
            .collect();
        assert_eq!(
            names,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd",
                "101st", "111th"
            ]
        );
    }
}
