//! `zero-consolidate DIR OUT`: turns a burn-zero sharded checkpoint into one safetensors file
//! that plain Burn loads (burn-store's `SafetensorsStore`), or with `--checkpoint` into a
//! world-size-1 checkpoint that keeps the optimizer state. Needs no model type; holds one
//! tensor and one read buffer in memory at a time.

use std::path::PathBuf;
use std::process::ExitCode;

use burn_zero_checkpoint::{OutputDtype, consolidate, consolidate_checkpoint};
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    /// fp32, from the optimizer's fp32 masters where saved.
    F32,
    /// Each parameter's training dtype.
    Training,
}

/// Consolidate a burn-zero sharded checkpoint.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// A checkpoint directory, or a checkpoint root (its latest complete checkpoint is used).
    dir: PathBuf,
    /// The safetensors file to write (a directory with `--checkpoint`).
    out: PathBuf,
    /// Element type of the written parameters.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
    /// Write a world-size-1 burn-zero checkpoint (parameters, masters, optimizer state and
    /// accumulators) instead of a plain model file.
    #[arg(long)]
    checkpoint: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = if args.checkpoint {
        consolidate_checkpoint(&args.dir, &args.out)
    } else {
        let dtype = match args.dtype {
            Dtype::F32 => OutputDtype::F32,
            Dtype::Training => OutputDtype::Training,
        };
        consolidate(&args.dir, &args.out, dtype)
    };
    match result {
        Ok(done) => {
            println!(
                "{}: {} tensors, {} bytes written to {}",
                done.checkpoint.display(),
                done.tensors,
                done.bytes,
                done.output.display()
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("zero-consolidate: {error}");
            ExitCode::FAILURE
        }
    }
}
