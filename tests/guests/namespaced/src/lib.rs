//! `namespaced`: a handler that names its kv namespace, `shared-ns`, instead
//! of taking its task name, so tests can check that the host reads the
//! `dtq-namespace` custom section.
//!
//! Payload → result:
//!
//! ```text
//! {"key": "k", "value": "v"}   →   {"ok": true}
//! ```
//!
//! It sets kv key `key` to `value`, which the host stores at
//! `dtq:guest:{shared-ns}:<key>` when the operator grants it that namespace
//! (`--namespace TASK=shared-ns`); without the grant the host refuses to load it.

use dtq_guest::{Context, Result, kv};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Payload {
    key: String,
    value: String,
}

fn set(_ctx: Context, payload: Payload) -> Result<Value> {
    kv::set(&payload.key, &payload.value)?;
    Ok(json!({"ok": true}))
}

dtq_guest::handler!(set, namespace = "shared-ns");
