//! Stream entry ids (`<ms>-<seq>`), as the events stream and the
//! submission index name their entries: parsed, printed and ordered as
//! Redis does.

use std::fmt;
use std::str::FromStr;

/// A stream entry id, `<ms>-<seq>`: the `id:` of an event, a
/// `Last-Event-ID`, a listing cursor. Ordered as Redis orders them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct StreamId {
    /// Milliseconds part (Redis's clock when the entry was added).
    pub ms: u64,
    /// Sequence within the millisecond.
    pub seq: u64,
}

/// Text that is not a stream id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a stream id (`<ms>-<seq>` or `<ms>`, decimal)")]
pub struct InvalidStreamId(pub String);

impl FromStr for StreamId {
    type Err = InvalidStreamId;

    /// `<ms>-<seq>`, or `<ms>` (sequence 0); decimal digits only.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || InvalidStreamId(text.chars().take(64).collect());
        let number = |part: &str| decimal(part).ok_or_else(bad);
        let (ms, seq) = match text.split_once('-') {
            Some((ms, seq)) => (number(ms)?, number(seq)?),
            None => (number(text)?, 0),
        };
        Ok(StreamId { ms, seq })
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

impl StreamId {
    /// The id just before this one: reading after it starts at this one.
    pub(super) fn before(self) -> StreamId {
        match (self.ms, self.seq) {
            (ms, 0) if ms > 0 => StreamId {
                ms: ms - 1,
                seq: u64::MAX,
            },
            (ms, seq) => StreamId {
                ms,
                seq: seq.saturating_sub(1),
            },
        }
    }
}

/// `text` as a decimal number: digits only, no sign, no spaces.
pub(super) fn decimal(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_parse_print_and_order_as_redis_does() {
        let id: StreamId = "1700000000000-7".parse().expect("valid");
        assert_eq!(
            id,
            StreamId {
                ms: 1_700_000_000_000,
                seq: 7
            }
        );
        assert_eq!(id.to_string(), "1700000000000-7");
        assert_eq!("5".parse::<StreamId>(), Ok(StreamId { ms: 5, seq: 0 }));
        assert!(StreamId { ms: 1, seq: 9 } < StreamId { ms: 2, seq: 0 });
        assert!(StreamId { ms: 2, seq: 1 } > StreamId { ms: 2, seq: 0 });
        for bad in [
            "",
            "-",
            "1-",
            "-1",
            "a-1",
            "1-b",
            "+1",
            "1 ",
            "1-2-3",
            "$",
            "99999999999999999999999",
        ] {
            assert!(bad.parse::<StreamId>().is_err(), "{bad:?} parsed");
        }
    }
}
