//! The burn-zero side of the GPU check's step time: the scaling suite's GPT step (or another
//! model, sequence length, batch and precision: `--preset`, `--seq-len`, `--batch`,
//! `--precision`) under `Autodiff<Zero<_>>` over `CubeBackend<CudaRuntime>` or Burn's fused
//! `Cuda` (`--backend`) on CUDA device 0, one rank, `NcclGroup`, at the ZeRO stage given by
//! `--stage` (every parameter sharded, as in the scaling suite), with one parameter per chunk
//! or the searched chunk size (`--chunk-size param|search`), with `ZeroOptimizer` over Burn's
//! Adam. Prints and writes (`--out`) the step times, the rank's memory accounting (the tracer's
//! figures; the runner reads the driver's own beside them), the chunk layout and burn-zero's
//! counts per timed step (collectives by kind, device synchronisations, host reads), and with
//! `--count-launches` the kernel launches of one more step (cubecl's execution log). The
//! plain-Burn side is `benches/plain-burn/benches/plain_gpu.rs`; `scripts/gpu-check.sh` runs
//! both.
//!
//! Without a CUDA device it writes `{"skipped": "<reason>"}` and exits successfully.

#[path = "common/gpu_steps.rs"]
mod gpu_steps;
#[path = "common/workload.rs"]
mod workload;

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::optim::AdamConfig;
use burn::tensor::backend::Backend;
use burn_zero::comm::nccl::{
    CudaBackend, CudaDevice, CudaRuntime, FusedCudaBackend, NcclGroup, NcclOptions,
    cuda_device_count,
};
use burn_zero::comm::{Communicator, RankContext};
use burn_zero::core::chunk::ChunkKind;
use burn_zero::{ChunkSize, PerTensor, Zero, ZeroConfig, ZeroOptimizer, shard};
use burn_zero_kernels::LaunchLog;
use clap::{Parser, ValueEnum};

use gpu_steps::StepArgs;

/// The backend `Zero` wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// `CubeBackend<CudaRuntime>`, without fusion.
    Cube,
    /// Burn's `Cuda` (Fusion over `CubeBackend<CudaRuntime>`).
    Cuda,
}

#[derive(Parser, Debug)]
#[command(about = "GPT step time of Zero on one CUDA device (NCCL, world size 1)")]
struct Args {
    /// The backend `Zero` wraps, as plain Burn's side takes it.
    #[arg(long, value_enum, default_value_t = BackendArg::Cube)]
    backend: BackendArg,
    /// ZeRO stage, 0 to 3.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: u8,
    /// How parameters are grouped into chunks, each gathered and reduced with one collective:
    /// `param` (one parameter per chunk) or `search` (the searched size).
    #[arg(long, default_value = "param", value_parser = parse_chunk_size)]
    chunk_size: ChunkSize,
    /// After the timed steps, one more step with every kernel launched on the device counted
    /// from cubecl's execution log (`kernel_launches_per_step`). The log is on from the start,
    /// a line written per launch, so this run's step times are not the ones to report.
    #[arg(long)]
    count_launches: bool,
    #[command(flatten)]
    steps: StepArgs,
}

/// `--chunk-size`: `param` or `search`.
fn parse_chunk_size(text: &str) -> Result<ChunkSize, String> {
    match text {
        "param" => Ok(ChunkSize::PerParameter),
        "search" => Ok(ChunkSize::default_search()),
        other => Err(format!("{other:?}: give `param` or `search`")),
    }
}

/// The name `--chunk-size` takes for `size`.
fn chunk_size_name(size: &ChunkSize) -> &'static str {
    match size {
        ChunkSize::PerParameter => "param",
        _ => "search",
    }
}

fn run<Inner>(args: &Args, name: &str) -> Result<serde_json::Value, String>
where
    Inner: Backend<Device = CudaDevice>,
    NcclGroup: Communicator<Inner>,
{
    let device = CudaDevice::new(0);
    let group = NcclGroup::local_group(std::slice::from_ref(&device), &NcclOptions::default())
        .map_err(|e| format!("creating the NCCL group: {e}"))?
        .remove(0);
    let comm: Arc<dyn Communicator<Inner>> = Arc::new(group);
    let ctx = RankContext::new(device.clone(), comm);
    let corpus = workload::corpus();
    let model = gpu_steps::model::<Autodiff<Zero<Inner>>>(&args.steps, &corpus, &device);
    let parameters = model.parameters();
    let config = ZeroConfig::new()
        .with_stage(args.stage)
        .with_persist_below_numel(0)
        .with_chunk_size(args.chunk_size);
    let (model, zero) = shard(model, &ctx, &config).map_err(|e| format!("shard: {e}"))?;
    let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
    // burn-zero's counts over the timed steps (the runner's synchronisation after each step is
    // Burn's own, not counted).
    let mut before = None;
    let (model, seconds) =
        gpu_steps::time_steps_with(model, &mut optimizer, &corpus, &args.steps, &device, || {
            before = Some(zero.counts())
        })?;
    let counts = zero.counts() - before.unwrap_or_default();
    let launches = if args.count_launches {
        let ((), launched) = LaunchLog::install()
            .launches::<CudaRuntime, _>(&device, || {
                gpu_steps::one_more_step(model, &mut optimizer, &corpus, &args.steps, &device)
            })
            .map_err(|e| e.to_string())?;
        Some(launched.len())
    } else {
        None
    };
    let memory = Some(zero.memory_report());
    let chunks = zero.store().chunks();
    let per_step = |n: u64| n as f64 / args.steps.steps.max(1) as f64;
    let mut result = gpu_steps::result("burn-zero", name, parameters, &args.steps, &seconds);
    result["stage"] = args.stage.into();
    result["world_size"] = 1.into();
    result["chunk_size"] = chunk_size_name(&args.chunk_size).into();
    result["chunks"] = serde_json::json!({
        "sharded": chunks.count(ChunkKind::Sharded),
        "replicated": chunks.count(ChunkKind::Replicated),
        "padding_elements": chunks.padding(zero.world_size()),
    });
    result["counts_per_step"] = serde_json::json!({
        "all_gathers": per_step(counts.all_gathers),
        "reduce_scatters": per_step(counts.reduce_scatters),
        "all_reduces": per_step(counts.all_reduces),
        "other_collectives": per_step(counts.other_collectives),
        "collectives": per_step(counts.collectives()),
        "syncs": per_step(counts.syncs),
        "engine_waits": per_step(counts.engine_waits),
        "host_reads": per_step(counts.host_reads),
        "host_writes": per_step(counts.host_writes),
        "host_read_bytes": per_step(counts.host_read_bytes),
        "host_write_bytes": per_step(counts.host_write_bytes),
    });
    result["memory"] = serde_json::to_value(memory).map_err(|e| e.to_string())?;
    if let Some(launches) = launches {
        result["kernel_launches_per_step"] = launches.into();
    }
    Ok(result)
}

fn main() {
    let args = Args::parse();
    if args.count_launches {
        // Before any cubecl client exists.
        LaunchLog::install();
    }
    let result = match cuda_device_count() {
        Ok(0) => Ok(serde_json::json!({
            "skipped": "no CUDA device visible",
            "stage": args.stage,
            "chunk_size": chunk_size_name(&args.chunk_size),
        })),
        Ok(_) => match args.backend {
            BackendArg::Cube => run::<CudaBackend>(
                &args,
                "Autodiff<Zero<CubeBackend<CudaRuntime>>> + NcclGroup",
            ),
            BackendArg::Cuda => {
                run::<FusedCudaBackend>(&args, "Autodiff<Zero<Cuda>> (Fusion) + NcclGroup")
            }
        },
        Err(error) => Err(error.to_string()),
    };
    let result = result.and_then(|value| gpu_steps::emit(&args.steps, &value));
    if let Err(error) = result {
        eprintln!("gpu_steps: {error}");
        std::process::exit(1);
    }
}
