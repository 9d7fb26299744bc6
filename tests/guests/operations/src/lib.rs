//! `operations`: a command-driven guest for the idempotent operations and
//! the kv staging behind them, so the integration tests can run each case
//! of the claim state machine and each crash point.
//!
//! Payload → result:
//!
//! | payload | does | result |
//! |---|---|---|
//! | `{"op": "run", "key": K, "incr": [S…], "set": [[S, V]…], "spin_ms": N, "then": T, "external": B, "ttl": N}` | `idempotency::operation(K)` whose effect increments each `incr` key, sets each `set` pair, spins N ms, then ends as T: `"ok"` (default), `"fail"` (a retryable error) or `"panic"` | `{"outcome": "executed", "value": [n…]}` (the incremented values), `{"outcome": "done", "value": …}`, `{"outcome": "in_progress"}` or `{"outcome": "abandoned"}` |
//! | `{"op": "seed", "key": K, "incr": S}` | `idempotent_operation(K)` around kv incr of S | `{"executed": bool}` |
//! | `{"op": "reads"}` | inside one operation, reads and writes keys `r:*` and reports what each call saw | `{"seen": {...}}` |
//! | `{"op": "nest"}` | begins an operation inside another | `{"error": S, "fatal": bool}` |
//! | `{"op": "ttl", "seconds": N}` | kv `set` with expiry N, then an operation with TTL N | `{"set": S, "operation": S}`: each error's message, or `"ok"` |
//! | `{"op": "incr", "key": S, "spin_ms": N, "by": D}` | spins N ms, then kv incr of S by D (default 1) outside any operation | `{"value": n}`, or `{"error": S, "refusal": S}` |
//! | `{"op": "get", "key": S, "spin_ms": N}` | spins N ms, then kv get of S | `{"value": S?}`, or `{"error": S, "refusal": S}` |
//! | `{"op": "flood", "kb": N, "max": M, "ttl": T?, "from": I?}` | kv `set` of `f:<i>`, i from I (default 0), to N KiB values (expiring after T s if given) until a write fails or M are written | `{"written": n, "error"?: S, "refusal"?: S}` |
//! | `{"op": "keep", "count": N, "kb": K, "ttl": T?, "from": I?}` | N operations `keep:<i>`, i from I (default 0), with TTL T s (default an hour): each sets kv `kept:<i>` and keeps a result of K KiB, until one fails | `{"kept": n, "error"?: S, "refusal"?: S}` |
//! | `{"op": "fill", "claims": N, "claim_kb": K, "log_kb": L, "result_kb": R, "from": I?}` | every path a handler stores through: `keep` of N results of K KiB, then empty kv values until one is refused (at most 5,000), both numbered from I, then L KiB of log lines, then a result of R KiB | `{"kept": n, "written": n, "result": S}` |
//! | `{"op": "stage", "key": K, "bytes": N}` | an operation on K that sets kv `s:K` to N bytes | `{"outcome": …}` or `{"error": S, "refusal": S}` |
//! | `{"op": "forge", "key": K}` | kv writes, deletes and reads of names that look like claim `K` | `{"seen": [S?…]}` |
//!
//! `spin_ms` busy-waits inside guest code, so a test can interrupt a call,
//! kill its worker or cut Redis off at a known point.

use std::time::{Duration, Instant};

use dtq_guest::idempotency::{self, Operation, Options};
use dtq_guest::{Context, Error, Result, idempotent_operation, kv};
use serde::Deserialize;
use serde_json::{Value, json};

/// TTL of operations that name none.
const TTL_SECONDS: u32 = 3_600;

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Op {
    Run {
        key: String,
        #[serde(default)]
        incr: Vec<String>,
        #[serde(default)]
        set: Vec<(String, String)>,
        #[serde(default)]
        spin_ms: u64,
        #[serde(default)]
        then: Then,
        #[serde(default)]
        external: bool,
        #[serde(default)]
        ttl: Option<u32>,
    },
    Seed {
        key: String,
        incr: String,
    },
    Reads,
    Nest,
    Ttl {
        seconds: u32,
    },
    Incr {
        key: String,
        #[serde(default)]
        spin_ms: u64,
        #[serde(default)]
        by: Option<i64>,
    },
    Get {
        key: String,
        #[serde(default)]
        spin_ms: u64,
    },
    Forge {
        key: String,
    },
    Flood {
        kb: usize,
        max: usize,
        #[serde(default)]
        ttl: Option<u32>,
        #[serde(default)]
        from: usize,
    },
    Keep {
        count: usize,
        kb: usize,
        #[serde(default)]
        ttl: Option<u32>,
        #[serde(default)]
        from: usize,
    },
    Stage {
        key: String,
        bytes: usize,
    },
    Fill {
        claims: usize,
        claim_kb: usize,
        log_kb: usize,
        result_kb: usize,
        #[serde(default)]
        from: usize,
    },
}

#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum Then {
    #[default]
    Ok,
    Fail,
    Panic,
}

fn run(ctx: Context, op: Op) -> Result<Value> {
    match op {
        Op::Run {
            key,
            incr,
            set,
            spin_ms,
            then,
            external,
            ttl,
        } => {
            let mut options = Options::ttl(ttl.unwrap_or(TTL_SECONDS));
            if external {
                options = options.external_effects();
            }
            let outcome = idempotency::operation(&key, options, || {
                let mut values = Vec::new();
                for k in &incr {
                    values.push(kv::incr(k)?);
                }
                for (k, v) in &set {
                    kv::set(k, v)?;
                }
                spin_for(Duration::from_millis(spin_ms));
                match then {
                    Then::Ok => Ok(values),
                    Then::Fail => Err(Error::retryable("the effect failed")),
                    Then::Panic => panic!("the effect panicked"),
                }
            })?;
            Ok(match outcome {
                Operation::Executed(values) => json!({"outcome": "executed", "value": values}),
                Operation::Done(value) => json!({"outcome": "done", "value": value}),
                Operation::InProgress => json!({"outcome": "in_progress"}),
                Operation::Abandoned => json!({"outcome": "abandoned"}),
            })
        }
        Op::Seed { key, incr } => {
            let (executed, _) = idempotent_operation(&key, TTL_SECONDS, || kv::incr(&incr))?;
            Ok(json!({"executed": executed}))
        }
        Op::Reads => {
            let mut seen = serde_json::Map::new();
            idempotent_operation("reads", TTL_SECONDS, || {
                kv::set("r:a", "1")?;
                seen.insert("get_a".into(), json!(kv::get("r:a")?));
                seen.insert("incr_n".into(), json!(kv::incr_by("r:n", 5)?));
                seen.insert("incr_n_again".into(), json!(kv::incr("r:n")?));
                seen.insert("exists_a".into(), json!(kv::exists("r:a")?));
                seen.insert("del_a".into(), json!(kv::del("r:a")?));
                seen.insert("get_a_deleted".into(), json!(kv::get("r:a")?));
                seen.insert("exists_a_deleted".into(), json!(kv::exists("r:a")?));
                seen.insert("set_nx_b".into(), json!(kv::set_nx("r:b", "first")?));
                seen.insert("set_nx_b_again".into(), json!(kv::set_nx("r:b", "second")?));
                seen.insert(
                    "incr_text".into(),
                    json!(kv::incr("r:text").map_err(|e| e.to_string()).err()),
                );
                Ok(())
            })?;
            Ok(json!({"seen": seen}))
        }
        Op::Nest => {
            let inner = idempotent_operation("outer", TTL_SECONDS, || {
                idempotent_operation("inner", TTL_SECONDS, || Ok(1))
            });
            match inner {
                Err(e) => Ok(json!({"error": e.message(), "fatal": e.is_fatal()})),
                Ok(_) => Ok(json!({"error": null})),
            }
        }
        Op::Ttl { seconds } => {
            let options = kv::SetOptions {
                only_if_absent: false,
                expire_seconds: Some(seconds),
            };
            let set = kv::set_with("ttl-probe", "v", options);
            let operation = idempotent_operation("ttl-probe", seconds, || Ok(()));
            let text = |r: Result<()>| r.map_or_else(|e| e.message().to_string(), |()| "ok".into());
            Ok(json!({"set": text(set.map(|_| ())), "operation": text(operation.map(|_| ()))}))
        }
        Op::Incr { key, spin_ms, by } => {
            spin_for(Duration::from_millis(spin_ms));
            Ok(match kv::incr_by(&key, by.unwrap_or(1)) {
                Ok(value) => json!({"value": value}),
                Err(e) => refused(&e),
            })
        }
        Op::Get { key, spin_ms } => {
            spin_for(Duration::from_millis(spin_ms));
            Ok(match kv::get(&key) {
                Ok(value) => json!({"value": value}),
                Err(e) => refused(&e),
            })
        }
        Op::Flood { kb, max, ttl, from } => {
            let value = "x".repeat(kb << 10);
            let options = kv::SetOptions {
                only_if_absent: false,
                expire_seconds: ttl,
            };
            for i in 0..max {
                if let Err(e) = kv::set_with(format!("f:{}", from + i), &value, options) {
                    let mut out = refused(&e);
                    out["written"] = json!(i);
                    return Ok(out);
                }
            }
            Ok(json!({"written": max}))
        }
        Op::Keep {
            count,
            kb,
            ttl,
            from,
        } => {
            let result = "x".repeat(kb << 10);
            let options = Options::ttl(ttl.unwrap_or(TTL_SECONDS));
            for i in 0..count {
                let kept = idempotency::operation(format!("keep:{}", from + i), options, || {
                    kv::set(format!("kept:{}", from + i), "1")?;
                    Ok(result.clone())
                });
                if let Err(e) = kept {
                    let mut out = refused(&e);
                    out["kept"] = json!(i);
                    return Ok(out);
                }
            }
            Ok(json!({"kept": count}))
        }
        Op::Fill {
            claims,
            claim_kb,
            log_kb,
            result_kb,
            from,
        } => {
            let keep = Op::Keep {
                count: claims,
                kb: claim_kb,
                ttl: None,
                from,
            };
            let kept = run(ctx.clone(), keep)?;
            let flood = Op::Flood {
                kb: 0,
                max: 5_000,
                ttl: None,
                from,
            };
            let written = run(ctx, flood)?;
            let line = "l".repeat(1 << 10);
            for _ in 0..log_kb {
                dtq_guest::log::info(&line);
            }
            Ok(json!({
                "kept": kept["kept"],
                "written": written["written"],
                "result": "x".repeat(result_kb << 10),
            }))
        }
        Op::Stage { key, bytes } => {
            let value = "x".repeat(bytes);
            let staged = idempotency::operation(&key, Options::ttl(TTL_SECONDS), || {
                kv::set(format!("s:{key}"), &value)
            });
            Ok(match staged {
                Ok(Operation::Executed(())) => json!({"outcome": "executed"}),
                Ok(other) => json!({"outcome": format!("{other:?}")}),
                Err(e) => refused(&e),
            })
        }
        Op::Forge { key } => {
            let names = [
                format!("idem:{key}"),
                format!("../../dtq:claim:{{operations}}:{key}"),
                format!("}}:{key}"),
                key.clone(),
            ];
            for name in &names {
                kv::set(name, "forged")?;
                kv::del(name)?;
            }
            let seen: Result<Vec<_>> = names.iter().map(kv::get).collect();
            Ok(json!({"seen": seen?, "stored": dtq_guest::stored_result::<Value>(&key)?}))
        }
    }
}

fn refused(e: &Error) -> Value {
    json!({"error": e.message(), "refusal": e.refusal().map(|r| format!("{r:?}"))})
}

/// Busy-wait on the monotonic clock, staying in guest code throughout.
fn spin_for(duration: Duration) {
    let start = Instant::now();
    while start.elapsed() < duration {
        std::hint::spin_loop();
    }
}

dtq_guest::handler!(run);
