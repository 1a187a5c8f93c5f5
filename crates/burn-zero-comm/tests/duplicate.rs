//! `Communicator::duplicate`: a second group over the same ranks, used by a second thread of
//! every rank while the first keeps using the original group.

mod common;

use std::thread;
use std::time::Duration;

use burn::backend::NdArray;
use burn::tensor::Tensor;
use burn_zero_comm::{
    CommError, Communicator, GroupOptions, LaunchOptions, LocalGroup, ReduceOp, launch, launch_with,
};
use common::values;

type B = NdArray;

#[test]
fn two_threads_per_rank_use_independent_sequences() {
    // Each rank runs 50 all-reduces on the original group and, at the same time on a second
    // thread, 50 all-gathers on the duplicate. The interleaving differs from rank to rank; the
    // results must not.
    let results = launch::<B, _, _, CommError>(3, &[Default::default()], |ctx| {
        let comm = ctx.comm();
        let side = comm.duplicate()?;
        let rank = ctx.rank() as f32;
        let device = *ctx.device();
        let gathered = thread::scope(|scope| {
            let worker = scope.spawn(|| -> Result<Vec<Vec<f32>>, CommError> {
                (0..50)
                    .map(|i| {
                        let block = Tensor::<B, 1>::from_floats([rank, i as f32], &device);
                        side.all_gather(block).map(values)
                    })
                    .collect()
            });
            let sums: Result<Vec<Vec<f32>>, CommError> = (0..50)
                .map(|i| {
                    let x = Tensor::<B, 1>::from_floats([rank + i as f32; 3], ctx.device());
                    comm.all_reduce(x, ReduceOp::Sum).map(values)
                })
                .collect();
            let gathered = worker.join().expect("side thread");
            Ok::<_, CommError>((sums?, gathered?))
        })?;
        Ok(gathered)
    })
    .unwrap();

    for (sums, gathered) in results {
        for (i, sum) in sums.iter().enumerate() {
            assert_eq!(sum, &vec![3.0 + 3.0 * i as f32; 3]);
        }
        for (i, blocks) in gathered.iter().enumerate() {
            let i = i as f32;
            assert_eq!(blocks, &vec![0.0, i, 1.0, i, 2.0, i]);
        }
    }
}

#[test]
fn a_duplicate_of_a_duplicate_works() {
    let results = launch::<B, _, _, CommError>(2, &[Default::default()], |ctx| {
        let second = ctx.comm().duplicate()?;
        let third = second.duplicate()?;
        let x = Tensor::<B, 1>::from_floats([ctx.rank() as f32 + 1.0; 4], ctx.device());
        Ok(values(third.reduce_scatter(x, ReduceOp::Sum)?))
    })
    .unwrap();
    assert_eq!(results, vec![vec![3.0, 3.0], vec![3.0, 3.0]]);
}

#[test]
fn a_failure_on_the_duplicate_ends_the_original_and_back() {
    let options = LaunchOptions::with_timeout(Duration::from_secs(30));
    let errors = launch_with::<B, _, _, CommError>(2, &[Default::default()], &options, |ctx| {
        let comm = ctx.comm();
        let side = comm.duplicate()?;
        if ctx.rank() == 0 {
            // Rank 0 fails on the duplicate; rank 1 waits on the original group.
            side.abort("pack kernel failed");
            Ok(comm.barrier().expect_err("the original group ended"))
        } else {
            Ok(comm.barrier().expect_err("the original group ended"))
        }
    })
    .unwrap();
    for error in &errors {
        assert!(
            matches!(error, CommError::PeerFailed { rank: 0, reason } if reason == "pack kernel failed"),
            "{error}"
        );
    }

    // The other way round, with bare handles (launch reports an aborting rank as failed).
    let groups = LocalGroup::<B>::with_options(
        2,
        GroupOptions {
            timeout: Duration::from_secs(30),
        },
    )
    .unwrap();
    let errors: Vec<CommError> = thread::scope(|scope| {
        let workers: Vec<_> = groups
            .iter()
            .map(|comm| {
                scope.spawn(move || {
                    let side = comm.duplicate().expect("duplicate");
                    if comm.rank() == 1 {
                        comm.abort("optimizer failed");
                    }
                    // The waiting rank notices through the parent within its poll interval,
                    // not after the 30 s timeout (which would be a Timeout error).
                    side.barrier().expect_err("the duplicate ended")
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    for error in &errors {
        assert!(
            matches!(error, CommError::PeerFailed { rank: 1, reason } if reason == "optimizer failed"),
            "{error}"
        );
    }
}

#[test]
fn duplicate_is_checked_against_the_schedule() {
    let options = LaunchOptions::with_timeout(Duration::from_secs(30));
    let errors = launch_with::<B, _, _, CommError>(2, &[Default::default()], &options, |ctx| {
        let comm = ctx.comm();
        let outcome = if ctx.rank() == 0 {
            comm.duplicate().map(drop)
        } else {
            comm.barrier()
        };
        Ok(outcome.expect_err("diverged schedules fail"))
    })
    .unwrap();
    assert_eq!(errors[0], errors[1]);
    let message = errors[0].to_string();
    assert!(
        message.contains("duplicate") && message.contains("barrier"),
        "{message}"
    );
}
