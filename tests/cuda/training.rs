//! The tests of training on CUDA with NCCL (built with the `cuda` feature).
//!
//! The two engines run the same kernels on the same GPU, but the matmul kernels cubecl picks by
//! autotuning may differ between processes, so runs are compared within a tolerance rather
//! than bit for bit (NCCL at world size 1 moves no data: the difference measures the kernels).

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

use burn_zero::comm::launch;
use burn_zero::comm::nccl::CudaDevice;
use burn_zero::{Capacity, Placement};
use burn_zero_testing::processes::free_port;
use burn_zero_testing::skip;

use burn_zero_gpt::train::cuda::{Backend, CudaRanks};
use burn_zero_gpt::train::{RankOutcome, RunConfig, local_ranks, train_with};

/// GPU tests run one at a time: NCCL collectives of two groups on the same GPUs, issued from
/// different threads, can wait on each other.
static GPUS: Mutex<()> = Mutex::new(());

/// The tiny GPT on short sequences, `world_size` ranks, a few seconds on a GPU.
fn short(world_size: usize, stage: u8) -> RunConfig {
    RunConfig {
        world_size,
        stage,
        steps: 20,
        batch_size: 8 * world_size,
        seq_len: 32,
        sample_len: 0,
        keep_params: true,
        ..RunConfig::new()
    }
}

/// `config` trained by `LocalGroup` ranks (as many as its world size) sharing GPU 0, in this
/// process: the reference the NCCL processes are held to.
fn on_local_group(config: &RunConfig) -> Vec<RankOutcome> {
    train_with::<Backend>(
        config,
        CudaDevice::new(0),
        |_| {},
        local_ranks::<Backend>(config.world_size, CudaDevice::new(0)),
    )
    .unwrap()
}

/// The largest absolute difference between two runs' losses and final parameters.
fn difference(a: &[RankOutcome], b: &[RankOutcome]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "ranks");
    let mut losses = 0f32;
    let mut params = 0f32;
    for (a, b) in a.iter().zip(b) {
        for (x, y) in a.losses.iter().zip(&b.losses) {
            losses = losses.max((x - y).abs());
        }
        let (pa, pb) = (a.params.as_ref().unwrap(), b.params.as_ref().unwrap());
        assert_eq!(pa.len(), pb.len(), "parameters");
        for (x, y) in pa.iter().flatten().zip(pb.iter().flatten()) {
            params = params.max((x - y).abs());
        }
    }
    (losses, params)
}

/// NCCL over `devices` (one rank per GPU) against LocalGroup ranks on the same GPUs, at every
/// stage.
fn nccl_against_local_group(devices: Vec<CudaDevice>) {
    let world = devices.len();
    for stage in 0..=3 {
        let config = short(world, stage);
        let nccl = train_with::<Backend>(
            &config,
            devices[0].clone(),
            |_| {},
            |rank_fn| CudaRanks::Devices(devices.clone()).run(rank_fn),
        )
        .unwrap_or_else(|e| panic!("NCCL, stage {stage}, {world} GPU(s): {e}"));
        let local = train_with::<Backend>(
            &config,
            devices[0].clone(),
            |_| {},
            |rank_fn| {
                launch::<Backend, _, _, burn_zero_gpt::train::RankError>(world, &devices, rank_fn)
                    .map_err(|e| e.to_string())
            },
        )
        .unwrap_or_else(|e| panic!("LocalGroup, stage {stage}, {world} GPU(s): {e}"));
        let (losses, params) = difference(&nccl, &local);
        println!(
            "stage {stage}, {world} GPU(s): NCCL vs LocalGroup: losses differ by at most {losses:e}, \
             parameters by {params:e}"
        );
        assert!(
            losses <= 1e-4 && params <= 1e-4,
            "stage {stage}, {world} GPU(s): NCCL and LocalGroup diverge (loss {losses:e}, \
             parameters {params:e})"
        );
        let first = nccl[0].losses[0];
        let last = *nccl[0].losses.last().unwrap();
        assert!(last < first - 0.3, "stage {stage}: loss {first} -> {last}");
    }
}

/// At world size 1 a rank alone answers its collectives in place: no NCCL call is made, so
/// this checks training on CUDA (the kernels, chunks, the fused step) against `LocalGroup`, not
/// NCCL. NCCL's training path needs two ranks: the test on every GPU below.
#[test]
fn zero_on_cuda_trains_like_local_group_at_world_size_one() {
    let test = "zero_on_cuda_trains_like_local_group_at_world_size_one";
    if skip::cuda_devices(test, 1).is_none() {
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    nccl_against_local_group(vec![CudaDevice::new(0)]);
}

#[test]
fn zero_on_nccl_trains_like_local_group_on_every_gpu() {
    let test = "zero_on_nccl_trains_like_local_group_on_every_gpu";
    let Some(count) = skip::cuda_devices(test, 2) else {
        return;
    };
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    nccl_against_local_group((0..count).map(CudaDevice::new).collect());
}

#[test]
fn the_auto_placement_plans_for_the_gpus_own_capacity() {
    let test = "the_auto_placement_plans_for_the_gpus_own_capacity";
    if skip::cuda_devices(test, 1).is_none() {
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let device = CudaDevice::new(0);
    let total = burn_zero::comm::device_capacity::<Backend>(&device)
        .expect("Burn's CUDA backend has a capacity")
        .unwrap()
        .total;
    let run = |config: &RunConfig| {
        train_with::<Backend>(
            config,
            device.clone(),
            |_| {},
            local_ranks::<Backend>(1, device.clone()),
        )
        .unwrap()
    };
    let placed = run(&RunConfig {
        placement: Placement::auto(Capacity::Device).with_offload_optim_frac(0.0),
        ..short(1, 3)
    });
    let on_device = run(&short(1, 3));
    let decision = placed[0]
        .memory
        .as_ref()
        .and_then(|memory| memory.auto_placement)
        .expect("the placement decided after its warm-up");
    println!(
        "{:.0} MiB on the device: {decision:?}",
        total as f64 / 1048576.0
    );
    // The tiny model fits many times over: every chunk goes to the device.
    assert!(
        decision.capacity_bytes > 0 && decision.capacity_bytes <= total,
        "{decision:?} against {total} bytes"
    );
    assert_eq!(decision.host_chunks, 0, "{decision:?}");
    let (losses, params) = difference(&placed, &on_device);
    assert!(
        losses <= 1e-4 && params <= 1e-4,
        "placed and unplaced runs diverge (loss {losses:e}, parameters {params:e})"
    );
}

/// A built program: `$variable` when set (a test binary carried to another machine is told
/// where the programs are), otherwise `relative` to the target folder this test runs from.
fn program(variable: &str, relative: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return path.into();
    }
    // This binary is <target>/<profile>/deps/cuda-<hash>.
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = profile.join(relative);
    assert!(
        path.exists(),
        "{} is missing: build it (cargo build --features cuda --example train_gpt; cargo build \
         -p burn-zero-launch --bin zero-run) or set {variable}",
        path.display()
    );
    path
}

#[test]
fn train_gpt_runs_one_process_per_gpu_under_zero_run() {
    let test = "train_gpt_runs_one_process_per_gpu_under_zero_run";
    let Some(count) = skip::cuda_devices(test, 1) else {
        return;
    };
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let config = short(count, 3);
    let dir = scratch(test);
    let report = dir.join("memory.json");
    let output = Command::new(program("ZERO_RUN", "zero-run"))
        .arg("--nproc-per-node")
        .arg(count.to_string())
        .arg("--master-port")
        .arg(free_port().to_string())
        .arg("--")
        .arg(program("TRAIN_GPT", "examples/train_gpt"))
        .args(["--backend", "cuda", "--stage", "3"])
        .args(["--steps", &config.steps.to_string()])
        .args(["--batch-size", &config.batch_size.to_string()])
        .args(["--seq-len", &config.seq_len.to_string()])
        .args(["--sample-len", "0"])
        .arg("--memory-report")
        .arg(&report)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "zero-run failed:\n{stdout}\n{stderr}"
    );
    let rank0 = if count == 1 {
        report.clone()
    } else {
        dir.join("memory-rank0.json")
    };
    let entries: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&rank0).unwrap()).unwrap();
    let entry = &entries[0];
    assert_eq!(entry["rank"], 0);
    assert_eq!(entry["world_size"], count);
    assert_eq!(entry["backend"], "cuda");
    let first = entry["first_loss"].as_f64().unwrap() as f32;
    let last = entry["last_loss"].as_f64().unwrap() as f32;

    // The reference: the same run on LocalGroup ranks sharing GPU 0, in this process.
    let local = on_local_group(&config);
    let (local_first, local_last) = (local[0].losses[0], *local[0].losses.last().unwrap());
    println!(
        "zero-run × {count}: loss {first} -> {last}; LocalGroup: {local_first} -> {local_last}"
    );
    assert!(
        (first - local_first).abs() <= 1e-4 && (last - local_last).abs() <= 1e-3,
        "zero-run: {first} -> {last}; LocalGroup: {local_first} -> {local_last}"
    );
    assert!(last < first - 0.3, "loss {first} -> {last}");
    std::fs::remove_dir_all(&dir).ok();
}

/// What a run ended with: every step's loss and the final parameters' digest.
#[derive(Debug, Clone, PartialEq)]
struct Ended {
    losses: Vec<f32>,
    digest: String,
}

impl Ended {
    fn of(outcome: &RankOutcome) -> Self {
        Ended {
            losses: outcome.losses.clone(),
            digest: burn_zero_gpt::params_digest(outcome.params.as_ref().expect("kept")),
        }
    }

    /// Rank 0's report in `dir` of a job of `world` processes (each writes its own).
    fn reported(world: usize, dir: &std::path::Path) -> Self {
        let path = dir.join("memory-rank0.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let entries: serde_json::Value = serde_json::from_str(&text).unwrap();
        let entry = &entries[0];
        // What a GPU pays for, counted by rank 0 over its last step.
        println!(
            "{world} NCCL processes on one GPU, rank 0's last step: {}",
            entry["last_step_counts"]
        );
        Ended {
            // Written as f32's shortest text; read back as that f32.
            losses: entry["losses"]
                .as_array()
                .unwrap()
                .iter()
                .map(|loss| loss.to_string().parse::<f32>().unwrap())
                .collect(),
            digest: entry["params_digest"].as_str().unwrap().into(),
        }
    }
}

/// The tiny GPT as `train_gpt` flags (its placement is the caller's to add).
fn flags(config: &RunConfig) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--backend",
        "cuda",
        "--prefetch",
        &config.prefetch.to_string(),
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
        // The ranks of these tests start together; one that never arrives should fail the
        // test within the GPU check's time, not after the default five minutes.
        "--rendezvous-timeout",
        "60",
    ]
    .map(String::from)
    .to_vec();
    if let Some(dir) = &config.checkpoint_dir {
        flags.extend(["--checkpoint-dir".into(), dir.display().to_string()]);
    }
    if config.resume {
        flags.push("--resume".into());
    }
    if config.reduce_in_rank_order {
        flags.push("--reduce-in-rank-order".into());
    }
    flags
}

/// Seconds a rank process of these tests waits for a collective before failing: a hang
/// (ranks on one GPU meet over sockets, never run before on a GPU) fails its test well within
/// the GPU check's time instead of after the default ten minutes.
const COLLECTIVE_TIMEOUT: &str = "90";

/// `world` processes of `train_gpt` on GPU 0 with `config`, meeting through the launcher
/// variables. Each is told a host id of its own (`NCCL_HOSTID`): NCCL before 2.30.7 refuses
/// two ranks of one communicator on one GPU of one host, and ranks of different hosts meet over
/// sockets. Returns rank 0's losses and final parameters' digest.
fn processes_on_one_gpu(world: usize, config: &RunConfig, dir: &std::path::Path) -> Ended {
    let port = free_port();
    let report = dir.join("memory.json");
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(program("TRAIN_GPT", "examples/train_gpt"))
                .args(flags(config))
                .args(["--timeout", COLLECTIVE_TIMEOUT])
                .arg("--memory-report")
                .arg(&report)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("CUDA_VISIBLE_DEVICES", "0")
                .env("NCCL_HOSTID", format!("burn-zero-test-{rank}"))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, child) in children.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "rank {rank} of {world}:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ended::reported(world, dir)
}

/// `world` processes of `train_gpt` with `config` and `extra` flags under `zero-run`, every
/// rank on GPU 0 (`--share-gpu`); zero-run's output, and the folder of the ranks' reports.
fn under_zero_run(
    world: usize,
    config: &RunConfig,
    extra: &[&str],
    dir: &std::path::Path,
) -> std::process::Output {
    Command::new(program("ZERO_RUN", "zero-run"))
        .args(["--nproc-per-node", &world.to_string(), "--share-gpu", "0"])
        .args(["--master-port", &free_port().to_string()])
        .arg("--")
        .arg(program("TRAIN_GPT", "examples/train_gpt"))
        .args(flags(config))
        .args(extra)
        .args(if extra.contains(&"--timeout") {
            &[][..]
        } else {
            &["--timeout", COLLECTIVE_TIMEOUT][..]
        })
        .arg("--memory-report")
        .arg(dir.join("memory.json"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

/// zero-run's output as text.
fn said(output: &std::process::Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A fresh scratch folder for `name`.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-zero-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Three NCCL ranks, one process each, on one GPU, reducing in rank order: at every stage they
/// train bit for bit like one rank accumulating the same three micro-batches (losses and final
/// parameters). The one rank runs first, in this process: the matmul kernels its autotuning
/// picks are written to cubecl's cache, which the processes then read, so both sides run the
/// same kernels.
#[test]
fn three_nccl_processes_on_one_gpu_in_rank_order_train_bitwise_like_one_rank() {
    let test = "three_nccl_processes_on_one_gpu_in_rank_order_train_bitwise_like_one_rank";
    if skip::cuda_devices(test, 1).is_none() {
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let world = 3;
    for stage in 0..=3 {
        let config = RunConfig {
            steps: 10,
            reduce_in_rank_order: true,
            ..short(world, stage)
        };
        let one = RunConfig {
            world_size: 1,
            accumulation: world,
            ..config.clone()
        };
        let want = Ended::of(&on_local_group(&one)[0]);
        let dir = scratch(&format!("{test}-{stage}"));
        let got = processes_on_one_gpu(world, &config, &dir);
        println!("stage {stage}: three NCCL processes {got:?}; one rank {want:?}");
        assert_eq!(got, want, "stage {stage}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A checkpoint saved by three NCCL processes on one GPU and resumed by two, reducing in rank
/// order, ends bit for bit like the same save and resume with `LocalGroup` ranks on threads.
#[test]
fn a_checkpoint_of_three_nccl_processes_resumes_on_two_bitwise_like_local_group() {
    let test = "a_checkpoint_of_three_nccl_processes_resumes_on_two_bitwise_like_local_group";
    if skip::cuda_devices(test, 1).is_none() {
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let (nccl_dir, local_dir) = (
        scratch(&format!("{test}-nccl")),
        scratch(&format!("{test}-local")),
    );
    let runs = |dir: &std::path::Path| {
        let save = RunConfig {
            steps: 4,
            batch_size: 12,
            reduce_in_rank_order: true,
            checkpoint_dir: Some(dir.join("checkpoints")),
            ..short(3, 3)
        };
        let resume = RunConfig {
            world_size: 2,
            steps: 8,
            resume: true,
            ..save.clone()
        };
        (save, resume)
    };
    let threads = |config: &RunConfig| Ended::of(&on_local_group(config)[0]);
    let (save, resume) = runs(&local_dir);
    threads(&save);
    let want = threads(&resume);
    let (save, resume) = runs(&nccl_dir);
    processes_on_one_gpu(3, &save, &nccl_dir);
    let got = processes_on_one_gpu(2, &resume, &nccl_dir);
    println!("resumed on two NCCL processes {got:?}; on LocalGroup {want:?}");
    assert_eq!(got, want);
    std::fs::remove_dir_all(&nccl_dir).ok();
    std::fs::remove_dir_all(&local_dir).ok();
}

/// Two NCCL processes sharing GPU 0 under `zero-run`, with prefetch and, at stage 3, half the
/// parameter shards offloaded, train bit for bit like two `LocalGroup` ranks on that GPU at
/// every stage: NCCL's sum of two terms does not depend on its order. Then three processes
/// under `zero-run` reducing in rank order, like one rank accumulating three micro-batches.
/// The references run first, in this process, so the processes read their autotune results
/// from cubecl's cache.
#[test]
fn nccl_processes_sharing_a_gpu_under_zero_run_train_bitwise_like_local_group() {
    let test = "nccl_processes_sharing_a_gpu_under_zero_run_train_bitwise_like_local_group";
    if skip::cuda_devices(test, 1).is_none() {
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let reference = |config: &RunConfig| Ended::of(&on_local_group(config)[0]);
    for stage in 0..=3 {
        let offloaded: &[&str] = if stage == 3 {
            &["--offload-param-frac", "0.5"]
        } else {
            &[]
        };
        let config = RunConfig {
            steps: 8,
            prefetch: 2,
            placement: if stage == 3 {
                Placement::device().with_offload_param_frac(0.5)
            } else {
                Placement::device()
            },
            ..short(2, stage)
        };
        let want = reference(&config);
        let dir = scratch(&format!("{test}-{stage}"));
        let output = under_zero_run(2, &config, offloaded, &dir);
        assert!(output.status.success(), "stage {stage}:\n{}", said(&output));
        let got = Ended::reported(2, &dir);
        println!("stage {stage}: two NCCL processes {got:?}; two LocalGroup ranks {want:?}");
        assert_eq!(got, want, "stage {stage}");
        std::fs::remove_dir_all(&dir).ok();
    }
    let config = RunConfig {
        steps: 8,
        prefetch: 2,
        reduce_in_rank_order: true,
        ..short(3, 3)
    };
    let want = reference(&RunConfig {
        world_size: 1,
        accumulation: 3,
        ..config.clone()
    });
    let dir = scratch(&format!("{test}-three"));
    let output = under_zero_run(3, &config, &[], &dir);
    assert!(output.status.success(), "three ranks:\n{}", said(&output));
    let got = Ended::reported(3, &dir);
    assert_eq!(
        got, want,
        "three NCCL processes in rank order against one rank"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A rank process killed (SIGKILL) in the middle of step 2, its peer sharing the GPU with
/// prefetch and offloaded parameter shards: the peer stops well within the collective timeout
/// (300 s here), and zero-run names the killed rank as the job's cause, with its signal.
#[test]
fn a_rank_process_killed_mid_step_on_a_shared_gpu_is_named_by_zero_run() {
    let test = "a_rank_process_killed_mid_step_on_a_shared_gpu_is_named_by_zero_run";
    if skip::cuda_devices(test, 1).is_none() {
        return;
    }
    let _gpus = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let config = RunConfig {
        steps: 4,
        prefetch: 2,
        ..short(2, 3)
    };
    let dir = scratch(test);
    let started = std::time::Instant::now();
    let output = under_zero_run(
        2,
        &config,
        &[
            "--offload-param-frac",
            "0.5",
            "--fail-at",
            "1:2:kill",
            "--timeout",
            "300",
        ],
        &dir,
    );
    let took = started.elapsed();
    let said = said(&output);
    println!("the job stopped after {took:?}:\n{said}");
    assert!(!output.status.success(), "{said}");
    assert!(
        took < std::time::Duration::from_secs(120),
        "the job took {took:?} to stop"
    );
    assert!(
        said.contains("rank 1 failed (killed by SIGKILL) and caused the job's failure"),
        "{said}"
    );
    assert_eq!(output.status.code(), Some(128 + 9), "{said}");
    std::fs::remove_dir_all(&dir).ok();
}
