//! The burn-zero side of the GPU check's step time: the scaling suite's GPT step under
//! `Autodiff<Zero<_>>` on CUDA device 0, one rank, `NcclGroup`, at the ZeRO stage given by
//! `--stage` (every parameter sharded, as in the scaling suite), with `ZeroOptimizer` over
//! Burn's Adam. Prints and writes (`--out`) the step times and the rank's memory accounting
//! (the tracer's figures; the runner reads the driver's own beside them). The plain-Burn side
//! is `benches/plain-burn/benches/plain_gpu.rs`; `scripts/gpu-check.sh` runs both.
//!
//! Without a CUDA device it writes `{"skipped": "<reason>"}` and exits successfully.

#[path = "common/gpu_steps.rs"]
mod gpu_steps;
#[path = "common/workload.rs"]
mod workload;

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::optim::AdamConfig;
use burn_zero::comm::nccl::{CudaBackend, CudaDevice, NcclGroup, NcclOptions, cuda_device_count};
use burn_zero::comm::{Communicator, RankContext};
use burn_zero::{Zero, ZeroConfig, ZeroOptimizer, shard};
use clap::Parser;

use gpu_steps::StepArgs;

/// The backend `Zero` wraps.
type Inner = CudaBackend;
type Train = Autodiff<Zero<Inner>>;

#[derive(Parser, Debug)]
#[command(about = "GPT step time of Zero on one CUDA device (NCCL, world size 1)")]
struct Args {
    /// ZeRO stage, 0 to 3.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    stage: u8,
    #[command(flatten)]
    steps: StepArgs,
}

fn run(args: &Args) -> Result<serde_json::Value, String> {
    let device = CudaDevice::new(0);
    let group = NcclGroup::local_group(std::slice::from_ref(&device), &NcclOptions::default())
        .map_err(|e| format!("creating the NCCL group: {e}"))?
        .remove(0);
    let comm: Arc<dyn Communicator<Inner>> = Arc::new(group);
    let ctx = RankContext::new(device.clone(), comm);
    let corpus = workload::corpus();
    let model = workload::model::<Train>(&corpus, &device);
    let parameters = model.parameters();
    let config = ZeroConfig::new()
        .with_stage(args.stage)
        .with_persist_below_numel(0);
    let (model, zero) = shard(model, &ctx, &config).map_err(|e| format!("shard: {e}"))?;
    let mut optimizer = ZeroOptimizer::new(&zero, AdamConfig::new().build());
    let (_model, seconds) =
        gpu_steps::time_steps(model, &mut optimizer, &corpus, &args.steps, &device)?;
    let memory = Some(zero.memory_report());
    let mut result = gpu_steps::result(
        "burn-zero",
        "Autodiff<Zero<CubeBackend<CudaRuntime>>> + NcclGroup",
        parameters,
        &seconds,
    );
    result["stage"] = args.stage.into();
    result["world_size"] = 1.into();
    result["memory"] = serde_json::to_value(memory).map_err(|e| e.to_string())?;
    Ok(result)
}

fn main() {
    let args = Args::parse();
    let result = match cuda_device_count() {
        Ok(0) => {
            Ok(serde_json::json!({ "skipped": "no CUDA device visible", "stage": args.stage }))
        }
        Ok(_) => run(&args),
        Err(error) => Err(error.to_string()),
    };
    let result = result.and_then(|value| gpu_steps::emit(&args.steps, &value));
    if let Err(error) = result {
        eprintln!("gpu_steps: {error}");
        std::process::exit(1);
    }
}
