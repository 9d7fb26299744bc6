//! `adversarial`: one command-driven guest that does, on request, what a
//! hostile or broken handler would, so the integration tests can show each
//! host limit both obeyed and violated.
//!
//! The payload names an operation in `op`; anything else in it is that
//! operation's arguments. An unknown `op` (or missing argument) is a fatal
//! error. Payload → result:
//!
//! | payload | does | result |
//! |---|---|---|
//! | `{"op": "ok"}` | nothing | `{"ok": true}` |
//! | `{"op": "fatal", "message": S}` | fails | fatal error `S` |
//! | `{"op": "retry", "message": S}` | fails | retryable error `S` |
//! | `{"op": "panic", "message": S}` | panics with `S` | trap |
//! | `{"op": "loop"}` | spins forever | never returns |
//! | `{"op": "sleep", "ms": N}` | spins N ms on the monotonic clock | `{"slept_ms": N}` |
//! | `{"op": "alloc", "mb": N}` | allocates and touches N MiB | `{"allocated_mb": N}` |
//! | `{"op": "stack"}` | recurses without bound | trap (stack overflow) |
//! | `{"op": "big_result", "bytes": N}` | builds an N-byte string | `{"data": "xx…"}` |
//! | `{"op": "read_file", "path": S}` | `std::fs::read_to_string(S)` | `{"ok": bool, "error"?: S, "len"?: N}` |
//! | `{"op": "env"}` | reads the environment and arguments | `{"vars": [names…], "args": [S…]}` |
//! | `{"op": "tcp", "addr": "127.0.0.1:PORT"}` | `TcpStream::connect` | `{"ok": bool, "error"?: S}` |
//! | `{"op": "dns", "host": S}` | resolves `(S, 80)` | `{"ok": bool, "error"?: S}` |
//! | `{"op": "keys", "keys": [S…], "value": S}` | kv `set` of each key | `{"written": N}` |
//! | `{"op": "static_counter"}` | increments a `static` counter | `{"count": n}` |
//! | `{"op": "log_spam", "bytes": N}` | writes N bytes of log lines | `{"written": N}` |
//! | `{"op": "stdout", "bytes": N}` | prints N bytes to stdout | `{"written": n, "error"?: S}` |
//! | `{"op": "host_calls", "n": N}` | calls kv `exists` N times | `{"calls": N}` |
//! | `{"op": "claim", "key": S}` | `idempotent_operation(S)` around kv incr of `claimed:<S>` | `{"executed": bool}` |
//! | `{"op": "log_fields", "mb": M, "n": N}` | one `log.write` whose N fields all name one M MiB buffer | `{"fields": N}` |
//! | `{"op": "raw_result", "text": S}` | returns S as its result, JSON or not | S |
//! | `{"op": "oob"}` | reads past the end of linear memory | trap |
//!
//! `static_counter` answers 1 on every call when no state survives between
//! calls. `stdout` stops at the first failed write (a host may close a capped
//! stream) and reports how far it got instead of panicking. `host_calls`
//! runs until the host's call limit ends the call (a trap: the guest never
//! sees the refusal).

use std::hint::black_box;
use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dtq_guest::{Context, Error, RawJson, Result, idempotent_operation, kv, log};
use serde::Deserialize;
use serde_json::{Value, json};

/// One MiB.
const MIB: usize = 1 << 20;

/// Bytes per line that `log_spam` and `stdout` write, newline included.
const LINE_BYTES: usize = 100;

/// TTL of the claims `claim` takes.
const CLAIM_TTL_SECONDS: u32 = 86_400;

/// Counts calls into this instance; stays at 1 if every call gets a fresh one.
static CALLS: AtomicU64 = AtomicU64::new(0);

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum Op {
    Ok,
    Fatal { message: String },
    Retry { message: String },
    Panic { message: String },
    Loop,
    Sleep { ms: u64 },
    Alloc { mb: usize },
    Stack,
    BigResult { bytes: usize },
    ReadFile { path: String },
    Env,
    Tcp { addr: String },
    Dns { host: String },
    Keys { keys: Vec<String>, value: String },
    StaticCounter,
    LogSpam { bytes: usize },
    Stdout { bytes: usize },
    HostCalls { n: u64 },
    Claim { key: String },
    LogFields { mb: usize, n: usize },
    RawResult { text: String },
    Oob,
}

fn run(_ctx: Context, op: Op) -> Result<RawJson> {
    match op {
        Op::LogFields { mb, n } => {
            let value = "x".repeat(mb * MIB);
            let fields: Vec<(String, String)> = (0..n)
                .map(|_| {
                    // SAFETY: every alias points at `value`'s buffer, which
                    // outlives them; the list is never dropped (below) and
                    // the host only reads it, so no alias is freed or written.
                    let alias = unsafe {
                        String::from_raw_parts(value.as_ptr().cast_mut(), value.len(), value.len())
                    };
                    (String::new(), alias)
                })
                .collect();
            let fields = std::mem::ManuallyDrop::new(fields);
            dtq_guest::bindings::dtq::handler::log::write(
                dtq_guest::bindings::dtq::handler::log::Level::Info,
                "amplify",
                &fields,
            );
            json_result(json!({"fields": n}))
        }
        Op::RawResult { text } => Ok(RawJson(text)),
        Op::Oob => {
            // SAFETY: none; a read past linear memory traps in wasm, which is
            // what this op is for.
            let byte = unsafe { std::ptr::read_volatile(usize::MAX as *const u8) };
            json_result(json!({"byte": byte}))
        }
        other => run_json(other).and_then(json_result),
    }
}

fn json_result(value: Value) -> Result<RawJson> {
    Ok(RawJson(value.to_string()))
}

fn run_json(op: Op) -> Result<Value> {
    match op {
        Op::Ok => Ok(json!({"ok": true})),
        Op::Fatal { message } => Err(Error::fatal(message)),
        Op::Retry { message } => Err(Error::retryable(message)),
        Op::Panic { message } => panic!("{message}"),
        Op::Loop => spin_forever(),
        Op::Sleep { ms } => {
            spin_for(Duration::from_millis(ms));
            Ok(json!({"slept_ms": ms}))
        }
        Op::Alloc { mb } => {
            let bytes = mb
                .checked_mul(MIB)
                .ok_or_else(|| Error::fatal("mb is too large"))?;
            // Filling with a non-zero byte writes every page, so the memory is
            // really used, not just reserved.
            let block = vec![0xA5u8; bytes];
            black_box(&block);
            Ok(json!({"allocated_mb": mb}))
        }
        Op::Stack => {
            let depth = recurse(0, black_box(u64::MAX));
            Ok(json!({"depth": depth}))
        }
        Op::BigResult { bytes } => Ok(json!({"data": "x".repeat(bytes)})),
        Op::ReadFile { path } => Ok(match std::fs::read_to_string(&path) {
            Ok(text) => json!({"ok": true, "len": text.len()}),
            Err(e) => json!({"ok": false, "error": e.to_string()}),
        }),
        Op::Env => {
            let vars: Vec<String> = std::env::vars_os()
                .map(|(name, _)| name.to_string_lossy().into_owned())
                .collect();
            let args: Vec<String> = std::env::args_os()
                .map(|arg| arg.to_string_lossy().into_owned())
                .collect();
            Ok(json!({"vars": vars, "args": args}))
        }
        Op::Tcp { addr } => Ok(outcome(TcpStream::connect(addr.as_str()).map(drop))),
        Op::Dns { host } => Ok(outcome((host.as_str(), 80).to_socket_addrs().map(drop))),
        Op::Keys { keys, value } => {
            for key in &keys {
                kv::set(key, &value)?;
            }
            Ok(json!({"written": keys.len()}))
        }
        Op::StaticCounter => {
            let count = CALLS.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(json!({"count": count}))
        }
        Op::LogSpam { bytes } => {
            let mut written = 0;
            while written < bytes {
                let line = LINE_BYTES.min(bytes - written);
                log::info("x".repeat(line));
                written += line;
            }
            Ok(json!({"written": written}))
        }
        Op::Stdout { bytes } => {
            let mut stdout = std::io::stdout().lock();
            let mut written = 0;
            while written < bytes {
                let n = LINE_BYTES.min(bytes - written);
                let mut line = "x".repeat(n - 1);
                line.push('\n');
                if let Err(e) = stdout.write_all(line.as_bytes()) {
                    return Ok(json!({"written": written, "error": e.to_string()}));
                }
                written += n;
            }
            if let Err(e) = stdout.flush() {
                return Ok(json!({"written": written, "error": e.to_string()}));
            }
            Ok(json!({"written": written}))
        }
        Op::HostCalls { n } => {
            for _ in 0..n {
                kv::exists("host-calls-probe")?;
            }
            Ok(json!({"calls": n}))
        }
        Op::Claim { key } => {
            let counter = format!("claimed:{key}");
            let (executed, _) =
                idempotent_operation(&key, CLAIM_TTL_SECONDS, || kv::incr(&counter))?;
            Ok(json!({"executed": executed}))
        }
        Op::LogFields { .. } | Op::RawResult { .. } | Op::Oob => {
            Err(Error::fatal("handled in run"))
        }
    }
}

/// `{"ok": true}` or `{"ok": false, "error": ...}`.
fn outcome(result: std::io::Result<()>) -> Value {
    match result {
        Ok(()) => json!({"ok": true}),
        Err(e) => json!({"ok": false, "error": e.to_string()}),
    }
}

/// Spin until interrupted; `black_box` keeps the optimizer from deleting the
/// loop or proving it does nothing.
fn spin_forever() -> ! {
    let mut n = 0u64;
    loop {
        n = black_box(n.wrapping_add(1));
    }
}

/// Busy-wait on the monotonic clock, staying in guest code throughout.
fn spin_for(duration: Duration) {
    let start = Instant::now();
    while start.elapsed() < duration {
        std::hint::spin_loop();
    }
}

/// Recurse until the stack runs out. The result of the recursive call is
/// combined with two different operations, so the call is not in tail
/// position and cannot be turned into a loop; `limit` comes through
/// `black_box`, so the depth is unknown at compile time.
#[inline(never)]
fn recurse(depth: u64, limit: u64) -> u64 {
    if depth == limit {
        return depth;
    }
    recurse(depth + 1, limit)
        .wrapping_add(1)
        .wrapping_mul(depth | 1)
}

dtq_guest::handler!(run);
