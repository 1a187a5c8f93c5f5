//! Training on CUDA with NCCL (feature `cuda`): `Zero` over the CUDA backend with `NcclGroup`
//! against the same run with `LocalGroup`, in one process and as one process per GPU under
//! `zero-run`. Every test prints `SKIPPED: <test>: <reason>` and passes when no CUDA device is
//! visible (unless `BURN_ZERO_REQUIRE_CUDA=1`), or when built without the `cuda` feature.

#[cfg(feature = "cuda")]
#[path = "cuda/training.rs"]
mod training;

#[cfg(not(feature = "cuda"))]
burn_zero_testing::skipped_without_feature!(
    "cuda",
    zero_on_cuda_trains_like_local_group_at_world_size_one,
    zero_on_nccl_trains_like_local_group_on_every_gpu,
    the_auto_placement_plans_for_the_gpus_own_capacity,
    train_gpt_runs_one_process_per_gpu_under_zero_run,
    three_nccl_processes_on_one_gpu_in_rank_order_train_bitwise_like_one_rank,
    a_checkpoint_of_three_nccl_processes_resumes_on_two_bitwise_like_local_group,
    nccl_processes_sharing_a_gpu_under_zero_run_train_bitwise_like_local_group,
    a_rank_process_killed_mid_step_on_a_shared_gpu_is_named_by_zero_run,
);

/// The list above names every test of `training.rs`.
#[cfg(feature = "cuda")]
#[test]
fn every_test_is_reported_when_built_without_cuda() {
    use burn_zero_testing::skip::{skipped_names, test_names};
    assert_eq!(
        skipped_names(include_str!("cuda.rs")),
        test_names(include_str!("cuda/training.rs"))
    );
}
