//! Small agreements among the ranks: every rank contributes a few numbers and learns every
//! rank's, so that all of them take the same decision (go on, stop, report a failure) and none
//! enters a collective the others skip.
//!
//! The numbers travel as f32 through an ordinary all-gather, on whatever engine and device the
//! ranks use. Counts and sizes go as two 16-bit halves each ([`halves`]), exact in f32.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::communicator::Communicator;
use crate::error::CommError;

/// Every rank's `values`, in rank order. Every rank passes the same number of values.
pub fn exchange<B: Backend>(
    comm: &dyn Communicator<B>,
    device: &B::Device,
    values: &[f32],
) -> Result<Vec<Vec<f32>>, CommError> {
    let width = values.len();
    let block = Tensor::<B, 1>::from_data(TensorData::new(values.to_vec(), [width]), device);
    let all = comm
        .all_gather(block)?
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|error| CommError::Device {
            rank: comm.rank(),
            reason: format!("reading the ranks' agreement: {error:?}"),
        })?;
    if all.len() != width * comm.world_size() {
        return Err(CommError::InvalidGroup(format!(
            "an agreement of {width} values per rank came back with {} values from {} ranks",
            all.len(),
            comm.world_size()
        )));
    }
    Ok(all.chunks(width.max(1)).map(<[f32]>::to_vec).collect())
}

/// Which ranks failed, in rank order, when this rank's own outcome is `failure` (its error
/// message, or `None` when it succeeded). A rank that failed reports its failure to the group
/// first ([`Communicator::report_failure`]), before any other rank can learn of it, so the job's
/// error names it as the cause and the ranks that stop because of it as consequences.
pub fn failed_ranks<B: Backend>(
    comm: &dyn Communicator<B>,
    device: &B::Device,
    failure: Option<&str>,
) -> Result<Vec<usize>, CommError> {
    if let Some(reason) = failure {
        comm.report_failure(reason);
    }
    let flag = if failure.is_some() { 1.0 } else { 0.0 };
    let all = exchange(comm, device, &[flag])?;
    Ok(all
        .iter()
        .enumerate()
        .filter(|(_, flag)| flag[0] > 0.5)
        .map(|(rank, _)| rank)
        .collect())
}

/// `n` as two f32 that hold its high and low 16 bits exactly. Values of 2³² and more do not fit.
pub fn halves(n: usize) -> Result<[f32; 2], CommError> {
    u32::try_from(n)
        .map(|n| [(n >> 16) as f32, (n & 0xFFFF) as f32])
        .map_err(|_| {
            CommError::InvalidGroup(format!("{n} is too large to agree on (at most 2³² − 1)"))
        })
}

/// The value [`halves`] split, from its two halves.
pub fn from_halves(halves: &[f32]) -> usize {
    ((halves[0] as usize) << 16) | halves[1] as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_round_trip_exactly() {
        for n in [0, 1, 0xFFFF, 0x1_0000, 123_456_789, u32::MAX as usize] {
            assert_eq!(from_halves(&halves(n).unwrap()), n);
        }
        assert!(halves(1 << 40).is_err());
    }
}
