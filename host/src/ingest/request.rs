//! A submission as it arrives: the wire types (a single submission's body,
//! a batch's, the `Idempotency-Key` header) and their parse, which tells a
//! bad number or `run_at` from any other mismatch by the field's own code.

use serde::Deserialize;
use serde_json::Value;

use super::run_at::parse_run_at;
use super::{IngestError, MAX_ATTEMPTS_LIMIT, MAX_BATCH_ITEMS, invalid};
use crate::base::ErrorCode;

/// The body of `POST /v1/queues/{queue}/tasks`. Unknown fields are rejected,
/// so a misspelt option (`max_attempt`) is an error instead of being ignored.
#[derive(Debug, Clone, Default, serde::Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitRequest {
    /// The task name: `<task>.wasm` must be deployed.
    pub task: String,
    /// Any JSON value; `null` when absent.
    #[serde(default)]
    pub payload: Value,
    /// The idempotency key (the `Idempotency-Key` header wins over it).
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Attempts before dead-lettering.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Deadline of one attempt, ms.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Run no earlier than this many ms from now.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Expire if not started within this many ms.
    #[serde(default)]
    pub expires_in_ms: Option<u64>,
    /// Run no earlier than this time, ms since the Unix epoch; sent as that
    /// number or as an RFC 3339 string ([`parse_run_at`]). Not with
    /// `delay_ms`.
    #[serde(default, deserialize_with = "run_at_field")]
    #[schema(value_type = Option<RunAt>)]
    pub run_at: Option<u64>,
    /// The group the task belongs to, for the queue's `group_concurrency`
    /// limit (1 to 128 bytes): at most that many tasks of one group run at
    /// once across the fleet.
    #[serde(default)]
    #[schema(min_length = 1, max_length = 128)]
    pub group: Option<String>,
}

/// `run_at` as [`parse_run_at`] reads it; `null` is absent.
fn run_at_field<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(v) => parse_run_at(&v).map(Some).map_err(serde::de::Error::custom),
    }
}

/// The numeric fields of a submission and the code of each one's errors.
const NUMBER_FIELDS: [(&str, ErrorCode); 4] = [
    ("max_attempts", ErrorCode::InvalidMaxAttempts),
    ("timeout_ms", ErrorCode::InvalidTimeout),
    ("delay_ms", ErrorCode::InvalidDelay),
    ("expires_in_ms", ErrorCode::InvalidExpiry),
];

/// Parse the body of `POST /v1/queues/{queue}/tasks`.
///
/// Not JSON: `INVALID_JSON`. Then as [`parse_submit_value`].
pub fn parse_submit_body(body: &[u8]) -> Result<SubmitRequest, IngestError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| invalid(ErrorCode::InvalidJson, format!("request body: {e}")))?;
    parse_submit_value(value)
}

/// Read a submission from its JSON (a body, or an item of a batch).
///
/// A numeric field that is not a whole number from 0 to `u64::MAX`
/// (`u32::MAX` for `max_attempts`): that field's code (see the module's
/// bounds), where a typed parse would only say `INVALID_REQUEST`; a
/// `run_at` that [`parse_run_at`] cannot read: `INVALID_RUN_AT`. Any other
/// mismatch (not an object, no `task`, an unknown field): `INVALID_REQUEST`.
pub fn parse_submit_value(value: Value) -> Result<SubmitRequest, IngestError> {
    if let Value::Object(fields) = &value {
        if let Some(at) = fields.get("run_at").filter(|v| !v.is_null()) {
            parse_run_at(at).map_err(|why| invalid(ErrorCode::InvalidRunAt, why))?;
        }
        for (name, code) in NUMBER_FIELDS {
            let max = if name == "max_attempts" {
                u64::from(u32::MAX)
            } else {
                u64::MAX
            };
            match fields.get(name) {
                None | Some(Value::Null) => {}
                Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n <= max) => {}
                Some(other) => {
                    let got = match other {
                        Value::Number(n) => n.to_string(),
                        Value::String(_) => "a string".into(),
                        Value::Bool(b) => b.to_string(),
                        Value::Array(_) => "an array".into(),
                        Value::Object(_) => "an object".into(),
                        Value::Null => "null".into(),
                    };
                    let message = if other.as_u64().is_some() {
                        // Only max_attempts has a bound under u64::MAX.
                        format!("{name} must be 1 to {MAX_ATTEMPTS_LIMIT}, got {got}")
                    } else {
                        format!("{name} must be a whole number, got {got}")
                    };
                    return Err(invalid(code, message));
                }
            }
        }
    }
    serde_json::from_value(value)
        .map_err(|e| invalid(ErrorCode::InvalidRequest, format!("request body: {e}")))
}

/// `run_at` of a submission: ms since the Unix epoch, or an RFC 3339
/// date-time.
pub struct RunAt;

impl utoipa::PartialSchema for RunAt {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{
            KnownFormat, ObjectBuilder, OneOfBuilder, SchemaFormat, Type,
        };
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
                    .minimum(Some(0)),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))),
            )
            .description(Some(
                "Run no earlier than this time: ms since the Unix epoch, or an RFC 3339 \
                 date-time; a time past runs at once. Not with `delay_ms`.",
            ))
            .into()
    }
}

impl utoipa::ToSchema for RunAt {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("RunAt")
    }
}

/// The body of a batch: the items, each a single submission's body.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// 1 to 1000 submissions, each as `POST /v1/queues/{queue}/tasks`
    /// takes it (its key in `idempotency_key`).
    #[schema(value_type = Vec<SubmitRequest>)]
    tasks: Vec<Value>,
}

/// The items of a batch body, each as [`parse_submit_value`] reads it
/// (one that cannot be read keeps its error). The whole body is refused
/// when there are none to take: `INVALID_JSON`, `INVALID_REQUEST`,
/// `EMPTY_BATCH`, or `BATCH_TOO_LARGE` past [`MAX_BATCH_ITEMS`].
pub fn parse_batch_body(
    body: &[u8],
) -> Result<Vec<Result<SubmitRequest, IngestError>>, IngestError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| invalid(ErrorCode::InvalidJson, format!("request body: {e}")))?;
    let batch: BatchRequest = serde_json::from_value(value).map_err(|e| {
        invalid(
            ErrorCode::InvalidRequest,
            format!("request body: {e}; a batch is {{\"tasks\": [submission, ...]}}"),
        )
    })?;
    match batch.tasks.len() {
        0 => Err(invalid(ErrorCode::EmptyBatch, "the batch has no tasks")),
        n if n > MAX_BATCH_ITEMS => Err(IngestError::BatchTooLarge {
            items: n,
            limit: MAX_BATCH_ITEMS,
        }),
        _ => Ok(batch.tasks.into_iter().map(parse_submit_value).collect()),
    }
}

/// The `Idempotency-Key` header of a single submission, as its route
/// found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyHeader {
    /// Not sent: the body's `idempotency_key`, if any, is the key.
    Absent,
    /// Sent as text; it wins over the body's field.
    Key(String),
    /// Sent, but not visible ASCII: `INVALID_IDEMPOTENCY_KEY`, once the
    /// body has been read.
    NotText,
}

impl KeyHeader {
    /// The key the header gives, if it gives one.
    pub(super) fn key(self) -> Result<Option<String>, IngestError> {
        match self {
            KeyHeader::Absent => Ok(None),
            KeyHeader::Key(key) => Ok(Some(key)),
            KeyHeader::NotText => Err(invalid(
                ErrorCode::InvalidIdempotencyKey,
                "Idempotency-Key header is not visible ASCII",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::validate::tests::code;

    #[test]
    fn numbers_of_the_wrong_kind_get_their_fields_code() {
        for (body, want) in [
            (r#"{"task":"t","max_attempts":-1}"#, "INVALID_MAX_ATTEMPTS"),
            (
                r#"{"task":"t","max_attempts":4294967296}"#,
                "INVALID_MAX_ATTEMPTS",
            ),
            (r#"{"task":"t","timeout_ms":1.5}"#, "INVALID_TIMEOUT"),
            (r#"{"task":"t","delay_ms":"5"}"#, "INVALID_DELAY"),
            (
                r#"{"task":"t","expires_in_ms":18446744073709551616}"#,
                "INVALID_EXPIRY",
            ),
            (r#"{"task":"t","expires_in_ms":1e400}"#, "INVALID_JSON"),
            (r#"{"task":"t","delay_ms":null}"#, "OK"),
            (r#"{"task":"t","colour":1}"#, "INVALID_REQUEST"),
            (r#"{"task":"t""#, "INVALID_JSON"),
        ] {
            assert_eq!(code(parse_submit_body(body.as_bytes())), want, "{body}");
        }
    }

    #[test]
    fn a_batch_is_one_to_a_thousand_items_each_read_alone() {
        let items = |n: usize| {
            let tasks = vec![serde_json::json!({"task": "t"}); n];
            serde_json::json!({ "tasks": tasks }).to_string()
        };
        let codes = |body: &str| match parse_batch_body(body.as_bytes()) {
            Ok(items) => items.into_iter().map(code).collect::<Vec<_>>().join(","),
            Err(IngestError::BatchTooLarge { items, limit }) => {
                format!("TOO_LARGE {items}/{limit}")
            }
            Err(e) => code(Err::<(), _>(e)).to_owned(),
        };
        assert_eq!(codes("{"), "INVALID_JSON");
        assert_eq!(codes(r#"{"tasks": [], "x": 1}"#), "INVALID_REQUEST");
        assert_eq!(codes(r#"{"tasks": []}"#), "EMPTY_BATCH");
        assert_eq!(codes(&items(1001)), "TOO_LARGE 1001/1000");
        assert_eq!(codes(&items(1000)).len(), "OK,".len() * 1000 - 1);
        assert_eq!(
            codes(r#"{"tasks": [{"task": "t"}, {"task": "t", "delay_ms": -1}, 3]}"#),
            "OK,INVALID_DELAY,INVALID_REQUEST"
        );
    }
}
