//! Copies a rank's output to the supervisor's, one whole line at a time, each line prefixed
//! with the rank (`[rank 3] …`), so the lines of concurrent ranks never interleave mid-line.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::thread::{self, JoinHandle};

/// Where a rank's stream goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    /// The supervisor's standard output.
    Stdout,
    /// The supervisor's standard error.
    Stderr,
}

/// The prefix of every line of `rank`.
pub fn prefix(rank: usize) -> String {
    format!("[rank {rank}] ")
}

/// Copies `source` line by line to `sink` with `prefix` in front of each line, on a thread of
/// its own, until `source` ends. A last line without a newline gets one. Bytes that are not
/// UTF-8 pass through unchanged.
pub fn forward(
    source: impl Read + Send + 'static,
    prefix: String,
    sink: Sink,
) -> io::Result<JoinHandle<()>> {
    thread::Builder::new()
        .name(format!("output {}", prefix.trim()))
        .spawn(move || {
            let mut reader = BufReader::new(source);
            let mut line = Vec::with_capacity(256);
            let mut out = Vec::with_capacity(256);
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                    Err(error) => {
                        tracing::warn!(%error, prefix = prefix.trim(), "could not read a rank's output");
                        break;
                    }
                }
                out.clear();
                out.extend_from_slice(prefix.as_bytes());
                out.extend_from_slice(&line);
                if !line.ends_with(b"\n") {
                    out.push(b'\n');
                }
                // One write per line under the stream's lock keeps lines whole.
                let written = match sink {
                    Sink::Stdout => write_line(io::stdout().lock(), &out),
                    Sink::Stderr => write_line(io::stderr().lock(), &out),
                };
                if written.is_err() {
                    // Our own output is gone (closed pipe): keep draining so the rank never
                    // blocks on a full pipe.
                    continue;
                }
            }
        })
}

fn write_line(mut sink: impl Write, line: &[u8]) -> io::Result<()> {
    sink.write_all(line)?;
    sink.flush()
}
