//! The control connection's messages and their framing.
//!
//! Every message is one frame: `length: u32` (big-endian, of what follows), `tag: u8`, then
//! the fields, integers big-endian, byte strings as `length: u32, bytes`. The connection opens
//! with a hello carrying [`MAGIC`], so a stray client is told apart at once. Both sides bound
//! the hello and every write with the same timeouts ([`HELLO_TIMEOUT`], [`WRITE_TIMEOUT`]).

use std::io::{self, Read, Write};
use std::time::Duration;

use super::error::ControlFailure;
use super::first_cause::FirstCause;

/// How long the store waits for a connected client to say who it is.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a write to one peer may block before that peer is given up.
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Identifies the protocol and its version on the wire. Version 2 added the failure reports
/// ([`ToStore::Report`], [`ToRank::Cause`]): a rank of another version is refused at its hello
/// rather than failing later on a message it cannot read.
pub(crate) const MAGIC: [u8; 4] = *b"BZC2";
/// Upper bound on a frame, so a stray peer cannot make a rank allocate gigabytes.
const MAX_FRAME: usize = 1 << 20;

/// What a rank tells the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToStore {
    Hello {
        rank: usize,
        world_size: usize,
    },
    Check {
        seq: u64,
        fingerprint: Vec<u8>,
    },
    Abort {
        reason: String,
    },
    Leave {
        issued: u64,
    },
    /// The rank failed on its own account and is about to tell the others through a
    /// collective; the job goes on until they stop.
    Report {
        reason: String,
    },
}

/// What the store tells a rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ToRank {
    Welcome,
    Rejected {
        reason: String,
    },
    Passed {
        seq: u64,
    },
    Failed(ControlFailure),
    Left {
        rank: usize,
        issued: u64,
    },
    Shutdown,
    /// The job's first cause of failure: the first rank that reported or aborted (or was
    /// lost, or diverged), with its reason. Sent to every rank when it is recorded, and to a
    /// reporting rank as the answer to its report.
    Cause(FirstCause),
}

struct Writer(Vec<u8>);

impl Writer {
    fn new(tag: u8) -> Self {
        Writer(vec![0, 0, 0, 0, tag])
    }
    fn u8(mut self, value: u8) -> Self {
        self.0.push(value);
        self
    }
    fn u32(mut self, value: usize) -> Self {
        self.0.extend_from_slice(&(value as u32).to_be_bytes());
        self
    }
    fn u64(mut self, value: u64) -> Self {
        self.0.extend_from_slice(&value.to_be_bytes());
        self
    }
    fn bytes(self, value: &[u8]) -> Self {
        let mut this = self.u32(value.len());
        this.0.extend_from_slice(value);
        this
    }
    fn finish(mut self) -> Vec<u8> {
        let length = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&length.to_be_bytes());
        self.0
    }
}

struct Reader<'a>(&'a [u8]);

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> io::Result<&[u8]> {
        if self.0.len() < n {
            return Err(invalid("truncated control message"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> io::Result<usize> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    fn u64(&mut self) -> io::Result<u64> {
        let b = self.take(8)?;
        let mut array = [0u8; 8];
        array.copy_from_slice(b);
        Ok(u64::from_be_bytes(array))
    }
    fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = self.u32()?;
        Ok(self.take(n)?.to_vec())
    }
    fn text(&mut self) -> io::Result<String> {
        Ok(String::from_utf8_lossy(&self.bytes()?).into_owned())
    }
}

impl ToStore {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ToStore::Hello { rank, world_size } => Writer::new(1)
                .bytes(&MAGIC)
                .u32(*rank)
                .u32(*world_size)
                .finish(),
            ToStore::Check { seq, fingerprint } => {
                Writer::new(2).u64(*seq).bytes(fingerprint).finish()
            }
            ToStore::Abort { reason } => Writer::new(3).bytes(reason.as_bytes()).finish(),
            ToStore::Leave { issued } => Writer::new(4).u64(*issued).finish(),
            ToStore::Report { reason } => Writer::new(5).bytes(reason.as_bytes()).finish(),
        }
    }

    fn decode(tag: u8, body: &mut Reader<'_>) -> io::Result<Self> {
        Ok(match tag {
            1 => {
                if body.bytes()? != MAGIC {
                    return Err(invalid("not a burn-zero control client"));
                }
                ToStore::Hello {
                    rank: body.u32()?,
                    world_size: body.u32()?,
                }
            }
            2 => ToStore::Check {
                seq: body.u64()?,
                fingerprint: body.bytes()?,
            },
            3 => ToStore::Abort {
                reason: body.text()?,
            },
            4 => ToStore::Leave {
                issued: body.u64()?,
            },
            5 => ToStore::Report {
                reason: body.text()?,
            },
            _ => return Err(invalid("unknown control message")),
        })
    }

    pub fn read(stream: &mut impl Read) -> io::Result<Self> {
        let (tag, frame) = read_frame(stream)?;
        Self::decode(tag, &mut Reader(&frame))
    }
}

impl ToRank {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ToRank::Welcome => Writer::new(10).finish(),
            ToRank::Rejected { reason } => Writer::new(11).bytes(reason.as_bytes()).finish(),
            ToRank::Passed { seq } => Writer::new(12).u64(*seq).finish(),
            ToRank::Failed(failure) => {
                let writer = Writer::new(13);
                match failure {
                    ControlFailure::Aborted { rank, reason } => {
                        writer.u8(0).u32(*rank).bytes(reason.as_bytes())
                    }
                    ControlFailure::Diverged {
                        seq,
                        rank,
                        fingerprint,
                        other_rank,
                        other_fingerprint,
                    } => writer
                        .u8(1)
                        .u64(*seq)
                        .u32(*rank)
                        .bytes(fingerprint)
                        .u32(*other_rank)
                        .bytes(other_fingerprint),
                    ControlFailure::Lost { rank } => writer.u8(2).u32(*rank),
                    ControlFailure::StoreGone { endpoint } => {
                        writer.u8(3).bytes(endpoint.as_bytes())
                    }
                }
                .finish()
            }
            ToRank::Left { rank, issued } => Writer::new(14).u32(*rank).u64(*issued).finish(),
            ToRank::Shutdown => Writer::new(15).finish(),
            ToRank::Cause(FirstCause { rank, reason }) => {
                Writer::new(16).u32(*rank).bytes(reason.as_bytes()).finish()
            }
        }
    }

    fn decode(tag: u8, body: &mut Reader<'_>) -> io::Result<Self> {
        Ok(match tag {
            10 => ToRank::Welcome,
            11 => ToRank::Rejected {
                reason: body.text()?,
            },
            12 => ToRank::Passed { seq: body.u64()? },
            13 => ToRank::Failed(match body.u8()? {
                0 => ControlFailure::Aborted {
                    rank: body.u32()?,
                    reason: body.text()?,
                },
                1 => ControlFailure::Diverged {
                    seq: body.u64()?,
                    rank: body.u32()?,
                    fingerprint: body.bytes()?,
                    other_rank: body.u32()?,
                    other_fingerprint: body.bytes()?,
                },
                2 => ControlFailure::Lost { rank: body.u32()? },
                3 => ControlFailure::StoreGone {
                    endpoint: body.text()?,
                },
                _ => return Err(invalid("unknown failure kind")),
            }),
            14 => ToRank::Left {
                rank: body.u32()?,
                issued: body.u64()?,
            },
            15 => ToRank::Shutdown,
            16 => ToRank::Cause(FirstCause {
                rank: body.u32()?,
                reason: body.text()?,
            }),
            _ => return Err(invalid("unknown control message")),
        })
    }

    pub fn read(stream: &mut impl Read) -> io::Result<Self> {
        let (tag, frame) = read_frame(stream)?;
        Self::decode(tag, &mut Reader(&frame))
    }
}

/// Reads one frame: its tag and the fields after it.
fn read_frame(stream: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut header = [0u8; 5];
    stream.read_exact(&mut header)?;
    let length = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
    if length == 0 || length > MAX_FRAME {
        return Err(invalid("control frame of an impossible length"));
    }
    let mut body = vec![0u8; length - 1];
    stream.read_exact(&mut body)?;
    Ok((header[4], body))
}

/// Writes one encoded message in a single call (frames are small: one segment).
pub(crate) fn send(stream: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    stream.write_all(frame)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_reads_back_as_written() {
        let to_store = [
            ToStore::Hello {
                rank: 3,
                world_size: 8,
            },
            ToStore::Check {
                seq: 1 << 40,
                fingerprint: vec![1, 2, 3],
            },
            ToStore::Abort {
                reason: "out of memory".into(),
            },
            ToStore::Leave { issued: 17 },
            ToStore::Report {
                reason: "disk full".into(),
            },
        ];
        for message in to_store {
            let frame = message.encode();
            assert_eq!(ToStore::read(&mut frame.as_slice()).unwrap(), message);
        }
        let to_rank = [
            ToRank::Welcome,
            ToRank::Rejected {
                reason: "no".into(),
            },
            ToRank::Passed { seq: 9 },
            ToRank::Failed(ControlFailure::Aborted {
                rank: 1,
                reason: "boom".into(),
            }),
            ToRank::Failed(ControlFailure::Diverged {
                seq: 4,
                rank: 0,
                fingerprint: vec![7],
                other_rank: 1,
                other_fingerprint: vec![8, 9],
            }),
            ToRank::Failed(ControlFailure::Lost { rank: 2 }),
            ToRank::Failed(ControlFailure::StoreGone {
                endpoint: "h:1".into(),
            }),
            ToRank::Left { rank: 1, issued: 5 },
            ToRank::Shutdown,
            ToRank::Cause(FirstCause {
                rank: 3,
                reason: "disk full\nat step 7".into(),
            }),
        ];
        for message in to_rank {
            let frame = message.encode();
            assert_eq!(ToRank::read(&mut frame.as_slice()).unwrap(), message);
        }
    }

    #[test]
    fn garbage_is_refused() {
        let mut http = b"GET / HTTP/1.1\r\n\r\n".as_slice();
        assert!(ToStore::read(&mut http).is_err());
        let bad_magic = Writer::new(1).bytes(b"XXXX").u32(0).u32(2).finish();
        assert!(ToStore::read(&mut bad_magic.as_slice()).is_err());
    }
}
