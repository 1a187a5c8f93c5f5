//! Instructions of the single-rank overhead, burn-zero's side: `steps` GPT `small` training
//! steps (forward, backward, `ZeroOptimizer` with Adam) on `Autodiff<Zero<Flex>>`, one rank
//! (a one-rank `LocalGroup`), at the ZeRO stage given, after one untimed step that creates the
//! optimizer state. Not a timed benchmark: `benches/plain-burn/instructions.sh` runs it under
//! `valgrind --tool=callgrind` twice, with two step counts, and takes the difference, which
//! leaves the instructions of the extra steps alone (start-up, the model's initialisation and
//! the first step cancel out). The plain-Burn side is `benches/plain-burn/benches/steps.rs`.
//!
//! Usage: `zero_steps <stage> <steps>`.

#[path = "common/workload.rs"]
mod workload;

use burn::backend::{Autodiff, Flex};
use burn::optim::AdamConfig;
use burn_zero::comm::launch;
use burn_zero::{PerTensor, Zero, ZeroConfig, ZeroError, ZeroOptimizer, shard};

type Train = Autodiff<Zero<Flex>>;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, what: &str| -> usize {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("usage: zero_steps <stage> <steps> (missing {what})"))
    };
    // `cargo bench` passes `--bench`: nothing to measure then.
    if args.first().is_some_and(|a| a.starts_with("--")) {
        return;
    }
    let (stage, steps) = (number(0, "stage") as u8, number(1, "steps"));
    let config = ZeroConfig::new()
        .with_stage(stage)
        .with_persist_below_numel(0);
    launch::<Flex, _, _, ZeroError>(1, &[Default::default()], |ctx| {
        let corpus = workload::corpus();
        let model = workload::model::<Train>(&corpus, ctx.device());
        let (model, zero) = shard(model, &ctx, &config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut model = workload::step(model, &mut optimizer, &corpus, 0, 0, 1, ctx.device());
        for step in 1..=steps {
            model = workload::step(model, &mut optimizer, &corpus, step, 0, 1, ctx.device());
        }
        Ok(())
    })
    .expect("the run");
}
