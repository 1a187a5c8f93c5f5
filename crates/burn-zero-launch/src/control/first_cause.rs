//! The job's first cause of failure: the first rank that failed on its own account, with its
//! reason ([`FirstCause`]), and the file where rank 0's store writes it for the launcher to
//! read ([`CAUSE_FILE_VAR`]).

use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The environment variable naming the file where rank 0's store writes the job's first
/// cause ([`FirstCause::write_to`]). `zero-run` sets it for every rank it starts and reads the
/// file when a rank failed; without it the store writes nothing.
pub const CAUSE_FILE_VAR: &str = "BURN_ZERO_CAUSE_FILE";

/// The cause file named by [`CAUSE_FILE_VAR`] in this process's environment, if set.
pub fn cause_file_from_env() -> Option<PathBuf> {
    std::env::var_os(CAUSE_FILE_VAR)
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
}

/// The first rank of the job that failed on its own account, and why: the rank whose failure
/// caused the others to stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstCause {
    /// The rank.
    pub rank: usize,
    /// Its error or panic message, or the store's account of how it failed.
    pub reason: String,
}

impl fmt::Display for FirstCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.reason)
    }
}

/// Why a cause file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CauseFileError {
    /// The file exists but could not be read.
    #[error("cannot read the cause file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
    /// The file does not hold `rank N` on its first line.
    #[error("the cause file {path} does not start with a `rank N` line: {first_line:?}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What its first line holds.
        first_line: String,
    },
}

impl FirstCause {
    /// The file's text: `rank N` on the first line, the reason verbatim after it (so that a
    /// reason of several lines needs no escaping).
    pub fn to_text(&self) -> String {
        format!("rank {}\n{}", self.rank, self.reason)
    }

    /// Writes the cause to `path` whole: to a file beside it first, then renamed over it, so a
    /// reader never sees half of it.
    pub fn write_to(&self, path: &Path) -> io::Result<()> {
        let mut partial = OsString::from(path.as_os_str());
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        fs::write(&partial, self.to_text())?;
        fs::rename(&partial, path)
    }

    /// Reads a cause written by [`FirstCause::write_to`]; `Ok(None)` when there is no file
    /// (no rank failed, or no store of this job writes there).
    pub fn read_from(path: &Path) -> Result<Option<Self>, CauseFileError> {
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CauseFileError::Read {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        let (first, reason) = text.split_once('\n').unwrap_or((&text, ""));
        match first.strip_prefix("rank ").and_then(|n| n.parse().ok()) {
            Some(rank) => Ok(Some(FirstCause {
                rank,
                reason: reason.to_string(),
            })),
            None => Err(CauseFileError::Malformed {
                path: path.to_path_buf(),
                first_line: first.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::scratch;
    use super::*;

    #[test]
    fn a_cause_file_reads_back_and_a_foreign_one_is_named() {
        let (_dir, file) = scratch("text");
        let cause = FirstCause {
            rank: 12,
            reason: "line one\nline two\n".into(),
        };
        cause.write_to(&file).unwrap();
        assert_eq!(FirstCause::read_from(&file).unwrap(), Some(cause));
        fs::write(&file, "hello\nworld").unwrap();
        let error = FirstCause::read_from(&file).unwrap_err().to_string();
        assert!(
            error.contains("does not start with a `rank N` line: \"hello\""),
            "{error}"
        );
    }
}
