//! What a submission's fields must be: its names and key, its numbers
//! against their bounds (the table in the module's documentation), and
//! the run and expiry times computed from them, each addition checked.

use sha2::{Digest, Sha256};

use super::{
    IngestError, IngestSettings, MAX_ATTEMPTS_LIMIT, MAX_DELAY_MS, MAX_EXPIRES_IN_MS,
    MAX_IDEMPOTENCY_KEY_BYTES, MAX_NAME_BYTES, SubmitRequest, invalid,
};
use crate::base::ErrorCode;
use crate::store::MAX_GROUP_BYTES;

/// Check a queue name: 1 to 64 bytes of `[A-Za-z0-9_.-]`. Braces and colons
/// would break the key layout's hash tags.
pub fn validate_queue_name(queue: &str) -> Result<(), IngestError> {
    validate_name(queue)
        .map_err(|why| invalid(ErrorCode::InvalidQueueName, format!("queue name {why}")))
}

/// Check a task name, by the same rule as queue names.
pub fn validate_task_name(task: &str) -> Result<(), IngestError> {
    validate_name(task)
        .map_err(|why| invalid(ErrorCode::InvalidTaskName, format!("task name {why}")))
}

fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "must be 1 to {MAX_NAME_BYTES} bytes, got {}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "_.-".contains(*c)))
    {
        return Err(format!(
            "{name:?} has {c:?}; only letters, digits, '_', '.' and '-' are allowed"
        ));
    }
    Ok(())
}

/// Check an idempotency key: 1 to 255 bytes, no control characters.
pub fn validate_idempotency_key(key: &str) -> Result<(), IngestError> {
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_BYTES {
        return Err(invalid(
            ErrorCode::InvalidIdempotencyKey,
            format!(
                "idempotency key must be 1 to {MAX_IDEMPOTENCY_KEY_BYTES} bytes, got {}",
                key.len()
            ),
        ));
    }
    if key.chars().any(char::is_control) {
        return Err(invalid(
            ErrorCode::InvalidIdempotencyKey,
            "idempotency key has control characters",
        ));
    }
    Ok(())
}

/// Check a submission's `group`: 1 to [`MAX_GROUP_BYTES`] bytes, no
/// control characters.
pub fn validate_group(group: &str) -> Result<(), IngestError> {
    if group.is_empty() || group.len() > MAX_GROUP_BYTES {
        return Err(invalid(
            ErrorCode::InvalidGroup,
            format!(
                "group must be 1 to {MAX_GROUP_BYTES} bytes, got {}",
                group.len()
            ),
        ));
    }
    if group.chars().any(char::is_control) {
        return Err(invalid(
            ErrorCode::InvalidGroup,
            "group has control characters",
        ));
    }
    Ok(())
}

/// The fingerprint of a submission: sha256 over the task name and the
/// payload in canonical form, so the same JSON with its keys in another
/// order is the same submission. `canonical_payload` is the payload `Value`
/// serialized: serde_json's Map is ordered by key (no `preserve_order`), so
/// that text is canonical, and it is the text stored, so it is made once.
pub fn fingerprint(task: &str, canonical_payload: &str) -> String {
    let mut h = Sha256::new();
    h.update(task.as_bytes());
    h.update([0]);
    h.update(canonical_payload.as_bytes());
    hex::encode(h.finalize())
}

/// A submission's numbers, in their bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Numbers {
    pub(super) max_attempts: u32,
    pub(super) timeout_ms: Option<u64>,
    pub(super) start: Start,
    pub(super) expires_in_ms: Option<u64>,
}

/// When a submission asks to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// This many ms after the submission (`delay_ms`; 0 is at once).
    Delay(u64),
    /// At this time, ms since the Unix epoch (`run_at`); at once if past.
    At(u64),
}

/// Check a task's attempt budget and per-attempt deadline against their
/// bounds: a submission's, or a periodic task's, which submits them later.
pub fn check_run_settings(
    settings: &IngestSettings,
    max_attempts: u32,
    timeout_ms: Option<u64>,
) -> Result<(), IngestError> {
    if !(1..=MAX_ATTEMPTS_LIMIT).contains(&max_attempts) {
        return Err(invalid(
            ErrorCode::InvalidMaxAttempts,
            format!("max_attempts must be 1 to {MAX_ATTEMPTS_LIMIT}, got {max_attempts}"),
        ));
    }
    if let Some(t) = timeout_ms
        && !(1..=settings.max_timeout_ms).contains(&t)
    {
        return Err(invalid(
            ErrorCode::InvalidTimeout,
            format!(
                "timeout_ms must be 1 to {}, got {t}",
                settings.max_timeout_ms
            ),
        ));
    }
    Ok(())
}

/// Check every number of `req` against its bound (see the module's table).
pub(super) fn check_numbers(
    settings: &IngestSettings,
    req: &SubmitRequest,
) -> Result<Numbers, IngestError> {
    let max_attempts = req.max_attempts.unwrap_or(settings.default_max_attempts);
    check_run_settings(settings, max_attempts, req.timeout_ms)?;
    if let (Some(_), Some(_)) = (req.run_at, req.delay_ms) {
        return Err(invalid(
            ErrorCode::InvalidRunAt,
            "run_at and delay_ms both say when to run: send one of them",
        ));
    }
    let delay_ms = req.delay_ms.unwrap_or(0);
    if delay_ms > MAX_DELAY_MS {
        return Err(invalid(
            ErrorCode::InvalidDelay,
            format!("delay_ms must be 0 to {MAX_DELAY_MS}, got {delay_ms}"),
        ));
    }
    if let Some(e) = req.expires_in_ms {
        if !(1..=MAX_EXPIRES_IN_MS).contains(&e) {
            return Err(invalid(
                ErrorCode::InvalidExpiry,
                format!("expires_in_ms must be 1 to {MAX_EXPIRES_IN_MS}, got {e}"),
            ));
        }
        if e <= delay_ms {
            return Err(invalid(
                ErrorCode::InvalidExpiry,
                format!(
                    "expires_in_ms ({e}) must be over delay_ms ({delay_ms}): \
                     the task would expire before it may run"
                ),
            ));
        }
    }
    let start = match req.run_at {
        Some(at) => Start::At(at),
        None => Start::Delay(delay_ms),
    };
    Ok(Numbers {
        max_attempts,
        timeout_ms: req.timeout_ms,
        start,
        expires_in_ms: req.expires_in_ms,
    })
}

/// When a task submitted at `now` may run, and when it expires: `now` plus
/// the delay (or the `run_at` asked for, `now` if that is past), and `now`
/// plus the expiry. Each addition is checked; one that overflows is
/// refused with the field's code instead of wrapping around to a time
/// before `now`. A `run_at` more than [`MAX_DELAY_MS`] ahead is refused
/// (`INVALID_RUN_AT`), and so is an expiry that does not come after the run
/// time (`INVALID_EXPIRY`).
pub fn schedule(
    now: u64,
    start: Start,
    expires_in_ms: Option<u64>,
) -> Result<(u64, Option<u64>), IngestError> {
    let run_at = match start {
        Start::Delay(delay_ms) => now.checked_add(delay_ms).ok_or_else(|| {
            invalid(
                ErrorCode::InvalidDelay,
                format!("delay_ms {delay_ms} overflows"),
            )
        })?,
        Start::At(at) if at.saturating_sub(now) > MAX_DELAY_MS => {
            return Err(invalid(
                ErrorCode::InvalidRunAt,
                format!("run_at {at} is more than {MAX_DELAY_MS} ms (30 days) after now ({now})"),
            ));
        }
        Start::At(at) => at.max(now),
    };
    let expires_at = match expires_in_ms {
        None => None,
        Some(ms) => Some(now.checked_add(ms).ok_or_else(|| {
            invalid(
                ErrorCode::InvalidExpiry,
                format!("expires_in_ms {ms} overflows"),
            )
        })?),
    };
    if let Some(at) = expires_at
        && at <= run_at
    {
        return Err(invalid(
            ErrorCode::InvalidExpiry,
            format!(
                "expires_in_ms ends at {at}, not after the run time {run_at}: \
                 the task would expire before it may run"
            ),
        ));
    }
    Ok((run_at, expires_at))
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::base::now_ms;
    use crate::ingest::parse_submit_body;

    #[test]
    fn names_with_hash_tag_or_separator_characters_are_rejected() {
        for bad in ["", "a{b}", "a:b", "a b", "é", &"x".repeat(65)] {
            assert!(validate_queue_name(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["default", "emails-v2", "a.b_c", &"x".repeat(64)] {
            assert!(validate_queue_name(good).is_ok(), "{good:?} rejected");
        }
    }

    #[test]
    fn idempotency_keys_are_bounded() {
        assert!(validate_idempotency_key("").is_err());
        assert!(validate_idempotency_key(&"k".repeat(256)).is_err());
        assert!(validate_idempotency_key(&"k".repeat(255)).is_ok());
        assert!(validate_idempotency_key("a\nb").is_err());
    }

    #[test]
    fn fingerprint_ignores_key_order_but_not_values_or_task() {
        let fp = |task: &str, payload: Value| fingerprint(task, &payload.to_string());
        let a = fp("t", json!({"a": 1, "b": [1, 2]}));
        let b = fp(
            "t",
            serde_json::from_str(r#"{"b":[1,2],"a":1}"#).unwrap_or_default(),
        );
        assert_eq!(a, b);
        assert_ne!(a, fp("t", json!({"a": 2, "b": [1, 2]})));
        assert_ne!(a, fp("u", json!({"a": 1, "b": [1, 2]})));
    }

    fn settings() -> IngestSettings {
        IngestSettings {
            max_payload_bytes: 1 << 20,
            max_queue_depth: 0,
            default_max_attempts: 3,
            max_timeout_ms: 30_000,
        }
    }

    fn request(delay_ms: Option<u64>, expires_in_ms: Option<u64>) -> SubmitRequest {
        SubmitRequest {
            task: "echo".into(),
            payload: Value::Null,
            idempotency_key: None,
            max_attempts: None,
            timeout_ms: None,
            delay_ms,
            expires_in_ms,
            run_at: None,
            group: None,
        }
    }

    pub(in crate::ingest) fn code<T>(r: Result<T, IngestError>) -> &'static str {
        match r {
            Ok(_) => "OK",
            Err(IngestError::Invalid { code, .. }) => code.as_str(),
            Err(_) => "OTHER",
        }
    }

    #[test]
    fn the_overflowing_expiry_of_the_issue_is_refused() {
        let req = request(None, Some(u64::MAX));
        assert_eq!(code(check_numbers(&settings(), &req)), "INVALID_EXPIRY");
        assert_eq!(
            code(schedule(1, Start::Delay(0), Some(u64::MAX))),
            "INVALID_EXPIRY"
        );
        assert_eq!(
            code(schedule(u64::MAX, Start::Delay(1), None)),
            "INVALID_DELAY"
        );
    }

    #[test]
    fn run_at_is_a_number_or_an_rfc3339_string_and_not_with_delay_ms() {
        for (body, want) in [
            (r#"{"task":"t","run_at":1796306400250}"#, "OK"),
            (r#"{"task":"t","run_at":"2026-12-03T14:00:00Z"}"#, "OK"),
            (r#"{"task":"t","run_at":null}"#, "OK"),
            (r#"{"task":"t","run_at":-1}"#, "INVALID_RUN_AT"),
            (r#"{"task":"t","run_at":1.5}"#, "INVALID_RUN_AT"),
            (r#"{"task":"t","run_at":"tomorrow"}"#, "INVALID_RUN_AT"),
            (r#"{"task":"t","run_at":true}"#, "INVALID_RUN_AT"),
        ] {
            assert_eq!(code(parse_submit_body(body.as_bytes())), want, "{body}");
        }
        let req = parse_submit_body(br#"{"task":"t","run_at":"1970-01-01T00:00:02Z"}"#);
        assert_eq!(req.map(|r| r.run_at).ok(), Some(Some(2_000)));
        let mut both = request(Some(10), None);
        both.run_at = Some(1);
        assert_eq!(code(check_numbers(&settings(), &both)), "INVALID_RUN_AT");
        let now = 1_000_000;
        assert_eq!(
            code(schedule(now, Start::At(now + MAX_DELAY_MS), None)),
            "OK"
        );
        assert_eq!(
            code(schedule(now, Start::At(now + MAX_DELAY_MS + 1), None)),
            "INVALID_RUN_AT"
        );
        assert_eq!(
            schedule(now, Start::At(5), Some(1)).ok(),
            Some((now, Some(now + 1)))
        );
        assert_eq!(
            code(schedule(now, Start::At(now + 100), Some(100))),
            "INVALID_EXPIRY"
        );
    }

    /// Numbers near the bounds, and anywhere in `u64`.
    fn number() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![
            0..=MAX_EXPIRES_IN_MS + 10,
            (MAX_DELAY_MS - 5)..=(MAX_DELAY_MS + 5),
            (u64::MAX - 5)..=u64::MAX,
            any::<u64>(),
        ]
    }

    /// A clock now, or anywhere in `u64`, or at its end.
    fn clock() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![
            Just(now_ms()),
            any::<u64>(),
            (u64::MAX - MAX_EXPIRES_IN_MS)..=u64::MAX,
        ]
    }

    proptest::proptest! {
        /// Whatever the clock and the numbers, an accepted submission
        /// neither runs nor expires before it was made, and expires after
        /// it may run; a refused one is refused with its field's code.
        #[test]
        fn accepted_numbers_never_run_or_expire_before_now(
            now in clock(),
            delay in proptest::option::of(number()),
            expires in proptest::option::of(number()),
        ) {
            let req = request(delay, expires);
            match check_numbers(&settings(), &req) {
                Ok(n) => {
                    proptest::prop_assert!(
                        matches!(n.start, Start::Delay(d) if d <= MAX_DELAY_MS)
                    );
                    proptest::prop_assert!(n.expires_in_ms.is_none_or(|e| e <= MAX_EXPIRES_IN_MS));
                    match schedule(now, n.start, n.expires_in_ms) {
                        Ok((run_at, expires_at)) => {
                            proptest::prop_assert!(run_at >= now);
                            if let Some(at) = expires_at {
                                proptest::prop_assert!(at > now && at > run_at);
                            }
                        }
                        // Only a clock within the bounds' reach of u64::MAX.
                        Err(e) => proptest::prop_assert!(
                            now > u64::MAX - MAX_EXPIRES_IN_MS,
                            "{e} at {now}"
                        ),
                    }
                }
                Err(e) => {
                    let c = code(Err::<(), _>(e));
                    proptest::prop_assert!(c == "INVALID_DELAY" || c == "INVALID_EXPIRY", "{c}");
                }
            }
        }

        /// Whatever the clock, the `run_at` and the expiry, an accepted
        /// `run_at` runs at the time asked for, or now if that is past,
        /// never more than the longest delay ahead, and expires after it
        /// runs; a refused one gets `INVALID_RUN_AT` or `INVALID_EXPIRY`.
        #[test]
        fn an_accepted_run_at_runs_when_asked_and_expires_after(
            now in clock(),
            ahead in number(),
            behind in proptest::prop_oneof![proptest::strategy::Just(false), proptest::strategy::Just(true)],
            expires in proptest::option::of(number()),
        ) {
            let at = if behind { now.saturating_sub(ahead) } else { now.saturating_add(ahead) };
            let mut req = request(None, expires);
            req.run_at = Some(at);
            let checked = check_numbers(&settings(), &req)
                .and_then(|n| schedule(now, n.start, n.expires_in_ms));
            match checked {
                Ok((run_at, expires_at)) => {
                    proptest::prop_assert_eq!(run_at, at.max(now));
                    proptest::prop_assert!(run_at - now <= MAX_DELAY_MS);
                    if let Some(e) = expires_at {
                        proptest::prop_assert!(e > run_at);
                    }
                }
                Err(e) => {
                    let c = code(Err::<(), _>(e));
                    proptest::prop_assert!(c == "INVALID_RUN_AT" || c == "INVALID_EXPIRY", "{c}");
                }
            }
        }
    }
}
