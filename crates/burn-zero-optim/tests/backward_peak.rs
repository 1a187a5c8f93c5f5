//! The gradients a stage-3 backward pass holds at once, measured outside the library: a
//! counting global allocator sees every heap byte of this test process (Flex tensors live on
//! the heap), and the peak of a backward pass above what was live when it began is what the
//! pass held.
//!
//! The model is a stack of linear layers, each followed by a LayerNorm. burn-autodiff runs
//! backward level by level of node depth, so a LayerNorm's scale and shift, which enter the
//! graph through a shallow broadcast, get their gradients only when backward ends. Reduced
//! strictly in the layout's order, a bucket holding them would hold back every bucket behind
//! it, and the pass would keep every weight's full gradient until its end. With buckets rebuilt
//! for the order backward produces gradients in and at most one bucket waiting behind the one
//! being reduced, the pass holds a few weights' gradients at a time, where the same training
//! without overlap
//! (which reduces when backward ends) holds them all; and both end bitwise the same.

use burn::backend::Flex;
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn_zero_comm::launch;
use burn_zero_core::{ZeroConfig, ZeroError, shard};
use burn_zero_optim::{PerTensor, ZeroOptimizer};
use burn_zero_testing::alloc::CountingAllocator;
use burn_zero_testing::{Materialise, Train, param_values};

#[path = "common/normed.rs"]
mod normed;
use normed::{LAYERS, NormedStack as Stack, WEIGHT_BYTES, WIDTH, input};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::new();

/// Each step's backward peak above the bytes live when it began, and the final parameters.
fn train(base: &Stack<Train>, config: &ZeroConfig, steps: usize) -> (Vec<usize>, Vec<Vec<f32>>) {
    let mut runs = launch::<Flex, _, _, ZeroError>(1, &[Default::default()], |ctx| {
        let (mut model, zero) = shard(base.clone(), &ctx, config)?;
        let mut optimizer =
            ZeroOptimizer::new(&zero, PerTensor(AdamConfig::new().build())).unwrap();
        let mut peaks = Vec::new();
        for step in 0..steps {
            let loss = model.loss(input(step, 0, ctx.device()));
            let before = ALLOCATOR.live();
            ALLOCATOR.reset_peak();
            let grads = loss.backward();
            peaks.push(ALLOCATOR.peak() - before);
            let grads = GradientsParams::from_grads(grads, &model);
            model = optimizer.step(1e-3, model, grads);
        }
        Ok((peaks, param_values(&model)))
    })
    .unwrap();
    runs.swap_remove(0)
}

#[test]
fn a_backward_pass_holds_a_few_gradients_at_a_time() {
    let base = Stack::<Train>::new(&Default::default());
    base.visit(&mut Materialise);
    // Weights sharded, one per bucket; biases and LayerNorms replicated; no gather cache, so
    // what backward holds is its gradients and one gathered weight at a time.
    let config = ZeroConfig::new()
        .with_stage(3)
        .with_persist_below_numel(WIDTH * WIDTH)
        .with_max_live_gathered_bytes(0)
        .with_bucket_size_mb(WEIGHT_BYTES as f64 / f64::from(1u32 << 20));
    let steps = 4;
    let (peaks, params) = train(&base, &config, steps);
    let (held, reference) = train(&base, &config.clone().with_overlap_comm(false), steps);
    let gradients = LAYERS * WEIGHT_BYTES;
    println!(
        "backward peaks {peaks:?} bytes with overlap, {held:?} without; every weight's \
         gradient: {gradients} bytes"
    );
    // The first steps also fill the buckets' pooled pack buffers, which stay from step to step
    // (live before the later steps begin): the steps after them show what a pass holds.
    for step in 2..steps {
        // Without overlap every gradient waits for the end of backward: the measurement sees it.
        assert!(
            held[step] >= gradients * 9 / 10,
            "step {step}: without overlap backward held only {} bytes of {gradients}",
            held[step]
        );
        // One gradient being reduced, one waiting, one being computed, one gathered weight,
        // and change: well under a third of the model's gradients.
        assert!(
            peaks[step] < gradients / 3,
            "step {step}: backward held {} bytes at its peak, the model's gradients are \
             {gradients}",
            peaks[step]
        );
    }
    assert_eq!(
        params, reference,
        "overlapped training ends where training without it does"
    );
}
