//! `CheckpointError`: everything that can go wrong saving, loading or consolidating.

use std::path::PathBuf;

use burn_zero_comm::CommError;

/// Why a checkpoint could not be saved, loaded or consolidated.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An I/O error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The disk (or a file-size limit) ran out while writing; the previous checkpoint is
    /// untouched.
    #[error(
        "no space left writing {path} ({source}); the checkpoint was not committed and the \
         previous one is intact"
    )]
    DiskFull {
        /// The file being written.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// No complete checkpoint where one was expected.
    #[error("no complete checkpoint in {0}")]
    NotFound(PathBuf),
    /// The directory holds a checkpoint whose save did not finish (no commit marker).
    #[error("{0} is an incomplete checkpoint (its save did not finish: no metadata.json)")]
    Incomplete(PathBuf),
    /// A checkpoint of this step was already committed there.
    #[error("{0} already holds a complete checkpoint; refusing to overwrite it")]
    Exists(PathBuf),
    /// `metadata.json` or a rank index could not be read as the format.
    #[error("{path}: not a burn-zero checkpoint: {reason}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file's bytes do not match their recorded checksum or size.
    #[error("{file}: tensor `{tensor}` is corrupted or truncated: {reason}")]
    Corrupted {
        /// The file.
        file: PathBuf,
        /// The tensor whose bytes are wrong.
        tensor: String,
        /// What was found.
        reason: String,
    },
    /// The model to load into does not have the saved model's parameters.
    #[error("the model does not match the checkpoint: {0}")]
    ModelMismatch(String),
    /// The model or optimizer is not one `save`/`load` can handle.
    #[error("{0}")]
    Unsupported(String),
    /// The optimizer state could not be taken apart or put back together.
    #[error("optimizer state of `{param}`: {reason}")]
    OptimizerState {
        /// The parameter.
        param: String,
        /// What failed.
        reason: String,
    },
    /// Another rank failed; its own error says why.
    #[error("rank {rank}: {what} failed on rank(s) {} (see that rank's error)", ranks(.failed))]
    OtherRank {
        /// This rank.
        rank: usize,
        /// Save or load.
        what: &'static str,
        /// The ranks whose own save or load failed.
        failed: Vec<usize>,
    },
    /// A collective among the ranks failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}

impl CheckpointError {
    /// Wraps an I/O error on `path`, telling a full disk (or file-size limit) apart.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        let full = matches!(
            source.kind(),
            std::io::ErrorKind::StorageFull
                | std::io::ErrorKind::FileTooLarge
                | std::io::ErrorKind::QuotaExceeded
        );
        if full {
            CheckpointError::DiskFull { path, source }
        } else {
            CheckpointError::Io { path, source }
        }
    }
}

fn ranks(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
