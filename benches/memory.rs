//! Model-state memory per rank against the ZeRO formula, for N = 1, 2, 4, 8 ranks (threads) on
//! a 50.4M-parameter model: stage 3, f16 parameters and compute (Flex), Adam on fp32 master
//! shards. Expected per rank: (2 + 2 + 12)·Ψ/N bytes, plus padding. One training step per
//! run; the table goes to stdout and `target/bench-reports/memory.md`.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{DType, Tensor};
use burn_zero::comm::launch;
use burn_zero::{PerTensor, Placement, Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard};
use common::{Deep, WIDTH};

type Train = Autodiff<Zero<Flex>>;

/// Casts every parameter to f16.
struct ToF16;

impl burn::module::ModuleMapper<Train> for ToF16 {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<Train, D>>,
    ) -> burn::module::Param<Tensor<Train, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = Tensor::from_inner(tensor.inner().cast(DType::F16)).require_grad();
        burn::module::Param::from_mapped_value(id, tensor, mapper)
    }
}

fn mb(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

fn main() {
    let config = ZeroConfig::new().with_persist_below_numel(0);
    let mut out = String::from(
        "| ranks | parameter shards (f16) | gradient shards (f16) | fp32 master | Adam state | model state | (2+2+12)Ψ/N | difference | buckets peak | gathered peak |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for world_size in [1, 2, 4, 8] {
        let per_rank = launch::<Flex, _, _, ZeroError>(world_size, &[Default::default()], |ctx| {
            let model = Deep::<Train>::new(ctx.device()).map(&mut ToF16);
            let psi: usize = model.num_params();
            let (mut model, zero) = shard(model, &ctx, &config)?;
            let mut optimizer =
                ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
            let x = Tensor::<Train, 2>::ones([1, WIDTH], (ctx.device(), DType::F16));
            let loss = model.forward(x).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(1e-3, model, grads);
            let report = zero.memory_report();
            drop(model);
            Ok((
                psi,
                report,
                optimizer.master_bytes(),
                optimizer.state_bytes(),
            ))
        })
        .expect("benchmark ranks");
        let (psi, report, master, state) = &per_rank[0];
        let params = report.parameter_shards.current as usize;
        let grads = report.gradient_shards.peak as usize;
        let total = params + grads + master + state;
        let formula = 16.0 * *psi as f64 / world_size as f64;
        out += &format!(
            "| {world_size} | {} MB | {} MB | {} MB | {} MB | {} MB | {} MB | {:+.4}% | {} MB | {} MB |\n",
            mb(params),
            mb(grads),
            mb(*master),
            mb(*state),
            mb(total),
            mb(formula as usize),
            (total as f64 / formula - 1.0) * 100.0,
            mb(report.buckets.peak as usize),
            mb(report.gathered.peak as usize),
        );
    }
    out += &placements(&config.clone().with_reuse_fp16_shard(true));
    common::publish("memory", &out);
}

/// Where the model state lives at 4 ranks with the optimizer on the device or offloaded to the
/// host (Flex on the CPU stands in for both), with `reuse_fp16_shard`: rank 0's bytes after the
/// second backward (the first step created the masters) and after the second step.
fn placements(config: &ZeroConfig) -> String {
    const RANKS: usize = 4;
    let mut out = format!(
        "\nAt {RANKS} ranks with `reuse_fp16_shard`, after the second backward → after the second step (rank 0):\n\n\
         | optimizer | parameter shards | gradient shards | device model data at the gap | fp32 master + Adam state | where the master lives |\n|---|---|---|---|---|---|\n"
    );
    for offload in [false, true] {
        let per_rank = launch::<Flex, _, _, ZeroError>(RANKS, &[Default::default()], |ctx| {
            let model = Deep::<Train>::new(ctx.device()).map(&mut ToF16);
            let placement = Placement::fractions(0.0, if offload { 1.0 } else { 0.0 });
            let config = config.clone().with_placement(placement);
            let (mut model, zero) = shard(model, &ctx, &config)?;
            let mut optimizer = ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build()))?;
            let mut reports = Vec::new();
            for _ in 0..2 {
                let x = Tensor::<Train, 2>::ones([1, WIDTH], (ctx.device(), DType::F16));
                let grads = GradientsParams::from_grads(model.forward(x).mean().backward(), &model);
                let gap = zero.memory_report();
                model = optimizer.step(1e-3, model, grads);
                reports.push((gap, zero.memory_report()));
            }
            drop(model);
            Ok(reports.pop().expect("two steps"))
        })
        .expect("benchmark ranks");
        let (gap, after) = &per_rank[0];
        let device_at_gap = gap.parameter_shards.current + gap.gradient_shards.current;
        let optimizer = after.master_weights.current + after.optimizer_state.current;
        out += &format!(
            "| {} | {} → {} MB | {} → {} MB | {} MB | {} MB | {} |\n",
            if offload {
                "on the host (`offload_optim_frac` 1, Flex)"
            } else {
                "on the device"
            },
            mb(gap.parameter_shards.current as usize),
            mb(after.parameter_shards.current as usize),
            mb(gap.gradient_shards.current as usize),
            mb(after.gradient_shards.current as usize),
            mb(device_at_gap as usize),
            mb(optimizer as usize),
            if offload {
                "host backend"
            } else {
                "model's device"
            },
        );
    }
    out
}
