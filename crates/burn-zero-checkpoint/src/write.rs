//! Writing files so that a crash never leaves a half-written file under its final name: write
//! to a temporary name, fsync, rename, fsync the directory.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use safetensors::tensor::{Metadata as HeaderMetadata, SafeTensorError};
use safetensors::{Dtype, View};

use crate::error::CheckpointError;
use crate::format::{FileEntry, page_checksums};

/// A tensor to write, whose bytes are produced only when the writer reaches it, so that a rank
/// holds one tensor's bytes at a time.
pub(crate) struct PendingTensor<'a> {
    pub name: String,
    pub dtype: Dtype,
    /// Shape written in the safetensors header.
    pub shape: Vec<usize>,
    /// Bytes the producer returns.
    pub byte_len: usize,
    pub produce: Box<dyn Fn() -> Vec<u8> + 'a>,
}

/// Where written tensors land in the file, with their page checksums.
#[derive(Debug, Clone)]
pub(crate) struct Written {
    pub data_offsets: (usize, usize),
    pub page_crc32: Vec<u32>,
}

#[derive(Default)]
struct Collector {
    data: crc32fast::Hasher,
    pages: BTreeMap<String, Vec<u32>>,
    wrong_length: Option<(String, usize, usize)>,
}

struct LazyView<'a, 'b> {
    tensor: &'b PendingTensor<'a>,
    sink: &'b RefCell<Collector>,
}

impl View for LazyView<'_, '_> {
    fn dtype(&self) -> Dtype {
        self.tensor.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.tensor.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let bytes = (self.tensor.produce)();
        let mut sink = self.sink.borrow_mut();
        if bytes.len() != self.tensor.byte_len && sink.wrong_length.is_none() {
            sink.wrong_length = Some((self.tensor.name.clone(), self.tensor.byte_len, bytes.len()));
        }
        sink.data.update(&bytes);
        sink.pages
            .insert(self.tensor.name.clone(), page_checksums(&bytes));
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.tensor.byte_len
    }
}

fn temporary(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Flushes a directory's entries (the renames into it) to disk.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::io(dir, e))
}

/// Fsyncs the file at `temp` and renames it to `path`.
fn commit(temp: &Path, path: &Path) -> Result<(), CheckpointError> {
    File::open(temp)
        .and_then(|f| f.sync_all())
        .map_err(|e| CheckpointError::io(temp, e))?;
    std::fs::rename(temp, path).map_err(|e| CheckpointError::io(path, e))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let temp = temporary(path);
    let written = File::create(&temp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    if let Err(error) = written {
        std::fs::remove_file(&temp).ok();
        return Err(CheckpointError::io(&temp, error));
    }
    commit(&temp, path)
}

/// Writes `tensors` as the safetensors file `path` (atomically), one tensor's bytes in memory
/// at a time. Returns the file's entry and where each tensor landed.
pub(crate) fn write_safetensors(
    path: &Path,
    rank: usize,
    tensors: &[PendingTensor<'_>],
) -> Result<(FileEntry, BTreeMap<String, Written>), CheckpointError> {
    let temp = temporary(path);
    let sink = RefCell::new(Collector::default());
    let views = tensors.iter().map(|tensor| {
        (
            tensor.name.clone(),
            LazyView {
                tensor,
                sink: &sink,
            },
        )
    });
    if let Err(error) = safetensors::serialize_to_file(views, None, &temp) {
        std::fs::remove_file(&temp).ok();
        return Err(match error {
            SafeTensorError::IoError(io) => CheckpointError::io(&temp, io),
            other => {
                CheckpointError::Unsupported(format!("could not write {}: {other}", temp.display()))
            }
        });
    }
    let sink = sink.into_inner();
    if let Some((name, want, got)) = sink.wrong_length {
        std::fs::remove_file(&temp).ok();
        return Err(CheckpointError::Unsupported(format!(
            "tensor `{name}` produced {got} bytes where its header says {want}"
        )));
    }
    commit(&temp, path)?;
    let (header, bytes) = read_header(path)?;
    let mut written = BTreeMap::new();
    for (name, pages) in sink.pages {
        let info = header
            .info(&name)
            .ok_or_else(|| CheckpointError::Corrupted {
                file: path.to_path_buf(),
                tensor: name.clone(),
                reason: "missing from the header just written".into(),
            })?;
        written.insert(
            name,
            Written {
                data_offsets: info.data_offsets,
                page_crc32: pages,
            },
        );
    }
    let entry = FileEntry {
        rank,
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        bytes,
        data_crc32: sink.data.finalize(),
    };
    Ok((entry, written))
}

/// The safetensors header of the file at `path`, the offset of its data section, and the file's
/// length. Reads the header only.
pub(crate) fn read_header_at(path: &Path) -> Result<(HeaderMetadata, u64, u64), CheckpointError> {
    let mut file = File::open(path).map_err(|e| CheckpointError::io(path, e))?;
    let len = file
        .metadata()
        .map_err(|e| CheckpointError::io(path, e))?
        .len();
    let corrupt = |reason: String| CheckpointError::Corrupted {
        file: path.to_path_buf(),
        tensor: "(safetensors header)".into(),
        reason,
    };
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|e| corrupt(format!("cannot read the header length: {e}")))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 || 8 + n > len {
        return Err(corrupt(format!(
            "header length {n} does not fit a file of {len} bytes"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| corrupt(format!("cannot read the header: {e}")))?;
    let header: HeaderMetadata =
        serde_json::from_slice(&header).map_err(|e| corrupt(format!("bad header: {e}")))?;
    Ok((header, 8 + n, len))
}

fn read_header(path: &Path) -> Result<(HeaderMetadata, u64), CheckpointError> {
    let (header, _, len) = read_header_at(path)?;
    Ok((header, len))
}
