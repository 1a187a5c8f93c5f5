//! The plain-Burn side of the GPU check's step time (feature `cuda`): the scaling suite's GPT
//! step with Burn's own Adam on CUDA device 0, no burn-zero, on Burn's `Cuda` backend
//! (`--backend cuda`, Fusion-wrapped as Burn's default) or on `CubeBackend<CudaRuntime>`
//! (`--backend cube`, the backend burn-zero's side wraps). Prints and writes (`--out`) the step
//! times; `scripts/gpu-check.sh` runs it beside `benches/gpu_steps.rs`, with the model,
//! sequence length, batch and precision both sides take (`--preset`, `--seq-len`, `--batch`,
//! `--precision`). With
//! `--count-launches`, the kernel launches of one more step (cubecl's execution log), to set
//! beside burn-zero's.
//!
//! Without a CUDA device it writes `{"skipped": "<reason>"}` and exits successfully.

#[path = "../../common/gpu_steps.rs"]
mod gpu_steps;
#[path = "../../common/workload.rs"]
mod workload;

use burn::backend::{Autodiff, Cuda};
use burn::optim::AdamConfig;
use burn::tensor::backend::AutodiffBackend;
use burn_cubecl::CubeBackend;
use burn_zero_kernels::LaunchLog;
use clap::{Parser, ValueEnum};
use cubecl::cuda::{CudaDevice, CudaRuntime};

use gpu_steps::StepArgs;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// Burn's `Cuda` (Fusion over `CubeBackend<CudaRuntime>`).
    Cuda,
    /// `CubeBackend<CudaRuntime>`, without fusion.
    Cube,
}

#[derive(Parser, Debug)]
#[command(about = "GPT step time of plain Burn on one CUDA device")]
struct Args {
    #[arg(long, value_enum, default_value_t = BackendArg::Cuda)]
    backend: BackendArg,
    /// After the timed steps, one more step with every kernel launched on the device counted
    /// from cubecl's execution log (`kernel_launches_per_step`). The log is on from the start,
    /// a line written per launch, so this run's step times are not the ones to report.
    #[arg(long)]
    count_launches: bool,
    #[command(flatten)]
    steps: StepArgs,
}

fn run<B: AutodiffBackend<Device = CudaDevice>>(
    args: &Args,
    name: &str,
) -> Result<serde_json::Value, String> {
    let device = CudaDevice::new(0);
    let corpus = workload::corpus();
    let model = gpu_steps::model::<B>(&args.steps, &corpus, &device);
    let parameters = model.parameters();
    let mut optimizer = AdamConfig::new().init();
    let (model, seconds) =
        gpu_steps::time_steps(model, &mut optimizer, &corpus, &args.steps, &device)?;
    let mut result = gpu_steps::result("plain-burn", name, parameters, &args.steps, &seconds);
    if args.count_launches {
        let ((), launched) = LaunchLog::install()
            .launches::<CudaRuntime, _>(&device, || {
                gpu_steps::one_more_step(model, &mut optimizer, &corpus, &args.steps, &device)
            })
            .map_err(|e| e.to_string())?;
        result["kernel_launches_per_step"] = launched.len().into();
    }
    Ok(result)
}

/// Whether the CUDA driver loads and sees a device (cubecl panics on first use otherwise).
fn cuda_visible() -> bool {
    // SAFETY: `is_culib_present` only tries to `dlopen` the driver library's candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    cudarc::driver::CudaContext::device_count().is_ok_and(|n| n > 0)
}

fn main() {
    let args = Args::parse();
    if args.count_launches {
        // Before any cubecl client exists.
        LaunchLog::install();
    }
    let result = if !cuda_visible() {
        Ok(serde_json::json!({ "skipped": "no CUDA device visible" }))
    } else {
        match args.backend {
            BackendArg::Cuda => run::<Autodiff<Cuda>>(&args, "Autodiff<Cuda> (Fusion)"),
            BackendArg::Cube => run::<Autodiff<CubeBackend<CudaRuntime, f32, i32, u8>>>(
                &args,
                "Autodiff<CubeBackend<CudaRuntime>>",
            ),
        }
    };
    let result = result.and_then(|value| gpu_steps::emit(&args.steps, &value));
    if let Err(error) = result {
        eprintln!("plain_gpu: {error}");
        std::process::exit(1);
    }
}
