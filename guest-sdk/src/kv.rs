//! A namespaced slice of Redis.
//!
//! Every key is a suffix: the host stores it under
//! `dtq:guest:{<namespace>}:<key>`, where the namespace is the handler's (its
//! task name unless [`handler!`](crate::handler!) names one). No key a handler
//! names reaches outside the namespace.
//!
//! Refusals map onto [`Error`] by whether trying again can help:
//! an invalid key, a value larger than the host allows or a task over its
//! host-call limit is fatal; Redis being unavailable, or a key holding a value
//! of the wrong type for the operation, is retryable.
//!
//! ```no_run
//! use dtq_guest::kv;
//!
//! # fn run() -> dtq_guest::Result<()> {
//! let visits = kv::incr("visits")?;
//! kv::set("last-visit", visits.to_string())?;
//! # Ok(()) }
//! ```

use crate::bindings::dtq::handler::kv as wit;
use crate::{Error, Result};

/// Options of [`set_with`].
///
/// ```no_run
/// let options = dtq_guest::kv::SetOptions {
///     only_if_absent: true,
///     expire_seconds: Some(3_600),
/// };
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SetOptions {
    /// Only set the key when it does not exist (Redis `NX`).
    pub only_if_absent: bool,
    /// Expire the key after this many seconds (Redis `EX`).
    pub expire_seconds: Option<u32>,
}

/// The value of `key`, or `None` when it does not exist.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// let name: Option<String> = dtq_guest::kv::get("customer:42:name")?;
/// # let _ = name; Ok(()) }
/// ```
pub fn get(key: impl AsRef<str>) -> Result<Option<String>> {
    wit::get(key.as_ref()).map_err(|e| Error::from_host("kv get", e))
}

/// Set `key` to `value`, replacing any value and removing any TTL.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// dtq_guest::kv::set("customer:42:name", "Ada")?;
/// # Ok(()) }
/// ```
pub fn set(key: impl AsRef<str>, value: impl AsRef<str>) -> Result<()> {
    set_with(key, value, SetOptions::default()).map(|_| ())
}

/// Set `key` to `value` only if `key` does not exist; returns whether it was
/// written.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// if dtq_guest::kv::set_nx("lock:report", "held")? {
///     // this call holds the lock
/// }
/// # Ok(()) }
/// ```
pub fn set_nx(key: impl AsRef<str>, value: impl AsRef<str>) -> Result<bool> {
    let options = SetOptions {
        only_if_absent: true,
        expire_seconds: None,
    };
    set_with(key, value, options)
}

/// Set `key` to `value` with [`SetOptions`]; returns `false` when
/// `only_if_absent` was asked and the key existed, `true` when it was written.
///
/// ```no_run
/// use dtq_guest::kv::{self, SetOptions};
///
/// # fn run() -> dtq_guest::Result<()> {
/// let options = SetOptions { only_if_absent: true, expire_seconds: Some(60) };
/// let written = kv::set_with("lock:report", "held", options)?;
/// # let _ = written; Ok(()) }
/// ```
pub fn set_with(key: impl AsRef<str>, value: impl AsRef<str>, options: SetOptions) -> Result<bool> {
    let options = wit::SetOptions {
        only_if_absent: options.only_if_absent,
        expire_seconds: options.expire_seconds,
    };
    wit::set(key.as_ref(), value.as_ref(), options).map_err(|e| Error::from_host("kv set", e))
}

/// Add 1 to the integer at `key` (a missing key counts as 0); returns the new
/// value.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// let n = dtq_guest::kv::incr("visits")?;
/// # let _ = n; Ok(()) }
/// ```
pub fn incr(key: impl AsRef<str>) -> Result<i64> {
    incr_by(key, 1)
}

/// Add `delta` to the integer at `key` (a missing key counts as 0); returns
/// the new value.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// let stock = dtq_guest::kv::incr_by("stock:sku-7", -3)?;
/// # let _ = stock; Ok(()) }
/// ```
pub fn incr_by(key: impl AsRef<str>, delta: i64) -> Result<i64> {
    wit::incr_by(key.as_ref(), delta).map_err(|e| Error::from_host("kv incr-by", e))
}

/// Delete `key`; returns whether it existed.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// let existed = dtq_guest::kv::del("lock:report")?;
/// # let _ = existed; Ok(()) }
/// ```
pub fn del(key: impl AsRef<str>) -> Result<bool> {
    wit::del(key.as_ref()).map_err(|e| Error::from_host("kv del", e))
}

/// Expire `key` after `seconds`; returns whether the key exists.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// dtq_guest::kv::expire("session:9", 900)?;
/// # Ok(()) }
/// ```
pub fn expire(key: impl AsRef<str>, seconds: u32) -> Result<bool> {
    wit::expire(key.as_ref(), seconds).map_err(|e| Error::from_host("kv expire", e))
}

/// Whether `key` exists.
///
/// ```no_run
/// # fn run() -> dtq_guest::Result<()> {
/// if !dtq_guest::kv::exists("customer:42:name")? {
///     dtq_guest::fatal!("unknown customer 42");
/// }
/// # Ok(()) }
/// ```
pub fn exists(key: impl AsRef<str>) -> Result<bool> {
    wit::exists(key.as_ref()).map_err(|e| Error::from_host("kv exists", e))
}
