//! Instructions of the single-rank overhead, plain Burn's side: `steps` GPT `small` training
//! steps (forward, backward, Burn's Adam) on `Autodiff<Flex>`, after one untimed step that
//! creates Adam's state. Not a timed benchmark: `instructions.sh` (beside this package's
//! manifest) runs it under `valgrind --tool=callgrind` with two step counts and takes the
//! difference, as it does for burn-zero's `zero_steps`.
//!
//! Usage: `steps <steps>`.

#[path = "../../common/workload.rs"]
mod workload;

use burn::backend::{Autodiff, Flex};
use burn::optim::AdamConfig;

type Train = Autodiff<Flex>;

fn main() {
    let arg = std::env::args().nth(1);
    // `cargo bench` passes `--bench`: nothing to measure then.
    if arg.as_deref().is_none_or(|a| a.starts_with("--")) {
        return;
    }
    let steps: usize = arg
        .and_then(|a| a.parse().ok())
        .expect("usage: steps <steps>");
    // A burn-zero rank runs on a thread of its own; so does this.
    std::thread::spawn(move || {
        let device = Default::default();
        let corpus = workload::corpus();
        let model = workload::model::<Train>(&corpus, &device);
        let mut optimizer = AdamConfig::new().init();
        let mut model = workload::step(model, &mut optimizer, &corpus, 0, 0, 1, &device);
        for step in 1..=steps {
            model = workload::step(model, &mut optimizer, &corpus, step, 0, 1, &device);
        }
    })
    .join()
    .expect("the run");
}
