//! Error paths: diverged schedules, a rank that panics, a rank that never arrives, a rank that
//! leaves early, invalid calls. Every rank must get the documented error within the timeout,
//! and the process must stay usable (a new group works).

mod common;

use std::thread::sleep;
use std::time::{Duration, Instant};

use burn::backend::NdArray;
use burn::tensor::{DType, Tensor};
use burn_zero_comm::{
    CollectiveOp, CommError, LaunchError, LaunchOptions, RankFailure, ReduceOp, launch, launch_with,
};
use common::{input, tensor};

type B = NdArray;

fn zeros(len: usize) -> Tensor<B, 1> {
    Tensor::zeros([len], &Default::default())
}

fn options(timeout_ms: u64) -> LaunchOptions {
    LaunchOptions::with_timeout(Duration::from_millis(timeout_ms))
}

/// A fresh group still works after a failed one.
fn assert_new_group_works() {
    let sums = launch::<B, _, _, CommError>(3, &[Default::default()], |ctx| {
        let x = Tensor::<B, 1>::ones([5], ctx.device());
        Ok(common::values(ctx.comm().all_reduce(x, ReduceOp::Sum)?))
    })
    .expect("a new group works after a failed one");
    assert_eq!(sums, vec![vec![3.0; 5]; 3]);
}

#[test]
fn diverged_schedule_names_both_sides_on_every_rank() {
    let errors =
        launch_with::<B, _, _, CommError>(2, &[Default::default()], &options(30_000), |ctx| {
            let comm = ctx.comm();
            comm.barrier()?;
            comm.all_reduce(zeros(10), ReduceOp::Sum)?;
            // Third collective: rank 0 reduce-scatters, rank 1 (arriving later) all-gathers.
            let third = if ctx.rank() == 0 {
                comm.reduce_scatter(zeros(4096), ReduceOp::Sum)
            } else {
                sleep(Duration::from_millis(100));
                comm.all_gather(zeros(2048))
            };
            let error = third.expect_err("diverged schedules must fail");
            // The group stays failed for every later call.
            assert_eq!(comm.barrier().expect_err("group has failed"), error);
            Ok(error)
        })
        .unwrap();

    assert_eq!(errors[0], errors[1], "every rank gets the same error");
    let message = errors[0].to_string();
    assert_eq!(
        message,
        "collective schedules diverged: rank 1 called all_gather of 2048 f32 as its 3rd \
         collective, rank 0 called reduce_scatter(sum) of 4096 f32 as its 3rd collective"
    );
    match &errors[0] {
        CommError::Mismatch {
            call, other_call, ..
        } => {
            assert_eq!(call.op, CollectiveOp::AllGather);
            assert_eq!(other_call.op, CollectiveOp::ReduceScatter(ReduceOp::Sum));
        }
        other => panic!("expected a mismatch, got {other}"),
    }
    assert_new_group_works();
}

#[test]
fn diverged_dtype_or_size_is_a_mismatch() {
    let errors = launch_with::<burn::backend::Flex, _, _, CommError>(
        2,
        &[Default::default()],
        &options(30_000),
        |ctx| {
            let dtype = if ctx.rank() == 0 {
                DType::F32
            } else {
                DType::F16
            };
            let x = Tensor::<burn::backend::Flex, 1>::zeros([8], (ctx.device(), dtype));
            Ok(ctx.comm().all_gather(x).expect_err("dtypes differ"))
        },
    )
    .unwrap();
    assert!(errors[0].to_string().contains(" f16 "), "{}", errors[0]);
    assert!(errors[0].to_string().contains(" f32 "), "{}", errors[0]);

    let errors =
        launch_with::<B, _, _, CommError>(3, &[Default::default()], &options(30_000), |ctx| {
            let len = if ctx.rank() == 2 { 9 } else { 8 };
            Ok(ctx
                .comm()
                .all_reduce(zeros(len), ReduceOp::Max)
                .expect_err("sizes differ"))
        })
        .unwrap();
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, CommError::Mismatch { .. }))
    );
    assert!(errors[0].to_string().contains("of 9 f32"), "{}", errors[0]);
}

#[test]
fn panicking_rank_unblocks_the_others_and_is_reported() {
    let started = Instant::now();
    let seen = std::sync::Mutex::new(Vec::new());
    let result =
        launch_with::<B, _, _, CommError>(3, &[Default::default()], &options(60_000), |ctx| {
            if ctx.rank() == 2 {
                sleep(Duration::from_millis(50));
                panic!("boom on purpose");
            }
            let outcome = ctx.comm().all_reduce(zeros(1000), ReduceOp::Sum).map(drop);
            seen.lock().unwrap().push((ctx.rank(), outcome.clone()));
            outcome
        });
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "ranks must not wait for the timeout"
    );
    match result {
        Err(LaunchError::RankFailed {
            rank,
            failure,
            others,
        }) => {
            assert_eq!(rank, 2);
            assert_eq!(failure, RankFailure::Panicked("boom on purpose".into()));
            let mut other_ranks: Vec<usize> = others.iter().map(|(r, _)| *r).collect();
            other_ranks.sort();
            assert_eq!(other_ranks, [0, 1]);
        }
        other => panic!("expected rank 2 to be reported, got {other:?}"),
    }
    for (rank, outcome) in seen.into_inner().unwrap() {
        assert_eq!(
            outcome,
            Err(CommError::PeerFailed {
                rank: 2,
                reason: "panicked: boom on purpose".into()
            }),
            "rank {rank}"
        );
    }
    assert_new_group_works();
}

#[test]
fn erroring_rank_is_reported_with_its_error() {
    let result =
        launch_with::<B, _, _, String>(2, &[Default::default()], &options(60_000), |ctx| {
            if ctx.rank() == 0 {
                return Err("data file missing".to_string());
            }
            ctx.comm().barrier().map_err(|e| e.to_string())
        });
    let error = result.expect_err("rank 0 failed");
    assert_eq!(
        error.to_string(),
        "rank 0 returned an error: data file missing (rank(s) 1 stopped as a consequence)"
    );
}

#[test]
fn missing_rank_times_out_on_every_rank() {
    let timeout = Duration::from_millis(300);
    let errors =
        launch_with::<B, _, _, CommError>(3, &[Default::default()], &options(300), |ctx| {
            if ctx.rank() == 1 {
                // Busy elsewhere far longer than the timeout, then tries to join in.
                sleep(timeout * 4);
            }
            let started = Instant::now();
            let error = ctx.comm().barrier().expect_err("rank 1 is missing");
            if ctx.rank() != 1 {
                let waited = started.elapsed();
                // The first rank to arrive times out; one that arrived a little later has
                // waited a little less when the failure reaches it.
                assert!(waited >= timeout / 2, "gave up after {waited:?}");
                // Promptly after the timeout (generous margin for a loaded CI machine).
                assert!(
                    waited < timeout + Duration::from_secs(3),
                    "waited {waited:?}"
                );
            }
            Ok(error)
        })
        .unwrap();
    assert!(errors.iter().all(|e| e == &errors[0]), "{errors:?}");
    match &errors[0] {
        CommError::Timeout { missing, call, .. } => {
            assert_eq!(missing, &[1]);
            assert_eq!(call.seq, 1);
        }
        other => panic!("expected a timeout, got {other}"),
    }
    assert!(errors[0].to_string().contains("rank(s) [1] never arrived"));
    assert_new_group_works();
}

#[test]
fn rank_that_left_early_is_named() {
    let started = Instant::now();
    let result =
        launch_with::<B, _, _, CommError>(2, &[Default::default()], &options(60_000), |ctx| {
            if ctx.rank() == 0 {
                return Ok(());
            }
            ctx.comm().all_gather(zeros(3)).map(drop)
        });
    assert!(started.elapsed() < Duration::from_secs(10));
    match result {
        Err(LaunchError::RankFailed {
            rank: 1,
            failure: RankFailure::Errored(reason),
            ..
        }) => assert!(
            reason.starts_with("rank 0 left the group while rank 1 waited in all_gather of 3 f32"),
            "{reason}"
        ),
        other => panic!("expected rank 1 to fail, got {other:?}"),
    }
}

#[test]
fn invalid_calls_fail_the_whole_group() {
    let errors =
        launch_with::<B, _, _, CommError>(2, &[Default::default()], &options(30_000), |ctx| {
            Ok(ctx
                .comm()
                .reduce_scatter(zeros(7), ReduceOp::Sum)
                .expect_err("7 is odd"))
        })
        .unwrap();
    assert_eq!(
        errors[0],
        CommError::NotDivisible {
            numel: 7,
            world_size: 2
        }
    );
    assert_eq!(errors[0], errors[1]);

    let errors =
        launch_with::<B, _, _, CommError>(2, &[Default::default()], &options(30_000), |ctx| {
            Ok(ctx.comm().broadcast(zeros(4), 2).expect_err("no rank 2"))
        })
        .unwrap();
    assert_eq!(
        errors[0].to_string(),
        "broadcast root 2 is not a rank of a group of 2"
    );
}

#[test]
fn invalid_launches_are_refused() {
    let devices = vec![Default::default(); 2];
    let error =
        launch::<B, _, _, CommError>(3, &devices, |_| Ok(())).expect_err("2 devices, 3 ranks");
    assert!(
        error.to_string().contains("2 devices given for 3 ranks"),
        "{error}"
    );
    let error = launch::<B, _, _, CommError>(0, &devices[..1], |_| Ok(())).expect_err("no ranks");
    assert!(
        error.to_string().contains("world size must be at least 1"),
        "{error}"
    );
}

#[test]
fn collectives_keep_going_after_many_rounds() {
    // Fast and slow ranks interleave over many rounds without mixing them up.
    let results = launch::<B, _, _, CommError>(4, &[Default::default()], |ctx| {
        let mut last = Vec::new();
        for step in 0..200u64 {
            if (step + ctx.rank() as u64).is_multiple_of(7) {
                std::thread::yield_now();
            }
            let x = tensor::<B, f32>(&input(step, ctx.rank(), 5), ctx.device());
            last = common::values(ctx.comm().all_reduce(x, ReduceOp::Sum)?);
        }
        Ok(last)
    })
    .unwrap();
    assert!(results.iter().all(|r| r == &results[0]));
}
