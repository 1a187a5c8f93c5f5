//! Reading element ranges of saved tensors: only the byte ranges that overlap what is needed
//! (rounded out to checksum pages, which are verified), through one bounded read buffer.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata as HeaderMetadata;

use crate::error::CheckpointError;
use crate::format::{CHECKSUM_PAGE, Metadata, READ_BUFFER, TensorEntry};
use crate::write::read_header_at;

struct Opened {
    file: File,
    path: PathBuf,
    data_start: u64,
    header: HeaderMetadata,
}

/// The rank files of one checkpoint, opened as needed.
pub(crate) struct RankFiles<'m> {
    dir: PathBuf,
    meta: &'m Metadata,
    open: HashMap<usize, Opened>,
    buffer: Vec<u8>,
    /// Bytes read from disk so far (for the benchmark and tests).
    pub bytes_read: u64,
}

/// Bytes per element of a stored dtype.
pub(crate) fn element_size(dtype: safetensors::Dtype) -> usize {
    dtype.bitsize() / 8
}

impl<'m> RankFiles<'m> {
    pub fn new(dir: &Path, meta: &'m Metadata) -> Self {
        Self {
            dir: dir.to_path_buf(),
            meta,
            open: HashMap::new(),
            buffer: Vec::new(),
            bytes_read: 0,
        }
    }

    fn opened(&mut self, rank: usize) -> Result<&Opened, CheckpointError> {
        if !self.open.contains_key(&rank) {
            let entry = self
                .meta
                .files
                .get(rank)
                .ok_or_else(|| CheckpointError::Format {
                    path: self.dir.join(crate::format::METADATA_FILE),
                    reason: format!("no file entry for rank {rank}"),
                })?;
            let path = self.dir.join(&entry.name);
            let (header, data_start, len) = read_header_at(&path)?;
            if len != entry.bytes {
                // Name the first tensor that does not fit what is left of the file.
                let available = len.saturating_sub(data_start) as usize;
                let tensor = self
                    .meta
                    .tensors
                    .iter()
                    .filter_map(|(name, t)| {
                        t.pieces
                            .iter()
                            .find(|p| p.rank == rank && p.data_offsets.1 > available)
                            .map(|p| (p.data_offsets.0, name))
                    })
                    .min()
                    .map_or_else(|| "(end of file)".to_string(), |(_, n)| n.clone());
                return Err(CheckpointError::Corrupted {
                    file: path,
                    tensor,
                    reason: format!("the file has {len} bytes, {} were written", entry.bytes),
                });
            }
            let file = File::open(&path).map_err(|e| CheckpointError::io(&path, e))?;
            self.open.insert(
                rank,
                Opened {
                    file,
                    path,
                    data_start,
                    header,
                },
            );
        }
        Ok(&self.open[&rank])
    }

    /// Appends elements `[start, end)` of the saved tensor `name` to `out`, in its stored
    /// dtype, reading only the pieces (and pages of them) that overlap.
    pub fn read(
        &mut self,
        name: &str,
        entry: &TensorEntry,
        start: usize,
        end: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CheckpointError> {
        let size = element_size(entry.dtype);
        let mut next = start;
        for piece in &entry.pieces {
            let (p0, p1) = (piece.offset, piece.offset + piece.length);
            let (s, e) = (next.max(p0), end.min(p1));
            if s >= e || s != next {
                continue;
            }
            let piece_bytes = piece.length * size;
            let opened = self.opened(piece.rank)?;
            let corrupt = |reason: String| CheckpointError::Corrupted {
                file: opened.path.clone(),
                tensor: name.to_string(),
                reason,
            };
            match opened.header.info(name) {
                Some(info)
                    if info.data_offsets == piece.data_offsets
                        && info.data_offsets.1 - info.data_offsets.0 == piece_bytes => {}
                _ => {
                    return Err(corrupt(
                        "its entry in the file's header differs from metadata.json".into(),
                    ));
                }
            }
            // Bytes wanted within the piece, rounded out to checksum pages.
            let (want0, want1) = ((s - p0) * size, (e - p0) * size);
            let page0 = want0 / CHECKSUM_PAGE;
            let mut pos = page0 * CHECKSUM_PAGE;
            let stop = want1.div_ceil(CHECKSUM_PAGE) * CHECKSUM_PAGE;
            let stop = stop.min(piece_bytes);
            let file_base = opened.data_start + piece.data_offsets.0 as u64;
            while pos < stop {
                let span = (stop - pos).min(READ_BUFFER);
                self.buffer.resize(span, 0);
                let opened = &self.open[&piece.rank];
                let corrupt = |reason: String| CheckpointError::Corrupted {
                    file: opened.path.clone(),
                    tensor: name.to_string(),
                    reason,
                };
                opened
                    .file
                    .read_exact_at(&mut self.buffer, file_base + pos as u64)
                    .map_err(|e| {
                        corrupt(format!("cannot read bytes {pos}..{}: {e}", pos + span))
                    })?;
                self.bytes_read += span as u64;
                for (i, page) in self.buffer.chunks(CHECKSUM_PAGE).enumerate() {
                    let index = pos / CHECKSUM_PAGE + i;
                    let want = piece.page_crc32.get(index).copied();
                    let got = crc32fast::hash(page);
                    if want != Some(got) {
                        return Err(corrupt(format!(
                            "checksum mismatch in rank {}'s piece, bytes {}..{} (crc32 {got:08x}, \
                             recorded {})",
                            piece.rank,
                            index * CHECKSUM_PAGE,
                            index * CHECKSUM_PAGE + page.len(),
                            want.map_or("nothing".into(), |w| format!("{w:08x}"))
                        )));
                    }
                }
                let (a, b) = (want0.max(pos) - pos, want1.min(pos + span) - pos);
                if a < b {
                    out.extend_from_slice(&self.buffer[a..b]);
                }
                pos += span;
            }
            next = e;
        }
        if next != end {
            return Err(CheckpointError::Format {
                path: self.dir.join(crate::format::METADATA_FILE),
                reason: format!("tensor `{name}` has no piece holding elements {next}..{end}"),
            });
        }
        if self.buffer.capacity() > READ_BUFFER {
            self.buffer = Vec::new();
        }
        Ok(())
    }
}
