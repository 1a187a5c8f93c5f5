//! The MPI engine (feature `mpi`) across processes: the test binary starts itself again as the
//! ranks, under `mpirun` and as separately started programs joined through Open MPI's name
//! server (what `zero-run` does). Tests print `SKIPPED: <test>: <reason>` where Open MPI's
//! programs are missing (unless `BURN_ZERO_REQUIRE_MPI=1`); built without the `mpi` feature,
//! every test says it was skipped.

#[cfg(feature = "mpi")]
#[path = "mpi/engine.rs"]
mod engine;
#[cfg(feature = "mpi")]
#[path = "mpi/rank.rs"]
mod rank;

#[cfg(not(feature = "mpi"))]
burn_zero_testing::skipped_without_feature!(
    "mpi",
    collectives_equal_local_group_bitwise_under_mpirun,
    collectives_equal_local_group_bitwise_on_ndarray_and_wgpu,
    separately_started_ranks_join_one_world_and_agree_bitwise,
    a_panicking_rank_stops_the_others_with_its_cause,
    a_rank_that_never_answers_times_the_others_out,
    a_diverged_schedule_is_named_on_every_rank,
    without_a_name_server_separately_started_ranks_are_told_what_to_do,
);

/// The list above names every test of `engine.rs`.
#[cfg(feature = "mpi")]
#[test]
fn every_test_is_reported_when_built_without_mpi() {
    use burn_zero_testing::skip::{skipped_names, test_names};
    assert_eq!(
        skipped_names(include_str!("mpi.rs")),
        test_names(include_str!("mpi/engine.rs"))
    );
}
