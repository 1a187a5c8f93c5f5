//! New groups from a group: `Communicator::duplicate`, a second group over the same ranks,
//! used by a second thread of every rank while the first keeps using the original group; and
//! `Communicator::split`, groups of the ranks that pass the same color, as hybrid sharding
//! makes them (one group per node, and one across nodes per position in a node).

mod common;

use std::thread;
use std::time::Duration;

use burn::backend::NdArray;
use burn::tensor::Tensor;
use std::sync::Arc;

use burn_zero_comm::{
    CommError, Communicator, GroupOptions, LaunchOptions, LocalGroup, OrderedComm, ReduceOp,
    launch, launch_with,
};
use burn_zero_testing::recording::{CallLog, RecordingComm};
use common::{input, reduce, tensor, values};

type B = NdArray;

#[test]
fn two_threads_per_rank_use_independent_sequences() {
    // Each rank runs 50 all-reduces on the original group and, at the same time on a second
    // thread, 50 all-gathers on the duplicate. The interleaving differs from rank to rank; the
    // results must not.
    let results = launch::<B, _, _, CommError>(3, &[Default::default()], |ctx| {
        let comm = ctx.engine();
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
        let second = ctx.engine().duplicate()?;
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
        let comm = ctx.engine();
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
        let comm = ctx.engine();
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

/// Ranks of `world` in shard groups of `shard` contiguous ranks: each rank's group, its rank in
/// it, and the members of its replica group (same position in every shard group).
fn hybrid(rank: usize, shard: usize) -> (usize, usize) {
    (rank / shard, rank % shard)
}

#[test]
fn split_groups_of_contiguous_ranks_and_across_them_reduce_in_member_order() {
    // 6 ranks as 2 shard groups of 3 and as 3 shard groups of 2.
    for shard in [3, 2] {
        let world = 6;
        let len = 12;
        let results = launch::<B, _, _, CommError>(world, &[Default::default()], |ctx| {
            let comm = ctx.engine();
            let (group, position) = hybrid(ctx.rank(), shard);
            let within = comm.split(group)?;
            let across = comm.split(position)?;
            let x = tensor::<B, f32>(&input(7, ctx.rank(), len), ctx.device());
            let summed = values(within.all_reduce(x.clone(), ReduceOp::Sum)?);
            // Hybrid sharding's gradient reduction: reduce-scatter inside the group, then
            // all-reduce of the block across the groups.
            let block = within.reduce_scatter(x, ReduceOp::Sum)?;
            let hybrid = values(across.all_reduce(block, ReduceOp::Sum)?);
            let ranks = [
                within.rank(),
                within.world_size(),
                across.rank(),
                across.world_size(),
            ];
            Ok((ranks, summed, hybrid))
        })
        .unwrap();
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(7, r, len)).collect();
        let groups = world / shard;
        for (rank, (ranks, summed, hybrid_result)) in results.iter().enumerate() {
            let (group, position) = hybrid(rank, shard);
            assert_eq!(*ranks, [position, shard, group, groups], "rank {rank}");
            // Within: the group's members in rank order.
            let members = &inputs[group * shard..(group + 1) * shard];
            assert_eq!(*summed, reduce(members, ReduceOp::Sum), "rank {rank}");
            // Hybrid: each group's sum in rank order, then the groups' sums in group order,
            // of this rank's block.
            let block = len / shard;
            let range = position * block..(position + 1) * block;
            let partials: Vec<Vec<f32>> = (0..groups)
                .map(|g| {
                    reduce(&inputs[g * shard..(g + 1) * shard], ReduceOp::Sum)[range.clone()]
                        .to_vec()
                })
                .collect();
            assert_eq!(
                *hybrid_result,
                reduce(&partials, ReduceOp::Sum),
                "rank {rank}"
            );
        }
    }
}

#[test]
fn a_color_may_leave_a_rank_alone() {
    let results = launch::<B, _, _, CommError>(3, &[Default::default()], |ctx| {
        let alone = ctx.rank() == 1;
        let group = ctx.engine().split(usize::from(alone))?;
        let x = Tensor::<B, 1>::from_floats([ctx.rank() as f32 + 1.0; 2], ctx.device());
        Ok((
            group.world_size(),
            values(group.all_reduce(x, ReduceOp::Sum)?),
        ))
    })
    .unwrap();
    assert_eq!(results[0], (2, vec![4.0, 4.0]));
    assert_eq!(results[1], (1, vec![2.0, 2.0]));
    assert_eq!(results[2], (2, vec![4.0, 4.0]));
}

#[test]
fn split_groups_of_an_ordered_comm_issue_from_its_one_thread() {
    // The collectives of a rank's groups split from its ordered communicator all leave from the
    // rank's one issuing thread, in the order the rank made them: one order over all groups.
    let seen = launch::<B, _, _, CommError>(4, &[Default::default()], |ctx| {
        let log = CallLog::default();
        let engine: Arc<dyn Communicator<B>> =
            Arc::new(RecordingComm::new(ctx.engine().clone(), log.clone()));
        let ordered = OrderedComm::new(engine);
        let within = ordered.split(ctx.rank() / 2)?;
        let across = ordered.split(ctx.rank() % 2)?;
        let one = Tensor::<B, 1>::from_floats([1.0, 1.0], ctx.device());
        let summed = values(within.all_reduce(one, ReduceOp::Sum)?);
        let me = Tensor::<B, 1>::from_floats([ctx.rank() as f32], ctx.device());
        let gathered = values(across.all_gather(me)?);
        ordered.barrier()?;
        let log = log.lock().unwrap().clone();
        Ok((log, thread::current().id(), summed, gathered))
    })
    .unwrap();
    for (rank, (log, caller, summed, gathered)) in seen.iter().enumerate() {
        let calls: Vec<&str> = log.iter().map(|(call, _)| call.as_str()).collect();
        assert_eq!(
            calls,
            ["split", "split", "all_reduce 2", "all_gather 1", "barrier"],
            "rank {rank}"
        );
        let issuer = log[0].1;
        assert_ne!(
            issuer, *caller,
            "rank {rank}: issued from the calling thread"
        );
        assert!(
            log.iter().all(|(_, thread)| *thread == issuer),
            "rank {rank}"
        );
        assert_eq!(*summed, vec![2.0, 2.0]);
        let first = (rank % 2) as f32;
        assert_eq!(*gathered, vec![first, first + 2.0], "rank {rank}");
    }
}

#[test]
fn a_failure_in_a_split_group_ends_the_parent() {
    let options = LaunchOptions::with_timeout(Duration::from_secs(30));
    let errors = launch_with::<B, _, _, CommError>(4, &[Default::default()], &options, |ctx| {
        let comm = ctx.engine();
        let within = comm.split(ctx.rank() / 2)?;
        if ctx.rank() == 3 {
            within.abort("rank 3's pack kernel failed");
        }
        // Every rank, also those of the other group, learns of it on the parent.
        Ok(comm.barrier().expect_err("the parent group ended"))
    })
    .unwrap();
    for error in &errors {
        assert!(
            // Named as the job numbers it, not as its group does (rank 1 of ranks 2 and 3).
            matches!(error, CommError::PeerFailed { rank: 3, reason } if reason == "rank 3's pack kernel failed"),
            "{error}"
        );
    }
}
