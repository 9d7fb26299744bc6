//! How payloads are read from JSON text and results written back to it.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{Error, Result};

/// A handler's payload type: built from the task's JSON payload text.
///
/// Every [`DeserializeOwned`] type is one (a JSON parse failure is a fatal
/// error: the same payload would fail again), and so is [`RawJson`], which
/// skips parsing.
///
/// ```
/// use dtq_guest::FromJson;
///
/// #[derive(serde::Deserialize)]
/// struct Order { order_id: String }
///
/// let order = Order::from_json(r#"{"order_id": "A-1"}"#.to_string()).unwrap();
/// assert_eq!(order.order_id, "A-1");
/// ```
pub trait FromJson: Sized {
    /// Build the payload from the JSON text the task was submitted with.
    ///
    /// ```
    /// use dtq_guest::FromJson;
    /// let n = u32::from_json("7".to_string()).unwrap();
    /// assert_eq!(n, 7);
    /// ```
    fn from_json(json: String) -> Result<Self>;
}

/// A handler's result type: written out as the task's JSON result text.
///
/// Every [`Serialize`] type is one (a serialization failure is a fatal
/// error), and so is [`RawJson`], which is passed through as it is.
///
/// ```
/// use dtq_guest::IntoJson;
///
/// let text = serde_json::json!({"ok": true}).into_json().unwrap();
/// assert_eq!(text, r#"{"ok":true}"#);
/// ```
pub trait IntoJson {
    /// The JSON text of the result.
    ///
    /// ```
    /// use dtq_guest::IntoJson;
    /// assert_eq!(42u8.into_json().unwrap(), "42");
    /// ```
    fn into_json(self) -> Result<String>;
}

impl<T: DeserializeOwned> FromJson for T {
    fn from_json(json: String) -> Result<Self> {
        serde_json::from_str(&json).map_err(|err| {
            Error::fatal(format!("payload does not match the handler's type: {err}"))
        })
    }
}

impl<T: Serialize> IntoJson for T {
    fn into_json(self) -> Result<String> {
        serde_json::to_string(&self)
            .map_err(|err| Error::fatal(format!("cannot serialize the handler's result: {err}")))
    }
}

/// JSON text taken or returned as it is, without parsing or serializing.
///
/// As a payload it holds the text the task was submitted with (which the
/// host validated as JSON on submission); as a result its text goes to the
/// host unchanged, so it must be valid JSON. Use it for handlers that route
/// or forward JSON they do not need to look into.
///
/// ```no_run
/// use dtq_guest::{Context, RawJson, Result};
///
/// fn echo(_ctx: Context, payload: RawJson) -> Result<RawJson> {
///     Ok(payload)
/// }
/// dtq_guest::handler!(echo);
/// # fn main() {}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RawJson(pub String);

impl FromJson for RawJson {
    fn from_json(json: String) -> Result<Self> {
        Ok(RawJson(json))
    }
}

impl IntoJson for RawJson {
    fn into_json(self) -> Result<String> {
        Ok(self.0)
    }
}
