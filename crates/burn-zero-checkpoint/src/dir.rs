//! A checkpoint root: its `step-*` directories, which of them are complete (committed by their
//! `metadata.json`), the latest one, and keep-last-K rotation.

use std::path::{Path, PathBuf};

use crate::error::CheckpointError;
use crate::format::{FORMAT, FORMAT_VERSION, METADATA_FILE, Metadata};

/// One `step-*` directory under a checkpoint root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointDir {
    /// The step in its name.
    pub step: u64,
    /// Its path.
    pub path: PathBuf,
    /// Whether its save finished (its `metadata.json` exists). An incomplete one is what a
    /// save killed midway leaves; it is never loaded.
    pub complete: bool,
}

/// Every `step-*` directory under `root`, by step.
pub fn list(root: &Path) -> Result<Vec<CheckpointDir>, CheckpointError> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io(root, e)),
    };
    let mut dirs = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| CheckpointError::io(root, e))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let path = entry.path();
        if !path.is_dir() {
            continue;
        }
        let complete = path.join(METADATA_FILE).is_file();
        dirs.push(CheckpointDir {
            step,
            path,
            complete,
        });
    }
    dirs.sort_by_key(|d| d.step);
    Ok(dirs)
}

/// The latest complete checkpoint under `root`, if any.
pub fn latest(root: &Path) -> Result<Option<CheckpointDir>, CheckpointError> {
    Ok(list(root)?.into_iter().rev().find(|d| d.complete))
}

/// The checkpoint `path` names: a checkpoint directory itself, or the latest complete one
/// under a root.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(METADATA_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some(latest) = latest(path)? {
        return Ok(latest.path);
    }
    let is_step_dir = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("step-"));
    if is_step_dir && path.is_dir() {
        return Err(CheckpointError::Incomplete(path.to_path_buf()));
    }
    Err(CheckpointError::NotFound(path.to_path_buf()))
}

/// Reads and checks the `metadata.json` of the checkpoint directory `dir`.
pub fn read_metadata(dir: &Path) -> Result<Metadata, CheckpointError> {
    let path = dir.join(METADATA_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && dir.is_dir() => {
            return Err(CheckpointError::Incomplete(dir.to_path_buf()));
        }
        Err(e) => return Err(CheckpointError::io(&path, e)),
    };
    let meta: Metadata = serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Format {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    if meta.format != FORMAT || meta.version != FORMAT_VERSION {
        return Err(CheckpointError::Format {
            path,
            reason: format!(
                "format `{}` version {}; this build reads `{FORMAT}` version {FORMAT_VERSION}",
                meta.format, meta.version
            ),
        });
    }
    Ok(meta)
}

/// Deletes all but the last `keep` complete checkpoints, and incomplete ones older than the
/// latest complete one (left by saves that were killed). `keep == 0` keeps everything.
pub(crate) fn rotate(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    if keep == 0 {
        return Ok(());
    }
    let dirs = list(root)?;
    let complete: Vec<&CheckpointDir> = dirs.iter().filter(|d| d.complete).collect();
    let Some(newest) = complete.last().map(|d| d.step) else {
        return Ok(());
    };
    let kept_from = complete
        .len()
        .checked_sub(keep)
        .map_or(0, |i| complete[i].step);
    for dir in &dirs {
        let stale = if dir.complete {
            dir.step < kept_from
        } else {
            dir.step < newest
        };
        if stale {
            tracing::debug!(path = %dir.path.display(), "removing old checkpoint");
            // The commit marker goes first, so that a crash mid-removal leaves an incomplete
            // directory, never a complete-looking one with files missing.
            if dir.complete {
                std::fs::remove_file(dir.path.join(METADATA_FILE))
                    .map_err(|e| CheckpointError::io(&dir.path, e))?;
            }
            std::fs::remove_dir_all(&dir.path).map_err(|e| CheckpointError::io(&dir.path, e))?;
        }
    }
    Ok(())
}
