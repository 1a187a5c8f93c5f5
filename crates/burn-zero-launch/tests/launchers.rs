//! Each launcher's environment from fixtures that hold its variables and nothing else: which
//! launcher is detected, what it says, nested launchers, and malformed values refused by name
//! before any network call.

use std::collections::HashMap;

use burn_zero_launch::env::{
    DEFAULT_PORT, Detected, DistEnv, EnvError, EnvSource, MASTER_ADDR, MASTER_PORT, derived_port,
};

fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<Result<String, String>> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |var| map.get(var).cloned().map(Ok)
}

fn detect(vars: &[(&str, &str)]) -> Result<Detected, EnvError> {
    DistEnv::detect_with(lookup(vars))
}

fn detected(vars: &[(&str, &str)]) -> Detected {
    detect(vars).unwrap_or_else(|error| panic!("{error}"))
}

fn with(
    base: &[(&'static str, &'static str)],
    extra: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    let mut vars: Vec<_> = base
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .copied()
        .collect();
    vars.extend_from_slice(extra);
    vars
}

fn env(
    rank: usize,
    world_size: usize,
    local: (usize, Option<usize>),
    master: (&str, u16),
) -> DistEnv {
    DistEnv {
        rank,
        world_size,
        local_rank: local.0,
        local_world_size: local.1,
        master_addr: master.0.into(),
        master_port: master.1,
    }
}

// --- torchrun-style and Kubeflow ----------------------------------------------------------

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("WORLD_SIZE", "16"),
    ("LOCAL_RANK", "5"),
    ("LOCAL_WORLD_SIZE", "8"),
    ("MASTER_ADDR", "node0"),
    ("MASTER_PORT", "29500"),
];

const KUBEFLOW: &[(&str, &str)] = &[
    ("RANK", "3"),
    ("WORLD_SIZE", "4"),
    ("MASTER_ADDR", "train-master-0"),
    ("MASTER_PORT", "23456"),
    ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
];

#[test]
fn torchrun_variables() {
    let found = detected(TORCHRUN);
    assert_eq!(found.source, EnvSource::Torchrun);
    assert_eq!(found.env, env(5, 16, (5, Some(8)), ("node0", 29500)));
    assert_eq!(found.master_origin.addr, MASTER_ADDR);
    assert_eq!(found.master_origin.port, MASTER_PORT);
}

#[test]
fn kubeflow_pod_is_one_rank_per_pod() {
    let found = detected(KUBEFLOW);
    assert_eq!(found.source, EnvSource::Kubeflow);
    assert_eq!(
        found.env,
        env(3, 4, (0, Some(1)), ("train-master-0", 23456))
    );
    assert!(found.to_string().contains("Kubeflow PyTorchJob"), "{found}");
}

#[test]
fn kubeflow_pod_running_torchrun_reads_torchrun() {
    let vars = with(KUBEFLOW, &[("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")]);
    let found = detected(&vars);
    assert_eq!(found.source, EnvSource::Torchrun);
    assert_eq!(found.env.local_rank, 1);
}

#[test]
fn rank_without_local_rank_outside_kubernetes_is_missing_local_rank() {
    let vars: Vec<_> = KUBEFLOW
        .iter()
        .filter(|(k, _)| *k != "KUBERNETES_SERVICE_HOST")
        .copied()
        .collect();
    assert_eq!(
        detect(&vars),
        Err(EnvError::Missing {
            launcher: EnvSource::Torchrun,
            var: "LOCAL_RANK"
        })
    );
}

#[test]
fn kubeflow_without_master_is_named() {
    let vars: Vec<_> = KUBEFLOW
        .iter()
        .filter(|(k, _)| *k != "MASTER_PORT")
        .copied()
        .collect();
    let error = detect(&vars).unwrap_err();
    assert_eq!(
        error,
        EnvError::Missing {
            launcher: EnvSource::Kubeflow,
            var: MASTER_PORT
        }
    );
    assert!(
        error
            .to_string()
            .starts_with("Kubeflow PyTorchJob: environment variable MASTER_PORT is not set"),
        "{error}"
    );
}

// --- MPI ------------------------------------------------------------------------------------

const OPEN_MPI_ONE_NODE: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_RANK", "2"),
    ("OMPI_COMM_WORLD_SIZE", "4"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
    ("OMPI_COMM_WORLD_NODE_RANK", "2"),
];

const OPEN_MPI_TWO_NODES: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_RANK", "9"),
    ("OMPI_COMM_WORLD_SIZE", "16"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
];

const HYDRA: &[(&str, &str)] = &[
    ("PMI_RANK", "3"),
    ("PMI_SIZE", "4"),
    ("MPI_LOCALRANKID", "3"),
    ("MPI_LOCALNRANKS", "4"),
    ("PMI_FD", "6"),
];

#[test]
fn open_mpi_on_one_node_meets_on_the_loopback() {
    let found = detected(OPEN_MPI_ONE_NODE);
    assert_eq!(found.source, EnvSource::OpenMpi);
    assert_eq!(
        found.env,
        env(2, 4, (2, Some(4)), ("127.0.0.1", DEFAULT_PORT))
    );
    assert!(found.master_origin.addr.contains("loopback"), "{found}");
}

#[test]
fn open_mpi_across_nodes_asks_for_master_addr() {
    let error = detect(OPEN_MPI_TWO_NODES).unwrap_err();
    assert!(
        matches!(
            error,
            EnvError::MasterUnknown {
                launcher: EnvSource::OpenMpi,
                ..
            }
        ),
        "{error}"
    );
    let text = error.to_string();
    assert!(text.starts_with("Open MPI: no master address"), "{text}");
    assert!(text.contains("set MASTER_ADDR"), "{text}");

    let vars = with(
        OPEN_MPI_TWO_NODES,
        &[("MASTER_ADDR", "n01"), ("MASTER_PORT", "4000")],
    );
    assert_eq!(detected(&vars).env, env(9, 16, (1, Some(8)), ("n01", 4000)));
}

#[test]
fn mpich_and_intel_mpi_through_pmi() {
    let found = detected(HYDRA);
    assert_eq!(found.source, EnvSource::Pmi);
    assert_eq!(
        found.env,
        env(3, 4, (3, Some(4)), ("127.0.0.1", DEFAULT_PORT))
    );

    let vars: Vec<_> = HYDRA
        .iter()
        .filter(|(k, _)| *k != "MPI_LOCALRANKID")
        .copied()
        .collect();
    assert_eq!(
        detect(&vars),
        Err(EnvError::Missing {
            launcher: EnvSource::Pmi,
            var: "MPI_LOCALRANKID"
        })
    );
}

// --- LSF ------------------------------------------------------------------------------------

const JSRUN: &[(&str, &str)] = &[
    ("JSM_NAMESPACE_RANK", "7"),
    ("JSM_NAMESPACE_SIZE", "12"),
    ("JSM_NAMESPACE_LOCAL_RANK", "1"),
    ("JSM_NAMESPACE_LOCAL_SIZE", "6"),
    ("LSB_JOBID", "4242"),
    ("LSB_MCPU_HOSTS", "batch3 1 h41n01 42 h41n02 42"),
];

#[test]
fn jsrun_master_is_the_first_compute_host() {
    let found = detected(JSRUN);
    assert_eq!(found.source, EnvSource::Lsf);
    assert_eq!(
        found.env,
        env(7, 12, (1, Some(6)), ("h41n01", derived_port(4242, 0)))
    );
    assert_eq!(found.master_origin.port, "LSB_JOBID");

    let vars = with(JSRUN, &[("LSB_MCPU_HOSTS", "batch3 1 h41n01")]);
    let error = detect(&vars).unwrap_err();
    assert!(
        matches!(
            error,
            EnvError::Invalid {
                launcher: EnvSource::Lsf,
                var: "LSB_MCPU_HOSTS",
                ..
            }
        ),
        "{error}"
    );
}

// --- Slurm ----------------------------------------------------------------------------------

/// Task 5 of `srun` step 0, 2 nodes × 4 tasks.
const SRUN: &[(&str, &str)] = &[
    ("SLURM_JOB_ID", "12345"),
    ("SLURM_JOBID", "12345"),
    ("SLURM_STEP_ID", "0"),
    ("SLURM_STEPID", "0"),
    ("SLURM_PROCID", "5"),
    ("SLURM_LOCALID", "1"),
    ("SLURM_NODEID", "1"),
    ("SLURM_NTASKS", "8"),
    ("SLURM_NPROCS", "8"),
    ("SLURM_NNODES", "2"),
    ("SLURM_STEP_NUM_TASKS", "8"),
    ("SLURM_STEP_NUM_NODES", "2"),
    ("SLURM_STEP_NODELIST", "gpu[01-02]"),
    ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
    ("SLURM_JOB_NODELIST", "gpu[01-02]"),
    ("SLURM_NODELIST", "gpu[01-02]"),
    ("SLURM_TASKS_PER_NODE", "4(x2)"),
    ("SLURMD_NODENAME", "gpu02"),
];

/// The batch script of a job of 2 nodes × 8 tasks: what every program it starts inherits.
const SBATCH: &[(&str, &str)] = &[
    ("SLURM_JOB_ID", "777"),
    ("SLURM_JOBID", "777"),
    ("SLURM_PROCID", "0"),
    ("SLURM_LOCALID", "0"),
    ("SLURM_NODEID", "0"),
    ("SLURM_GTIDS", "0"),
    ("SLURM_NTASKS", "16"),
    ("SLURM_NPROCS", "16"),
    ("SLURM_NNODES", "2"),
    ("SLURM_JOB_NODELIST", "gpu[07-08]"),
    ("SLURM_NODELIST", "gpu[07-08]"),
    ("SLURM_TASKS_PER_NODE", "8(x2)"),
];

#[test]
fn srun_task_reads_the_step() {
    let found = detected(SRUN);
    assert_eq!(found.source, EnvSource::Slurm);
    assert_eq!(
        found.env,
        env(5, 8, (1, Some(4)), ("gpu01", derived_port(12345, 0)))
    );
    assert_eq!(found.master_origin.port, "SLURM_JOB_ID and SLURM_STEP_ID");
}

#[test]
fn uneven_steps_use_the_nodes_own_task_count() {
    let vars = with(
        SRUN,
        &[
            ("SLURM_PROCID", "10"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_NUM_TASKS", "11"),
            ("SLURM_NTASKS", "11"),
            ("SLURM_STEP_NODELIST", "gpu[01-02,07]"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2),3"),
        ],
    );
    let found = detected(&vars);
    assert_eq!(found.env.local_world_size, Some(3));
    assert_eq!(found.env.master_addr, "gpu01");
}

#[test]
fn two_steps_of_one_job_get_different_ports() {
    let first = detected(SRUN).env.master_port;
    let vars = with(SRUN, &[("SLURM_STEP_ID", "1"), ("SLURM_STEPID", "1")]);
    assert_ne!(detected(&vars).env.master_port, first);
}

#[test]
fn master_variables_override_what_slurm_implies() {
    let vars = with(SRUN, &[("MASTER_ADDR", "login7"), ("MASTER_PORT", "3456")]);
    let found = detected(&vars);
    assert_eq!(
        (found.env.master_addr.as_str(), found.env.master_port),
        ("login7", 3456)
    );
    assert_eq!(found.master_origin.addr, MASTER_ADDR);
}

#[test]
fn a_program_in_the_batch_script_is_told_to_use_srun() {
    let error = detect(SBATCH).unwrap_err();
    assert_eq!(
        error,
        EnvError::NotAnSrunStep {
            job_id: "777".into(),
            tasks: 16,
            tasks_var: "SLURM_NTASKS"
        }
    );
    assert!(
        error.to_string().contains("Start the ranks with srun"),
        "{error}"
    );
    assert_eq!(error.launcher(), Some(EnvSource::Slurm));
}

#[test]
fn an_salloc_shell_is_told_to_use_srun() {
    let vars = [
        ("SLURM_JOB_ID", "778"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_NNODES", "1"),
        ("SLURM_JOB_NODELIST", "gpu01"),
        ("SLURM_TASKS_PER_NODE", "4"),
    ];
    assert!(matches!(
        detect(&vars),
        Err(EnvError::NotAnSrunStep { tasks: 4, .. })
    ));
}

#[test]
fn a_one_task_batch_job_is_one_rank() {
    let vars = with(SBATCH, &[("SLURM_NTASKS", "1"), ("SLURM_NPROCS", "1")]);
    let found = detected(&vars);
    assert_eq!(found.source, EnvSource::Slurm);
    assert_eq!((found.env.rank, found.env.world_size), (0, 1));
}

#[test]
fn tasks_per_node_must_match_the_node_list() {
    let vars = with(SRUN, &[("SLURM_STEP_TASKS_PER_NODE", "2(x4)")]);
    let error = detect(&vars).unwrap_err();
    assert_eq!(
        error,
        EnvError::NodeListMismatch {
            launcher: EnvSource::Slurm,
            tasks_var: "SLURM_STEP_TASKS_PER_NODE",
            tasks: "2(x4)".into(),
            task_nodes: 4,
            nodes_var: "SLURM_STEP_NODELIST",
            nodes: "gpu[01-02]".into(),
            listed_nodes: 2,
        }
    );
    assert_eq!(
        error.to_string(),
        "Slurm: SLURM_STEP_TASKS_PER_NODE=\"2(x4)\" describes 4 node(s) but \
         SLURM_STEP_NODELIST=\"gpu[01-02]\" names 2"
    );

    let vars = with(SRUN, &[("SLURM_STEP_TASKS_PER_NODE", "4,3")]);
    assert!(
        matches!(
            detect(&vars),
            Err(EnvError::Inconsistent {
                launcher: EnvSource::Slurm,
                ..
            })
        ),
        "7 tasks in a step of 8"
    );
}

#[test]
fn ranks_outside_the_step_are_refused() {
    let cases = [
        ("SLURM_PROCID", "8", "SLURM_STEP_NUM_TASKS"),
        ("SLURM_LOCALID", "4", "SLURM_STEP_TASKS_PER_NODE"),
        ("SLURM_NODEID", "2", "the nodes of the step"),
    ];
    for (var, value, size_of) in cases {
        let vars = with(SRUN, &[(var, value)]);
        match detect(&vars) {
            Err(EnvError::OutOfRange {
                launcher: EnvSource::Slurm,
                var: got,
                size_of: of,
                ..
            }) => {
                assert_eq!((got, of), (var, size_of), "{var}={value}")
            }
            other => panic!("{var}={value}: expected OutOfRange, got {other:?}"),
        }
    }
}

#[test]
fn malformed_slurm_values_are_named() {
    let cases = [
        ("SLURM_JOB_ID", "12x"),
        ("SLURM_STEP_ID", "zero"),
        ("SLURM_PROCID", "-1"),
        ("SLURM_LOCALID", ""),
        ("SLURM_STEP_NUM_TASKS", "0"),
        ("SLURM_STEP_NODELIST", "gpu[01-"),
        ("SLURM_STEP_NODELIST", "gpu[02-01]"),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x)"),
        ("MASTER_PORT", "http"),
    ];
    for (var, value) in cases {
        let vars = with(SRUN, &[(var, value)]);
        match detect(&vars) {
            Err(
                error @ EnvError::Invalid {
                    launcher: EnvSource::Slurm,
                    var: got,
                    ..
                },
            ) => {
                assert_eq!(got, var, "{var}={value}");
                assert!(
                    error.to_string().starts_with("Slurm: environment variable"),
                    "{error}"
                );
            }
            other => panic!("{var}={value:?}: expected Invalid, got {other:?}"),
        }
    }
}

#[test]
fn a_step_without_its_node_list_on_several_nodes_asks_for_master_addr() {
    let vars: Vec<_> = SRUN
        .iter()
        .filter(|(k, _)| !k.ends_with("NODELIST"))
        .copied()
        .collect();
    assert!(matches!(
        detect(&vars),
        Err(EnvError::MasterUnknown {
            launcher: EnvSource::Slurm,
            ..
        })
    ));
}

// --- nested launchers -----------------------------------------------------------------------

#[test]
fn zero_run_under_srun_wins() {
    // One zero-run per node (`srun --ntasks-per-node=1 zero-run …`): its ranks see the step's
    // variables for the zero-run task and their own torchrun variables.
    let vars = with(
        SRUN,
        &[
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
            ("RANK", "13"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "5"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "gpu01"),
            ("MASTER_PORT", "29500"),
        ],
    );
    let found = detected(&vars);
    assert_eq!(found.source, EnvSource::Torchrun);
    assert_eq!(found.env, env(13, 16, (5, Some(8)), ("gpu01", 29500)));
}

#[test]
fn mpirun_in_a_batch_script_ignores_the_scripts_leftovers() {
    let vars = with(SBATCH, &[("MASTER_ADDR", "gpu07")]);
    let mut vars = vars;
    vars.extend_from_slice(OPEN_MPI_TWO_NODES);
    let found = detected(&vars);
    assert_eq!(found.source, EnvSource::OpenMpi);
    assert_eq!(found.env.rank, 9);
    assert_eq!(found.env.world_size, 16);

    // On one node, not even MASTER_ADDR is needed.
    let mut vars = SBATCH.to_vec();
    vars.extend_from_slice(OPEN_MPI_ONE_NODE);
    assert_eq!(detected(&vars).source, EnvSource::OpenMpi);
}

#[test]
fn mpirun_daemons_started_by_srun_do_not_count() {
    // Across nodes mpirun starts one daemon per node with srun: its ranks inherit that step,
    // where SLURM_PROCID is the node's index.
    let mut vars = with(
        SRUN,
        &[
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
            ("MASTER_ADDR", "gpu01"),
        ],
    );
    vars.extend_from_slice(OPEN_MPI_TWO_NODES);
    let found = detected(&vars);
    assert_eq!(found.source, EnvSource::OpenMpi);
    assert_eq!(found.env.rank, 9);
}

#[test]
fn pmi_set_by_srun_itself_reads_slurm() {
    // `srun --mpi=pmi2` sets PMI_RANK and PMI_SIZE equal to the step's: Slurm says more.
    let mut vars = SRUN.to_vec();
    vars.extend_from_slice(&[("PMI_RANK", "5"), ("PMI_SIZE", "8"), ("PMI_FD", "7")]);
    let found = detected(&vars);
    assert_eq!(found.source, EnvSource::Slurm);
    assert_eq!(found.env.master_addr, "gpu01");
}

#[test]
fn spectrum_mpi_under_jsrun_reads_lsf() {
    let mut vars = JSRUN.to_vec();
    vars.extend_from_slice(&[
        ("OMPI_COMM_WORLD_RANK", "7"),
        ("OMPI_COMM_WORLD_SIZE", "12"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "6"),
    ]);
    assert_eq!(detected(&vars).source, EnvSource::Lsf);
}

// --- naming the launcher --------------------------------------------------------------------

#[test]
fn burn_zero_launcher_names_the_source() {
    let mut vars = SRUN.to_vec();
    vars.extend_from_slice(TORCHRUN);
    assert_eq!(detected(&vars).source, EnvSource::Torchrun);
    vars.push(("BURN_ZERO_LAUNCHER", "slurm"));
    assert_eq!(detected(&vars).source, EnvSource::Slurm);

    let none = with(TORCHRUN, &[("BURN_ZERO_LAUNCHER", "none")]);
    assert_eq!(detect(&none), Err(EnvError::NotLaunched));

    let bogus = with(TORCHRUN, &[("BURN_ZERO_LAUNCHER", "pbs")]);
    let error = detect(&bogus).unwrap_err();
    assert_eq!(
        error,
        EnvError::UnknownLauncher {
            value: "pbs".into()
        }
    );
    assert!(
        error.to_string().contains("expected one of torchrun"),
        "{error}"
    );
}

#[test]
fn a_named_source_reads_only_its_variables() {
    let error = DistEnv::from_source_with(EnvSource::Slurm, lookup(TORCHRUN)).unwrap_err();
    assert_eq!(
        error,
        EnvError::Missing {
            launcher: EnvSource::Slurm,
            var: "SLURM_JOB_ID"
        }
    );
    assert!(
        error.to_string().contains("start the ranks with srun"),
        "{error}"
    );
    let found = DistEnv::from_source_with(EnvSource::OpenMpi, lookup(OPEN_MPI_ONE_NODE)).unwrap();
    assert_eq!(found.source, EnvSource::OpenMpi);
}

#[test]
fn source_names_round_trip() {
    for source in EnvSource::ALL {
        assert_eq!(source.name().parse::<EnvSource>(), Ok(source));
        assert_eq!(
            source.name().to_uppercase().parse::<EnvSource>(),
            Ok(source)
        );
    }
    assert_eq!("srun".parse::<EnvSource>(), Ok(EnvSource::Slurm));
    assert_eq!("zero-run".parse::<EnvSource>(), Ok(EnvSource::Torchrun));
    assert_eq!("mpich".parse::<EnvSource>(), Ok(EnvSource::Pmi));
}

#[test]
fn nothing_set_is_not_launched() {
    let error = detect(&[("PATH", "/usr/bin"), ("HOME", "/root")]).unwrap_err();
    assert_eq!(error, EnvError::NotLaunched);
    assert_eq!(error.launcher(), None);
}

#[test]
fn errors_name_their_launcher() {
    let cases: Vec<(Vec<(&str, &str)>, EnvSource)> = vec![
        (with(TORCHRUN, &[("RANK", "16")]), EnvSource::Torchrun),
        (with(KUBEFLOW, &[("WORLD_SIZE", "x")]), EnvSource::Kubeflow),
        (
            with(OPEN_MPI_ONE_NODE, &[("OMPI_COMM_WORLD_LOCAL_RANK", "4")]),
            EnvSource::OpenMpi,
        ),
        (with(HYDRA, &[("PMI_SIZE", "0")]), EnvSource::Pmi),
        (with(JSRUN, &[("JSM_NAMESPACE_RANK", "12")]), EnvSource::Lsf),
        (with(SRUN, &[("SLURM_PROCID", "99")]), EnvSource::Slurm),
    ];
    for (vars, source) in cases {
        let error = detect(&vars).unwrap_err();
        assert_eq!(error.launcher(), Some(source), "{error}");
        assert!(
            error.to_string().starts_with(&format!("{source}: ")),
            "{error}"
        );
    }
}
