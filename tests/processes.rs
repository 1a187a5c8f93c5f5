//! Training through the process path on CPU: `train_gpt` and `learner_gpt` as one process per
//! rank under `mpirun`, `zero-run` and Slurm-shaped variables, joined by MPI (feature `mpi`),
//! against one rank in this process; a rank killed or panicking mid-step, a rank that never
//! arrives, a checkpoint saved by 3 processes and resumed by 2.
//!
//! The programs are the ones built beside this test binary (`cargo build --features mpi
//! --example train_gpt --example learner_gpt`, and `zero-run`); a test without Open MPI's
//! `mpirun` prints `SKIPPED: <test>: <reason>` (a failure under `BURN_ZERO_REQUIRE_MPI=1`).
//! Built without the `mpi` feature, every test says it was skipped.

#[cfg(feature = "mpi")]
#[path = "processes/training.rs"]
mod training;

#[cfg(not(feature = "mpi"))]
burn_zero_testing::skipped_without_feature!(
    "mpi",
    flex_ranks_under_mpirun_train_bitwise_like_one_rank_at_every_stage,
    flex_ranks_reducing_in_rank_order_under_mpirun_train_bitwise_like_one_rank,
    flex_ranks_under_zero_run_train_bitwise_like_one_rank_at_every_stage,
    srun_shaped_tasks_join_through_the_name_server_and_train_bitwise,
    the_learner_trains_one_process_per_rank_like_threads,
    a_checkpoint_saved_by_three_processes_resumes_on_two_bitwise,
    a_rank_killed_mid_step_is_named_by_zero_run_and_resume_continues_bitwise,
    a_panicking_rank_is_named_by_zero_run_with_its_message,
    a_rank_that_never_arrives_is_a_named_error_within_the_timeout,
    ndarray_ranks_under_mpirun_stay_within_the_measured_noise,
    wgpu_ranks_under_mpirun_train_bitwise_like_threads,
);

/// The list above names every test of `training.rs`.
#[cfg(feature = "mpi")]
#[test]
fn every_test_is_reported_when_built_without_mpi() {
    use burn_zero_testing::skip::{skipped_names, test_names};
    assert_eq!(
        skipped_names(include_str!("processes.rs")),
        test_names(include_str!("processes/training.rs"))
    );
}
