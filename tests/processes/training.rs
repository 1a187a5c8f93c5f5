//! `train_gpt` and `learner_gpt` as one process per rank, against one rank (or ranks on
//! threads) in this process.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use burn::backend::{Flex, NdArray, Wgpu};
use burn::tensor::backend::Backend;
use burn_zero_gpt::params_digest;
use burn_zero_gpt::train::{RankOutcome, RunConfig, local_ranks, train, train_with};
use burn_zero_testing::processes::{
    NameServer, allow_root, built, describe, free_port, mpirun, prefixed_ranks,
};
use burn_zero_testing::skip;

/// The tiny model on short sequences, a global batch every world size up to 4 divides.
fn config(world_size: usize, stage: u8, steps: usize) -> RunConfig {
    RunConfig {
        world_size,
        stage,
        steps,
        batch_size: 12,
        seq_len: 32,
        sample_len: 0,
        keep_params: true,
        ..RunConfig::new()
    }
}

/// `train_gpt`'s flags for `config` (its world size comes from the launcher).
fn flags(config: &RunConfig) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--stage",
        &config.stage.to_string(),
        "--steps",
        &config.steps.to_string(),
        "--batch-size",
        &config.batch_size.to_string(),
        "--seq-len",
        &config.seq_len.to_string(),
        "--sample-len",
        "0",
    ]
    .map(String::from)
    .to_vec();
    if let Some(dir) = &config.checkpoint_dir {
        flags.extend(["--checkpoint-dir".into(), dir.display().to_string()]);
    }
    if config.save_every > 0 {
        flags.extend(["--save-every".into(), config.save_every.to_string()]);
    }
    if config.resume {
        flags.push("--resume".into());
    }
    if config.reduce_in_rank_order {
        flags.push("--reduce-in-rank-order".into());
    }
    flags
}

fn train_gpt() -> PathBuf {
    built(
        "TRAIN_GPT",
        "examples/train_gpt",
        "cargo build --features mpi --example train_gpt",
    )
}

fn zero_run() -> PathBuf {
    built(
        "ZERO_RUN",
        "zero-run",
        "cargo build -p burn-zero-launch --bin zero-run",
    )
}

/// A fresh directory for `name`.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-zero-proc-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// What a run ended with: its final parameters' digest and every step's loss.
#[derive(Debug, Clone, PartialEq)]
struct Ended {
    digest: String,
    losses: Vec<f32>,
}

impl Ended {
    fn of(outcome: &RankOutcome) -> Self {
        Ended {
            digest: params_digest(outcome.params.as_ref().expect("parameters kept")),
            losses: outcome.losses.clone(),
        }
    }

    /// Rank 0's memory report under `dir` (each process writes its own).
    fn reported(dir: &Path) -> Self {
        let path = dir.join("memory-rank0.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let report: serde_json::Value = serde_json::from_str(&text).expect("a JSON report");
        let entry = &report[0];
        let losses = entry["losses"]
            .as_array()
            .expect("losses")
            .iter()
            // Written as f32's shortest text; read back as that f32.
            .map(|loss| loss.to_string().parse::<f32>().expect("a loss"))
            .collect();
        Ended {
            digest: entry["params_digest"].as_str().expect("a digest").into(),
            losses,
        }
    }
}

/// One rank of `B` in this process accumulating `world` micro-batches: the reference a job of
/// `world` ranks must equal bit for bit.
fn one_rank<B: Backend>(world: usize, stage: u8, steps: usize) -> Ended {
    let config = RunConfig {
        world_size: 1,
        accumulation: world,
        ..self::config(1, stage, steps)
    };
    let outcomes = train::<B>(&config, Default::default(), |_| {}).expect("the reference trains");
    Ended::of(&outcomes[0])
}

/// `config` on `config.world_size` ranks on threads of this process.
fn threads<B: Backend>(config: &RunConfig) -> Ended {
    let device = B::Device::default();
    let outcomes = train_with::<B>(
        config,
        device.clone(),
        |_| {},
        local_ranks::<B>(config.world_size, device),
    )
    .expect("ranks on threads train");
    Ended::of(&outcomes[0])
}

/// Runs `command` (a whole job) with its output and the report folder `dir`; panics, showing
/// the output, when it fails.
fn run_job(mut command: Command, dir: &Path) -> Output {
    command
        .arg("--memory-report")
        .arg(dir.join("memory.json"))
        .stdin(Stdio::null());
    let described = describe(&command);
    let output = command.output().expect("the job starts");
    assert!(
        output.status.success(),
        "{described} failed:\n{}",
        text(&output)
    );
    output
}

fn text(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `np` processes of `train_gpt --backend backend` under `mpirun`; `None` when skipped.
fn under_mpirun(test: &str, np: usize, backend: &str, config: &RunConfig) -> Option<Ended> {
    let mut command = mpirun(test, np)?;
    command
        .arg(train_gpt())
        .args(["--backend", backend])
        .args(flags(config));
    let dir = scratch(&format!("{test}-{np}"));
    run_job(command, &dir);
    let ended = Ended::reported(&dir);
    std::fs::remove_dir_all(&dir).ok();
    Some(ended)
}

/// `zero-run` with `np` processes of `train_gpt` and `extra` flags.
fn zero_run_command(np: usize, config: &RunConfig, extra: &[&str]) -> Command {
    let mut command = Command::new(zero_run());
    allow_root(&mut command);
    command
        .args(["--nproc-per-node", &np.to_string()])
        .args(["--master-port", &free_port().to_string()])
        .arg("--")
        .arg(train_gpt())
        .args(flags(config))
        .args(extra);
    command
}

/// Says how a comparison was made, on the test's standard output even when captured.
fn say(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
}

#[test]
fn flex_ranks_under_mpirun_train_bitwise_like_one_rank_at_every_stage() {
    let test = "flex_ranks_under_mpirun_train_bitwise_like_one_rank_at_every_stage";
    for np in [2, 3, 4] {
        for stage in 0..=3 {
            let config = config(np, stage, 3);
            let Some(got) = under_mpirun(test, np, "flex", &config) else {
                return;
            };
            let want = one_rank::<Flex>(np, stage, 3);
            assert_eq!(got, want, "{np} processes at stage {stage}");
        }
    }
}

/// Reductions in rank order over MPI's all-to-all (`--reduce-in-rank-order`): three processes
/// still train bit for bit like one rank accumulating three micro-batches, at stages 1 and 3.
#[test]
fn flex_ranks_reducing_in_rank_order_under_mpirun_train_bitwise_like_one_rank() {
    let test = "flex_ranks_reducing_in_rank_order_under_mpirun_train_bitwise_like_one_rank";
    let np = 3;
    for stage in [1, 3] {
        let config = RunConfig {
            reduce_in_rank_order: true,
            ..config(np, stage, 3)
        };
        let Some(got) = under_mpirun(test, np, "flex", &config) else {
            return;
        };
        let want = one_rank::<Flex>(np, stage, 3);
        assert_eq!(got, want, "{np} processes in rank order at stage {stage}");
    }
}

#[test]
fn flex_ranks_under_zero_run_train_bitwise_like_one_rank_at_every_stage() {
    let test = "flex_ranks_under_zero_run_train_bitwise_like_one_rank_at_every_stage";
    if mpirun(test, 1).is_none() {
        return;
    }
    for np in [2, 3, 4] {
        for stage in 0..=3 {
            let config = config(np, stage, 3);
            let dir = scratch(&format!("zero-run-{np}-{stage}"));
            let output = run_job(zero_run_command(np, &config, &[]), &dir);
            let got = Ended::reported(&dir);
            let want = one_rank::<Flex>(np, stage, 3);
            assert_eq!(
                got,
                want,
                "{np} processes at stage {stage}:\n{}",
                text(&output)
            );
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}

#[test]
fn srun_shaped_tasks_join_through_the_name_server_and_train_bitwise() {
    let test = "srun_shaped_tasks_join_through_the_name_server_and_train_bitwise";
    let Some(server) = NameServer::start(test) else {
        return;
    };
    let (np, stage) = (2, 3);
    let config = config(np, stage, 3);
    let dir = scratch("srun");
    let port = free_port();
    // What srun sets for each task of a two-task step on one node (here without Slurm's MPI
    // plugin, so the tasks join through Open MPI's name server, as zero-run's do).
    let tasks: Vec<_> = (0..np)
        .map(|task| {
            let mut command = Command::new(train_gpt());
            command
                .args(flags(&config))
                .arg("--memory-report")
                .arg(dir.join("memory.json"))
                .env("SLURM_JOB_ID", "4242")
                .env("SLURM_STEP_ID", "0")
                .env("SLURM_PROCID", task.to_string())
                .env("SLURM_LOCALID", task.to_string())
                .env("SLURM_NODEID", "0")
                .env("SLURM_STEP_NUM_TASKS", np.to_string())
                .env("SLURM_NTASKS", np.to_string())
                .env("SLURM_STEP_NODELIST", "localhost")
                .env("SLURM_STEP_TASKS_PER_NODE", np.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            allow_root(&mut command);
            server.point(&mut command);
            command.spawn().expect("a task starts")
        })
        .collect();
    for (task, child) in tasks.into_iter().enumerate() {
        let output = child.wait_with_output().expect("a task ends");
        assert!(output.status.success(), "task {task}:\n{}", text(&output));
        assert!(
            text(&output).contains(&format!("{np} ranks")),
            "task {task} did not train as one rank of {np}:\n{}",
            text(&output)
        );
    }
    assert_eq!(Ended::reported(&dir), one_rank::<Flex>(np, stage, 3));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_learner_trains_one_process_per_rank_like_threads() {
    let test = "the_learner_trains_one_process_per_rank_like_threads";
    let learner = built(
        "LEARNER_GPT",
        "examples/learner_gpt",
        "cargo build --features mpi --example learner_gpt",
    );
    let args = [
        "--epochs",
        "1",
        "--train-windows",
        "48",
        "--batch-size",
        "4",
    ];
    let digest = |output: &Output| {
        let said = text(output);
        said.lines()
            .filter_map(|line| line.split("final parameters: ").nth(1))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let dir = scratch("learner");
    let Some(mut command) = mpirun(test, 2) else {
        return;
    };
    command
        .arg(&learner)
        .args(args)
        .arg("--dir")
        .arg(dir.join("processes"));
    let processes = command.output().expect("mpirun runs");
    assert!(processes.status.success(), "{}", text(&processes));
    let threads = Command::new(&learner)
        .args(args)
        .args(["--world-size", "2", "--dir"])
        .arg(dir.join("threads"))
        .output()
        .expect("learner_gpt runs");
    assert!(threads.status.success(), "{}", text(&threads));
    let (processes, threads) = (digest(&processes), digest(&threads));
    assert_eq!(processes.len(), 2, "each process prints its digest");
    assert_eq!(threads.len(), 1);
    assert!(
        processes.iter().all(|digest| *digest == threads[0]),
        "processes {processes:?}, threads {threads:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_checkpoint_saved_by_three_processes_resumes_on_two_bitwise() {
    let test = "a_checkpoint_saved_by_three_processes_resumes_on_two_bitwise";
    let saved = scratch("resume-processes");
    let save = RunConfig {
        checkpoint_dir: Some(saved.join("checkpoints")),
        ..config(3, 3, 2)
    };
    let resume = RunConfig {
        resume: true,
        ..RunConfig {
            steps: 4,
            ..config(2, 3, 4)
        }
    };
    let resume = RunConfig {
        checkpoint_dir: save.checkpoint_dir.clone(),
        ..resume
    };
    if under_mpirun(test, 3, "flex", &save).is_none() {
        return;
    }
    let got = under_mpirun(test, 2, "flex", &resume).expect("mpirun is there");
    // The same save and resume with ranks on threads of this process.
    let reference = scratch("resume-threads");
    let in_process = |config: &RunConfig| RunConfig {
        checkpoint_dir: Some(reference.join("checkpoints")),
        ..config.clone()
    };
    threads::<Flex>(&in_process(&save));
    let want = threads::<Flex>(&in_process(&resume));
    // Both resumed runs report the steps they trained, 2 and 3.
    assert_eq!(got, want);
    std::fs::remove_dir_all(&saved).ok();
    std::fs::remove_dir_all(&reference).ok();
}

/// A job of 3 processes under zero-run saving every step, whose rank 1 fails at step 2 as
/// `how` says; zero-run's output.
fn failing_job(name: &str, how: &str) -> (Output, PathBuf, RunConfig) {
    let dir = scratch(name);
    let config = RunConfig {
        checkpoint_dir: Some(dir.join("checkpoints")),
        save_every: 1,
        ..config(3, 3, 4)
    };
    let fail = format!("1:2:{how}");
    // A long collective timeout: the others must stop because rank 1 failed, not time out.
    let mut command = zero_run_command(3, &config, &["--fail-at", &fail, "--timeout", "300"]);
    command.stdin(Stdio::null());
    let started = Instant::now();
    let output = command.output().expect("zero-run starts");
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "the job took {:?} to stop:\n{}",
        started.elapsed(),
        text(&output)
    );
    assert!(!output.status.success(), "{}", text(&output));
    (output, dir, config)
}

/// The checkpoint directories under `dir`, and whether each is complete (has its metadata).
fn checkpoints(dir: &Path) -> Vec<(String, bool)> {
    let mut found: Vec<(String, bool)> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let complete = burn_zero_checkpoint::list(dir)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.complete && c.path == entry.path());
                    (name, complete)
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

#[test]
fn a_rank_killed_mid_step_is_named_by_zero_run_and_resume_continues_bitwise() {
    let test = "a_rank_killed_mid_step_is_named_by_zero_run_and_resume_continues_bitwise";
    if mpirun(test, 1).is_none() {
        return;
    }
    let (output, dir, config) = failing_job("killed", "kill");
    let said = text(&output);
    assert!(
        said.contains("rank 1 failed (killed by SIGKILL) and caused the job's failure"),
        "{said}"
    );
    assert_eq!(output.status.code(), Some(128 + 9), "{said}");
    // Steps 1 and 2 were saved whole; nothing of step 3 was committed.
    let saved = checkpoints(config.checkpoint_dir.as_ref().expect("a checkpoint folder"));
    assert!(
        saved.iter().all(|(_, complete)| *complete)
            && saved.iter().any(|(name, _)| name.ends_with("00000002"))
            && !saved.iter().any(|(name, _)| name.ends_with("00000003")),
        "{saved:?}"
    );
    // Resumed by the same number of processes, the run ends where it would have.
    let resumed = RunConfig {
        resume: true,
        save_every: 0,
        ..config.clone()
    };
    let report = dir.join("resumed");
    std::fs::create_dir_all(&report).expect("a report folder");
    run_job(zero_run_command(3, &resumed, &[]), &report);
    let got = Ended::reported(&report);
    let want = threads::<Flex>(&RunConfig {
        checkpoint_dir: None,
        save_every: 0,
        ..config
    });
    assert_eq!(got.digest, want.digest);
    assert_eq!(got.losses, want.losses[2..].to_vec());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_panicking_rank_is_named_by_zero_run_with_its_message() {
    let test = "a_panicking_rank_is_named_by_zero_run_with_its_message";
    if mpirun(test, 1).is_none() {
        return;
    }
    let (output, dir, _) = failing_job("panicked", "panic");
    let said = text(&output);
    assert!(
        said.contains("rank 1 failed") && said.contains("caused the job's failure"),
        "{said}"
    );
    let ranks = prefixed_ranks(&String::from_utf8_lossy(&output.stderr));
    assert!(
        ranks
            .get(&1)
            .is_some_and(|lines| lines.contains("rank 1 fails at step 2 on purpose")),
        "{said}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_rank_that_never_arrives_is_a_named_error_within_the_timeout() {
    let test = "a_rank_that_never_arrives_is_a_named_error_within_the_timeout";
    let Some(server) = NameServer::start(test) else {
        return;
    };
    let port = free_port();
    // Ranks 0 and 2 of 3 start; rank 1 never does.
    let children: Vec<_> = [0, 2]
        .into_iter()
        .map(|rank| {
            let mut command = Command::new(train_gpt());
            command
                .args(flags(&config(3, 3, 2)))
                .args(["--rendezvous-timeout", "3"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            allow_root(&mut command);
            server.point(&mut command);
            command.spawn().expect("a rank starts")
        })
        .collect();
    let started = Instant::now();
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|child| child.wait_with_output().expect("a rank ends"))
        .collect();
    for output in &outputs {
        assert_eq!(output.status.code(), Some(1), "{}", text(output));
    }
    // Rank 0 names the missing rank; rank 2 gets rank 0's verdict when rank 0 sends it before
    // closing, or else says it got no answer: either way the failure is named.
    let (first, last) = (text(&outputs[0]), text(&outputs[1]));
    assert!(first.contains("rank(s) [1] never joined"), "{first}");
    let told = last.contains("rank 0 rejected rank 2") && last.contains("rank(s) [1] never joined");
    let unanswered = last.contains("rank 2 joined the rendezvous") && last.contains("no answer");
    assert!(told || unanswered, "{last}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn ndarray_ranks_under_mpirun_stay_within_the_measured_noise() {
    let test = "ndarray_ranks_under_mpirun_stay_within_the_measured_noise";
    let np = 2;
    let Some(got) = under_mpirun(test, np, "ndarray", &config(np, 3, 3)) else {
        return;
    };
    // NdArray does not always repeat itself: the tolerance is ten times what two runs of the
    // one-rank reference differ by, and nothing when they agree bit for bit.
    let (want, again) = (one_rank::<NdArray>(np, 3, 3), one_rank::<NdArray>(np, 3, 3));
    let noise = want
        .losses
        .iter()
        .zip(&again.losses)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let tolerance = 10.0 * noise;
    let worst = got
        .losses
        .iter()
        .zip(&want.losses)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    if noise == 0.0 {
        say(&format!(
            "{test}: mode: bitwise (the reference repeated itself); losses differ by {worst:e}"
        ));
        assert_eq!(got, want);
    } else {
        say(&format!(
            "{test}: mode: within 10x the measured noise {noise:e}; losses differ by {worst:e}"
        ));
        assert!(worst <= tolerance, "{worst:e} > {tolerance:e}");
    }
}

#[test]
fn wgpu_ranks_under_mpirun_train_bitwise_like_threads() {
    let test = "wgpu_ranks_under_mpirun_train_bitwise_like_threads";
    if !skip::wgpu_adapter(test) {
        return;
    }
    let np = 2;
    let config = config(np, 3, 3);
    // The threads run first: their autotune results, written to cubecl's cache under this
    // build's target folder, are what the processes then read, so every rank of both runs
    // picks the same kernels.
    let want = threads::<Wgpu>(&config);
    let Some(got) = under_mpirun(test, np, "wgpu", &config) else {
        return;
    };
    assert_eq!(got, want);
}
