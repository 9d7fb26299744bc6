//! dtq: a distributed task queue on Redis whose handlers run as WebAssembly
//! components.
//!
//! Handler authors build a function against the `dtq:handler` WIT contract to
//! `wasm32-wasip2`; a fleet of `dtq` processes accepts submissions over HTTP
//! and runs each task in a fresh, resource-limited wasmtime sandbox. The host
//! does everything that must be trusted: submission idempotency, retries with
//! backoff, dead-lettering, cancel, expiry, and the ordered completion writes
//! before the ACK.
//!
//! # Layout
//!
//! `docs/architecture.md` walks one task through these rooms and states
//! which may use which (a test holds the code to it).
//!
//! - [`base`]: the clock, the API's error codes and the ids dtq makes;
//!   it imports nothing of the crate, and every room may use it.
//! - [`config`]: the configuration (flags and `DTQ_*` variables), one part
//!   per room, composed into one command line.
//! - [`store`]: the Redis key layout, the Lua scripts, and typed calls.
//! - [`ingest`]: the submission path: validation, fingerprint, one script.
//! - [`api`]: the HTTP API (axum on hyper): routes, the error body, tokens
//!   and scopes, connection and request limits.
//! - [`worker`]: fetch loop, executor, completion, reclaim, delayed mover,
//!   expiry sweep, scheduler of periodic tasks, cancel listener.
//! - [`sandbox`]: the wasmtime engine, module cache, per-call store and
//!   limits, and the host imports a handler can reach.
//! - [`deploy`]: the handler registry in Redis (modules by digest, active
//!   versions with operator settings, history, rollback) and the hot reload
//!   that keeps every process in step with it.
//! - [`metrics`]: the process's Prometheus registry (attempt outcomes and
//!   durations, traps, in-flight tasks, Redis latency, queue depths), served
//!   at `/metrics`.
//! - [`server`]: the one composition of a server process (store, handlers,
//!   worker, API, shutdown) and its typed errors with their exit codes,
//!   used by the `dtq` binary and the test harness alike.
//! - [`allocator`]: mimalloc's settings for the processes that run a
//!   worker.
//! - [`client`]: dtq's Rust client: typed calls to the HTTP API, a
//!   task's wait and a queue's live events (what the `dtq` command uses).
//! - [`telemetry`]: OpenTelemetry, off by default: spans over OTLP/HTTP
//!   and the W3C trace context from a submission to its attempts.

pub mod allocator;
pub mod api;
#[cfg(test)]
mod architecture;
pub mod base;
pub mod client;
pub mod config;
pub mod deploy;
pub mod ingest;
pub mod metrics;
pub mod sandbox;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod worker;

pub use config::Config;
