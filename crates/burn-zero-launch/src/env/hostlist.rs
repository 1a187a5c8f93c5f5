//! Slurm's compressed host lists (`gpu[01-04,07]`, `a[1-2]b[3-4]`, `n1,n[3-4],n7`), expanded to
//! one name per node, in Slurm's order.
//!
//! Written here rather than taken from crates.io: the one crate for it, `hostlist-parser`,
//! returns unique names (a sorted set in its early versions), while a Slurm step pairs its
//! node list with its tasks-per-node list entry by entry, so order and count must come through
//! unchanged; it also brings a parser-combinator library and an error type that borrows the
//! input, for a grammar of a few dozen lines.
//!
//! The grammar, as Slurm writes these lists: hosts are separated by commas (or white space)
//! outside brackets; a host is text and bracket groups in any order; a group holds numbers and
//! `low-high` ranges separated by commas. A range keeps the width of its low bound, so
//! `[08-10]` gives `08 09 10` and `[8-10]` gives `8 9 10`. Several groups in one host expand to
//! every combination, the last group varying fastest (`a[1-2]b[3-4]`: `a1b3 a1b4 a2b3 a2b4`).

/// The most hosts a list may expand to: far above any cluster, low enough that a malformed
/// `node[0-999999999]` fails by name instead of exhausting memory.
pub const MAX_HOSTS: usize = 1 << 20;

/// Digits a bound may have (so that it fits a `u64`).
const MAX_DIGITS: usize = 18;

/// Why a host list does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostListError {
    /// Nothing but separators.
    #[error("the host list is empty")]
    Empty,
    /// Two separators in a row, or one at an end.
    #[error("empty host name at byte {at}")]
    EmptyHost {
        /// Byte offset in the list.
        at: usize,
    },
    /// A `[` without its `]`.
    #[error("'[' at byte {at} is never closed")]
    Unclosed {
        /// Byte offset of the `[`.
        at: usize,
    },
    /// A character that cannot stand where it is (`]` outside a group, `[` inside one,
    /// anything but digits, `-` and `,` in a group).
    #[error("unexpected {found:?} at byte {at}")]
    Unexpected {
        /// The character.
        found: char,
        /// Its byte offset.
        at: usize,
    },
    /// A range that is empty, runs backwards or has a bound too large.
    #[error("bad range {range:?} at byte {at}: {reason}")]
    BadRange {
        /// The range as written.
        range: String,
        /// Its byte offset.
        at: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// More hosts than [`MAX_HOSTS`].
    #[error("the host list expands to more than {MAX_HOSTS} hosts")]
    TooLarge,
}

/// One piece of a host: literal text, or the numbers of a bracket group, already formatted.
enum Piece {
    Text(String),
    Numbers(Vec<String>),
}

/// Expands `list` to its host names, in order. Duplicates are kept: the caller pairs hosts
/// with other per-node lists.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, HostListError> {
    let mut hosts = Vec::new();
    for (at, item) in split_hosts(list)? {
        let pieces = parse_host(item, at)?;
        let count = pieces.iter().try_fold(1usize, |count, piece| match piece {
            Piece::Text(_) => Some(count),
            Piece::Numbers(numbers) => count.checked_mul(numbers.len()),
        });
        match count {
            Some(count) if hosts.len() + count <= MAX_HOSTS => {}
            _ => return Err(HostListError::TooLarge),
        }
        expand_into(&pieces, String::new(), &mut hosts);
    }
    if hosts.is_empty() {
        return Err(HostListError::Empty);
    }
    Ok(hosts)
}

/// Splits at separators outside brackets, with each host's byte offset. White space
/// separates too; a comma with no host before it (or a trailing one) is an empty host.
fn split_hosts(list: &str) -> Result<Vec<(usize, &str)>, HostListError> {
    if list.trim().is_empty() {
        return Err(HostListError::Empty);
    }
    let mut items = Vec::new();
    let mut open: Option<usize> = None;
    let mut start = 0;
    let mut segment_start = 0;
    let mut segment_has_host = false;
    for (at, c) in list.char_indices() {
        match c {
            '[' if open.is_none() => open = Some(at),
            ']' if open.is_some() => open = None,
            '[' | ']' => return Err(HostListError::Unexpected { found: c, at }),
            c if open.is_none() && (c == ',' || c.is_whitespace()) => {
                if start < at {
                    items.push((start, &list[start..at]));
                    segment_has_host = true;
                }
                if c == ',' {
                    if !segment_has_host {
                        return Err(HostListError::EmptyHost { at: segment_start });
                    }
                    segment_has_host = false;
                    segment_start = at + 1;
                }
                start = at + c.len_utf8();
            }
            _ => {}
        }
    }
    if let Some(at) = open {
        return Err(HostListError::Unclosed { at });
    }
    if start < list.len() {
        items.push((start, &list[start..]));
    } else if !segment_has_host {
        return Err(HostListError::EmptyHost { at: segment_start });
    }
    Ok(items)
}

/// Parses one host (no top-level separators in it) into its pieces.
fn parse_host(item: &str, offset: usize) -> Result<Vec<Piece>, HostListError> {
    let mut pieces = Vec::new();
    let mut rest = item;
    let mut at = offset;
    while !rest.is_empty() {
        match rest.find('[') {
            Some(0) => {
                // `split_hosts` saw every `[` closed.
                let close = rest.find(']').unwrap_or(rest.len());
                pieces.push(Piece::Numbers(parse_group(&rest[1..close], at + 1)?));
                at += close + 1;
                rest = &rest[(close + 1).min(rest.len())..];
            }
            Some(open) => {
                pieces.push(Piece::Text(rest[..open].to_string()));
                at += open;
                rest = &rest[open..];
            }
            None => {
                pieces.push(Piece::Text(rest.to_string()));
                rest = "";
            }
        }
    }
    Ok(pieces)
}

/// The numbers of one bracket group (`01-04,07`), formatted with their ranges' widths.
fn parse_group(group: &str, offset: usize) -> Result<Vec<String>, HostListError> {
    let mut numbers = Vec::new();
    let mut at = offset;
    for range in group.split(',') {
        let bad = |reason| HostListError::BadRange {
            range: range.to_string(),
            at,
            reason,
        };
        if range.is_empty() {
            return Err(bad("empty"));
        }
        if let Some((index, found)) = range
            .char_indices()
            .find(|&(_, c)| !(c.is_ascii_digit() || c == '-'))
        {
            return Err(HostListError::Unexpected {
                found,
                at: at + index,
            });
        }
        let (low, high) = range.split_once('-').unwrap_or((range, range));
        if low.is_empty() || high.is_empty() || high.contains('-') {
            return Err(bad("expected a number or low-high"));
        }
        if low.len() > MAX_DIGITS || high.len() > MAX_DIGITS {
            return Err(bad("a bound has too many digits"));
        }
        let (first, last): (u64, u64) = match (low.parse(), high.parse()) {
            (Ok(first), Ok(last)) => (first, last),
            _ => return Err(bad("expected a number or low-high")),
        };
        if last < first {
            return Err(bad("the range runs backwards"));
        }
        if last - first >= (MAX_HOSTS - numbers.len()) as u64 {
            return Err(HostListError::TooLarge);
        }
        let width = low.len();
        numbers.extend((first..=last).map(|n| format!("{n:0width$}")));
        at += range.len() + 1;
    }
    Ok(numbers)
}

/// Appends every combination of `pieces` after `prefix` to `hosts`, the last group varying
/// fastest.
fn expand_into(pieces: &[Piece], prefix: String, hosts: &mut Vec<String>) {
    match pieces.split_first() {
        None => hosts.push(prefix),
        Some((Piece::Text(text), rest)) => expand_into(rest, prefix + text, hosts),
        Some((Piece::Numbers(numbers), rest)) => {
            for number in numbers {
                expand_into(rest, format!("{prefix}{number}"), hosts);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand_hostlist(list).unwrap_or_else(|e| panic!("{list:?}: {e}"))
    }

    fn names(text: &str) -> Vec<String> {
        text.split(' ').map(String::from).collect()
    }

    /// The forms Slurm's documentation uses for node lists.
    #[test]
    fn expands_the_documented_forms() {
        assert_eq!(hosts("tux[0-3,5]"), names("tux0 tux1 tux2 tux3 tux5"));
        assert_eq!(
            hosts("lx[10-20]"),
            (10..=20).map(|n| format!("lx{n}")).collect::<Vec<_>>()
        );
        assert_eq!(
            hosts("gpu[01-04,07]"),
            names("gpu01 gpu02 gpu03 gpu04 gpu07")
        );
        assert_eq!(hosts("a[1-2]b[3-4]"), names("a1b3 a1b4 a2b3 a2b4"));
        assert_eq!(hosts("n1,n[3-4],n7"), names("n1 n3 n4 n7"));
        assert_eq!(hosts("linux[0-1],linux2"), names("linux0 linux1 linux2"));
    }

    #[test]
    fn keeps_the_width_of_the_low_bound() {
        assert_eq!(hosts("n[08-11]"), names("n08 n09 n10 n11"));
        assert_eq!(hosts("n[8-11]"), names("n8 n9 n10 n11"));
        assert_eq!(hosts("n[098-101]"), names("n098 n099 n100 n101"));
        assert_eq!(hosts("n[0007]"), names("n0007"));
    }

    #[test]
    fn text_after_and_between_groups_is_kept() {
        assert_eq!(hosts("node[1-2]-ib"), names("node1-ib node2-ib"));
        assert_eq!(
            hosts("rack[1-2]-node[01-02].cluster"),
            names(
                "rack1-node01.cluster rack1-node02.cluster rack2-node01.cluster rack2-node02.cluster"
            )
        );
        assert_eq!(hosts("[1-2]x"), names("1x 2x"));
        assert_eq!(hosts("127.0.0.[1-2]"), names("127.0.0.1 127.0.0.2"));
    }

    #[test]
    fn plain_names_and_separators() {
        assert_eq!(hosts("node7"), names("node7"));
        assert_eq!(hosts("a, b\tc"), names("a b c"));
        assert_eq!(hosts(" a "), names("a"));
        // Order and duplicates come through as written.
        assert_eq!(hosts("b,a,b"), names("b a b"));
    }

    #[test]
    fn malformed_lists_are_named() {
        let cases: &[(&str, HostListError)] = &[
            ("", HostListError::Empty),
            ("  ", HostListError::Empty),
            ("a,,b", HostListError::EmptyHost { at: 2 }),
            (",a", HostListError::EmptyHost { at: 0 }),
            ("a,", HostListError::EmptyHost { at: 2 }),
            ("n[1-2", HostListError::Unclosed { at: 1 }),
            ("n1-2]", HostListError::Unexpected { found: ']', at: 4 }),
            ("n[1[2]]", HostListError::Unexpected { found: '[', at: 3 }),
            ("n[1,x]", HostListError::Unexpected { found: 'x', at: 4 }),
        ];
        for (list, expected) in cases {
            assert_eq!(expand_hostlist(list).as_ref(), Err(expected), "{list:?}");
        }
        for (list, reason) in [
            ("n[]", "empty"),
            ("n[1,]", "empty"),
            ("n[5-3]", "the range runs backwards"),
            ("n[1-]", "expected a number or low-high"),
            ("n[-1]", "expected a number or low-high"),
            ("n[1-2-3]", "expected a number or low-high"),
            ("n[1234567890123456789]", "a bound has too many digits"),
        ] {
            match expand_hostlist(list) {
                Err(HostListError::BadRange { reason: got, .. }) => {
                    assert_eq!(got, reason, "{list:?}")
                }
                other => panic!("{list:?}: expected a bad range, got {other:?}"),
            }
        }
    }

    #[test]
    fn huge_lists_fail_by_name() {
        assert_eq!(
            expand_hostlist("n[0-999999999]"),
            Err(HostListError::TooLarge)
        );
        assert_eq!(
            expand_hostlist("a[0-9999]b[0-9999]"),
            Err(HostListError::TooLarge)
        );
        assert_eq!(expand_hostlist("n[1-1000],m[1-24]").unwrap().len(), 1024);
    }

    #[test]
    fn errors_say_where() {
        let error = expand_hostlist("gpu[01-04,x]").unwrap_err();
        assert_eq!(error.to_string(), "unexpected 'x' at byte 10");
    }
}
