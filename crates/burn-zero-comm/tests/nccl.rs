//! The NCCL engine (feature `cuda`). Tests that need a GPU print `SKIPPED: <test>: <reason>`
//! and pass when no CUDA device is visible (unless `BURN_ZERO_REQUIRE_CUDA=1`); the others run
//! everywhere. Built without the `cuda` feature, every test says it was skipped.
//!
//! On a CUDA machine, `libnccl.so` must be loadable (see scripts/gpu-check.sh).

#[cfg(feature = "cuda")]
#[path = "nccl/engine.rs"]
mod engine;

#[cfg(not(feature = "cuda"))]
burn_zero_testing::skipped_without_feature!(
    "cuda",
    nccl_matches_local_group_at_world_size_one,
    nccl_matches_local_group_on_every_gpu,
    issued_collectives_are_read_in_any_order_on_another_thread,
    fused_collectives_issued_in_a_lent_queue_read_their_pending_inputs,
    an_invalid_call_fails_the_group_for_good,
    a_duplicate_works_and_shares_the_fate_of_its_group,
    a_rank_that_stops_early_does_not_hang_the_others,
    ranks_in_separate_processes_meet_through_the_environment,
    three_ranks_on_one_gpu_reduce_in_rank_order_bitwise_as_local_group,
    without_cuda_the_engine_reports_what_is_missing,
    every_gpu_reports_its_memory_and_an_allocation_takes_from_the_free_part,
    without_a_device_the_capacity_is_a_named_error,
);

/// The list above names every test of `engine.rs`.
#[cfg(feature = "cuda")]
#[test]
fn every_test_is_reported_when_built_without_cuda() {
    use burn_zero_testing::skip::{skipped_names, test_names};
    assert_eq!(
        skipped_names(include_str!("nccl.rs")),
        test_names(include_str!("nccl/engine.rs"))
    );
}
