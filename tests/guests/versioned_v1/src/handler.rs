// The handler shared by `versioned_v1` and `versioned_v2`, included by
// each after it defines `VERSION`: the two components run the same code and
// differ only in the version they report.

use std::time::Duration;

use dtq_guest::{Context, Result};
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Deserialize)]
struct Payload {
    #[serde(default)]
    sleep_ms: u64,
    #[serde(default)]
    n: Value,
}

fn versioned(_ctx: Context, payload: Payload) -> Result<Value> {
    if payload.sleep_ms > 0 {
        std::thread::sleep(Duration::from_millis(payload.sleep_ms));
    }
    Ok(json!({"version": VERSION, "n": payload.n}))
}

dtq_guest::handler!(versioned);
