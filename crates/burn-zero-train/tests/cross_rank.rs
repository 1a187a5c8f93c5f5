//! `CrossRank` for every burn-train output type it is implemented for: each of 3 ranks builds an
//! output whose shapes and values depend on its rank, gathers every rank's, and must get back,
//! in rank order, exactly what each rank built (values, shapes, dtypes), rebuilt here from the
//! rank number. Values an f32 cannot carry exactly are refused by name.

use burn::backend::Flex;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_train::{
    ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput, SequenceOutput,
};
use burn_zero_comm::{CommError, RankContext, launch};
use burn_zero_train::CrossRank;

type B = Flex;
const WORLD: usize = 3;

/// Rank `rank`'s rows: ranks hold different numbers of items, as the last batch of an epoch can.
fn rows(rank: usize) -> usize {
    2 + rank
}

/// Floats with fractions, exact in f32, different per rank and element.
fn floats(rank: usize, salt: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 131 + salt * 17 + i * 7) % 97) as f32 / 8.0 - 6.0)
        .collect()
}

/// Class indices and token ids, some of them large (still below 2²⁴).
fn ints(rank: usize, salt: usize, len: usize) -> Vec<i64> {
    (0..len)
        .map(|i| ((rank * 7919 + salt * 104_729 + i * 31) % 16_000_000) as i64)
        .collect()
}

fn float<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn int<const D: usize>(values: Vec<i64>, shape: [usize; D]) -> Tensor<B, D, Int> {
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// A tensor's dtype, shape and values as f64 (exact for every value used here).
fn seen<const D: usize, K: burn::tensor::BasicOps<B>>(
    tensor: &Tensor<B, D, K>,
) -> (DType, Vec<usize>, Vec<f64>) {
    let data = tensor.clone().into_data();
    let dtype = data.dtype;
    let shape = data.shape.to_vec();
    (
        dtype,
        shape,
        data.convert::<f64>().into_vec::<f64>().unwrap(),
    )
}

fn classification(rank: usize) -> ClassificationOutput<B> {
    let n = rows(rank);
    ClassificationOutput::new(
        float(floats(rank, 1, 1), [1]),
        float(floats(rank, 2, n * 4), [n, 4]),
        int(ints(rank, 3, n), [n]),
    )
}

fn multi_label(rank: usize) -> MultiLabelClassificationOutput<B> {
    let n = rows(rank);
    MultiLabelClassificationOutput {
        loss: float(floats(rank, 4, 1), [1]),
        output: float(floats(rank, 5, n * 3), [n, 3]),
        targets: int(ints(rank, 6, n * 3).iter().map(|v| v % 2).collect(), [n, 3]),
    }
}

fn regression(rank: usize) -> RegressionOutput<B> {
    let n = rows(rank);
    RegressionOutput {
        loss: float(floats(rank, 7, 1), [1]),
        output: float(floats(rank, 8, n * 2), [n, 2]),
        targets: float(floats(rank, 9, n * 2), [n, 2]),
    }
}

fn sequence(rank: usize, predicted: bool) -> SequenceOutput<B> {
    let (n, len, vocab) = (rows(rank), 3, 5);
    SequenceOutput {
        loss: float(floats(rank, 10, 1), [1]),
        logits: float(floats(rank, 11, n * len * vocab), [n, len, vocab]),
        predictions: predicted.then(|| int(ints(rank, 12, n * len), [n, len])),
        targets: int(ints(rank, 13, n * len), [n, len]),
    }
}

type Seen = Vec<(DType, Vec<usize>, Vec<f64>)>;

fn of_classification(o: &ClassificationOutput<B>) -> Seen {
    vec![seen(&o.loss), seen(&o.output), seen(&o.targets)]
}

fn of_multi_label(o: &MultiLabelClassificationOutput<B>) -> Seen {
    vec![seen(&o.loss), seen(&o.output), seen(&o.targets)]
}

fn of_regression(o: &RegressionOutput<B>) -> Seen {
    vec![seen(&o.loss), seen(&o.output), seen(&o.targets)]
}

fn of_sequence(o: &SequenceOutput<B>) -> Seen {
    let mut all = vec![seen(&o.loss), seen(&o.logits), seen(&o.targets)];
    all.extend(o.predictions.as_ref().map(seen));
    all
}

/// Gathers `make(rank)` on every rank and checks each rank's copy of every rank's output
/// against `make(r)` rebuilt here.
fn check<T, F, S>(what: &str, make: F, describe: S)
where
    T: CrossRank,
    F: Fn(usize) -> T + Sync,
    S: Fn(&T) -> Seen + Sync,
{
    let gathered =
        launch::<B, _, _, String>(WORLD, &[Default::default()], |ctx: RankContext<B>| {
            let all = make(ctx.rank())
                .all_gather(ctx.comm().as_ref(), ctx.device())
                .map_err(|e| e.to_string())?;
            Ok(all.iter().map(&describe).collect::<Vec<_>>())
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    for (rank, outputs) in gathered.iter().enumerate() {
        assert_eq!(outputs.len(), WORLD, "{what}: rank {rank}");
        for (from, output) in outputs.iter().enumerate() {
            assert_eq!(
                output,
                &describe(&make(from)),
                "{what}: rank {rank}'s copy of rank {from}'s output"
            );
        }
    }
}

#[test]
fn classification_outputs_cross_ranks_exactly() {
    check("classification", classification, of_classification);
}

#[test]
fn multi_label_outputs_cross_ranks_exactly() {
    check("multi-label", multi_label, of_multi_label);
}

#[test]
fn regression_outputs_cross_ranks_exactly() {
    check("regression", regression, of_regression);
}

#[test]
fn sequence_outputs_cross_ranks_exactly_with_and_without_predictions() {
    check("sequence", |rank| sequence(rank, true), of_sequence);
    check(
        "sequence without predictions",
        |rank| sequence(rank, false),
        of_sequence,
    );
}

#[test]
fn values_an_f32_cannot_carry_are_refused_by_name() {
    let errors = launch::<B, _, _, CommError>(2, &[Default::default()], |ctx| {
        let n = 2;
        let mut output = classification(ctx.rank());
        output.targets = int(vec![1 << 25, 3], [n]);
        Ok(output
            .all_gather(ctx.comm().as_ref(), ctx.device())
            .err()
            .map(|e| e.to_string()))
    })
    .unwrap();
    for error in errors {
        let error = error.expect("a target above 2²⁴ is refused");
        assert!(
            error.contains("33554432") && error.contains("2^24"),
            "{error}"
        );
    }
}
