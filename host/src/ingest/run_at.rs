//! `run_at`: when a submission asks to run, as ms since the Unix epoch or
//! as an RFC 3339 date-time, which chrono reads.

use chrono::DateTime;
use chrono::format::ParseErrorKind;
use serde_json::Value;

/// Read a `run_at`: a whole number of ms since the Unix epoch, or an RFC
/// 3339 date-time string (`2026-12-03T14:00:00Z`,
/// `2026-12-03T15:00:00.250+01:00`; fractions past the millisecond are
/// dropped). A time before the epoch is 0: it is past, so the task runs
/// at once.
pub fn parse_run_at(value: &Value) -> Result<u64, String> {
    match value {
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            format!("run_at must be ms since the Unix epoch (a whole number from 0), got {n}")
        }),
        Value::String(text) => rfc3339_ms(text)
            .map_err(|why| format!("run_at {text:?} is not an RFC 3339 date-time ({why})")),
        _ => Err("run_at must be ms since the Unix epoch or an RFC 3339 string".into()),
    }
}

/// ms since the Unix epoch of an RFC 3339 `date-time`
/// (`YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`; `t`, `z` and a space for `T`
/// accepted as RFC 3339 allows), 0 for a time before the epoch.
///
/// chrono reads it ([`DateTime::parse_from_rfc3339`]), all but one
/// leniency: it takes U+2212 (`−`) for the offset's minus sign, which RFC
/// 3339 does not, so text that is not ASCII is refused first. Second 60 is
/// a leap second, which the epoch's count does not have: it reads as the
/// next second, as chrono counts it.
pub(super) fn rfc3339_ms(text: &str) -> Result<u64, &'static str> {
    if !text.is_ascii() {
        return Err("a digit expected");
    }
    let at = DateTime::parse_from_rfc3339(text).map_err(|e| match e.kind() {
        ParseErrorKind::TooShort => "too short",
        ParseErrorKind::TooLong => "no time zone offset (Z or ±HH:MM) at the end",
        ParseErrorKind::OutOfRange | ParseErrorKind::Impossible => "no such date or time",
        _ => "a digit or a separator is missing",
    })?;
    Ok(u64::try_from(at.timestamp_millis()).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_read_as_ms_since_the_epoch() {
        for (text, want) in [
            ("1970-01-01T00:00:00Z", 0),
            ("1970-01-01T00:00:01.5Z", 1_500),
            ("2000-02-29T12:00:00Z", 951_825_600_000),
            ("2026-12-03T14:00:00.250Z", 1_796_306_400_250),
            ("2026-12-03t15:00:00.250123+01:00", 1_796_306_400_250),
            ("2026-12-03 09:30:00-04:30", 1_796_306_400_000),
            ("1969-12-31T23:59:59Z", 0),
            ("2016-12-31T23:59:60Z", 1_483_228_800_000),
        ] {
            assert_eq!(rfc3339_ms(text), Ok(want), "{text}");
        }
        for bad in [
            "",
            "2026-12-03",
            "2026-12-03T14:00:00",
            "2026-12-03T14:00Z",
            "2026-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-12-03T24:00:00Z",
            "2026-12-03T14:00:00.Z",
            "2026-12-03T14:00:00+0100",
            "2026-12-03T14:00:00Zjunk",
            "２026-12-03T14:00:00Z",
        ] {
            assert!(rfc3339_ms(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn what_the_hand_written_reader_took_chrono_takes_alike() {
        for (text, want) in [
            ("2026-12-03T14:00:00.123456789123Z", 1_796_306_400_123),
            ("2026-12-03T14:00:00-00:00", 1_796_306_400_000),
            ("2026-12-03T14:00:00+23:59", 1_796_220_060_000),
            ("2026-12-03T14:23:60.5Z", 1_796_307_840_500),
            ("0000-01-01T00:00:00Z", 0),
            ("9999-12-31T23:59:59-23:59", 253_402_387_139_000),
        ] {
            assert_eq!(rfc3339_ms(text), Ok(want), "{text}");
        }
        for bad in [
            "2026-12-03T14:00:00+24:00",
            "2026-12-03T14:00:00+01:60",
            "2026-12-03T14:00:00\u{2212}01:00",
            "2026-12-03T14:00:61Z",
            "2026-12-03T14:60:00Z",
            " 2026-12-03T14:00:00Z",
            "2026-12-03T14:00:00Z ",
            "2026-12-03T14:00:00+01",
        ] {
            assert!(rfc3339_ms(bad).is_err(), "{bad:?} accepted");
        }
    }
}
