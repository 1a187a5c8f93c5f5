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
    /// Every rank contributes a full buffer; rank `r` receives block `r` of every rank's
    /// buffer, in rank order.
    AllToAll,
    /// Every rank receives the buffer of `root`.
    Broadcast {
        /// The rank whose buffer is sent.
        root: usize,
    },
    /// Every rank waits until all ranks arrive.
    Barrier,
    /// Every rank receives a handle on a new group over the same ranks.
    Duplicate,
    /// Every rank receives a handle on a new group of the ranks that passed the same color
    /// (the colors differ between ranks by design, so they are not part of the call).
    Split,
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
            CollectiveOp::Split => f.write_str("split"),
            CollectiveOp::AllToAll => f.write_str("all_to_all"),
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

/// The dtypes a fingerprint names, by their code (index + 1; 0 is "no buffer").
const DTYPE_CODES: [DType; 13] = [
    DType::F64,
    DType::F32,
    DType::Flex32,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U64,
    DType::U32,
    DType::U16,
    DType::U8,
];

impl CollectiveCall {
    /// The call's fingerprint as bytes, for comparing schedules across processes: the op (and
    /// its reduction or root), the dtype and the size; the position travels beside it.
    pub fn fingerprint(&self) -> Vec<u8> {
        let (op, arg): (u8, u64) = match self.op {
            CollectiveOp::AllGather => (0, 0),
            CollectiveOp::ReduceScatter(op) => (1, reduce_code(op)),
            CollectiveOp::AllReduce(op) => (2, reduce_code(op)),
            CollectiveOp::Broadcast { root } => (3, root as u64),
            CollectiveOp::Barrier => (4, 0),
            CollectiveOp::Duplicate => (5, 0),
            CollectiveOp::Split => (6, 0),
            CollectiveOp::AllToAll => (7, 0),
        };
        let dtype = match self.dtype {
            None => 0u8,
            Some(dtype) => DTYPE_CODES
                .iter()
                .position(|&known| known == dtype)
                .map_or(u8::MAX, |index| index as u8 + 1),
        };
        let mut bytes = Vec::with_capacity(18);
        bytes.push(op);
        bytes.extend_from_slice(&arg.to_be_bytes());
        bytes.push(dtype);
        bytes.extend_from_slice(&(self.numel as u64).to_be_bytes());
        bytes
    }

    /// The call at position `seq` whose fingerprint is `bytes`; `None` for bytes that are no
    /// fingerprint.
    pub fn from_fingerprint(seq: u64, bytes: &[u8]) -> Option<CollectiveCall> {
        if bytes.len() != 18 {
            return None;
        }
        let arg = u64::from_be_bytes(bytes[1..9].try_into().ok()?);
        let reduce = || match arg {
            0 => Some(ReduceOp::Sum),
            1 => Some(ReduceOp::Mean),
            2 => Some(ReduceOp::Max),
            3 => Some(ReduceOp::Min),
            _ => None,
        };
        let op = match bytes[0] {
            0 => CollectiveOp::AllGather,
            1 => CollectiveOp::ReduceScatter(reduce()?),
            2 => CollectiveOp::AllReduce(reduce()?),
            3 => CollectiveOp::Broadcast {
                root: usize::try_from(arg).ok()?,
            },
            4 => CollectiveOp::Barrier,
            5 => CollectiveOp::Duplicate,
            6 => CollectiveOp::Split,
            7 => CollectiveOp::AllToAll,
            _ => return None,
        };
        let dtype = match bytes[9] {
            0 => None,
            code => Some(*DTYPE_CODES.get(code as usize - 1)?),
        };
        let numel = usize::try_from(u64::from_be_bytes(bytes[10..18].try_into().ok()?)).ok()?;
        Some(CollectiveCall {
            seq,
            op,
            dtype,
            numel,
        })
    }
}

fn reduce_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
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
    fn fingerprints_read_back_as_the_call() {
        let calls = [
            (CollectiveOp::AllGather, Some(DType::F32), 4096),
            (
                CollectiveOp::ReduceScatter(ReduceOp::Sum),
                Some(DType::BF16),
                1 << 33,
            ),
            (CollectiveOp::AllReduce(ReduceOp::Max), Some(DType::F16), 3),
            (
                CollectiveOp::AllReduce(ReduceOp::Mean),
                Some(DType::Flex32),
                1,
            ),
            (CollectiveOp::Broadcast { root: 5 }, Some(DType::F64), 7),
            (CollectiveOp::Barrier, None, 0),
            (CollectiveOp::Duplicate, None, 0),
            (CollectiveOp::Split, None, 0),
        ];
        let mut seen = std::collections::HashSet::new();
        for (seq, (op, dtype, numel)) in calls.into_iter().enumerate() {
            let call = CollectiveCall {
                seq: seq as u64 + 1,
                op,
                dtype,
                numel,
            };
            let bytes = call.fingerprint();
            assert!(seen.insert(bytes.clone()), "{call}: fingerprint not unique");
            assert_eq!(
                CollectiveCall::from_fingerprint(call.seq, &bytes),
                Some(call)
            );
        }
        assert_eq!(CollectiveCall::from_fingerprint(1, b"garbage"), None);
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
