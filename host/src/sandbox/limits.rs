//! The per-call limits and the [`ResourceLimiter`] that enforces the memory
//! and table caps inside a store.

use std::fmt;
use std::time::Duration;

use wasmtime::ResourceLimiter;

/// Every cap a handler call runs under.
///
/// One value applies to every handler of a [`Sandbox`](super::Sandbox); the
/// defaults are sized for JSON-in, JSON-out task handlers. Each field says
/// what it stops. Exceeding a cap never harms the host or other calls: the
/// call ends with [`Trap::LimitExceeded`](super::Trap::LimitExceeded) (or the
/// specific trap named below), and the next call starts from a fresh
/// instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock time one call may take, instantiation included. Default
    /// 30 s.
    ///
    /// Stops a handler that loops forever or waits forever on a host import.
    /// Enforced twice: by epoch interruption inside running wasm (the epoch
    /// ticker advances every [`SandboxConfig::epoch_tick`](super::SandboxConfig::epoch_tick),
    /// so a loop is stopped within about one tick of the deadline) and by a
    /// timer around the whole call, which also interrupts a guest suspended
    /// in an async host import. A task may ask for less
    /// ([`Call::deadline`](super::Call::deadline)), never for more.
    pub deadline: Duration,

    /// Linear memory one instance may hold, summed over all its memories.
    /// Default 64 MiB.
    ///
    /// Stops a guest from exhausting host memory (an allocation bomb). Growth
    /// past the cap is refused by a [`ResourceLimiter`] with an error of our
    /// own, so the call ends with [`Trap::OutOfMemory`](super::Trap::OutOfMemory)
    /// instead of the guest allocator's confusing `unreachable`. It also sizes
    /// every slot of the pooling allocator.
    pub memory_bytes: usize,

    /// Elements one table may hold. Default 20 000.
    ///
    /// Stops unbounded `table.grow`; also sizes the pool's table slots.
    pub table_elements: usize,

    /// Core module instances one component may create. Default 32.
    ///
    /// Checked when a module is loaded (the pooling allocator rejects a
    /// component that needs more) and again when it is instantiated.
    pub instances: usize,

    /// Linear memories one component may define. Default 4.
    pub memories: usize,

    /// Tables one component may define. Default 8.
    pub tables: usize,

    /// Native stack the guest's wasm frames may use. Default 512 KiB.
    ///
    /// Stops unbounded recursion from overflowing the host thread's stack;
    /// the call ends with [`Trap::StackOverflow`](super::Trap::StackOverflow).
    pub stack_bytes: usize,

    /// Fuel (roughly: wasm instructions) one call may burn. Default `None`:
    /// no fuel metering.
    ///
    /// The deadline already stops runaway loops and costs almost nothing;
    /// fuel instruments every block of guest code (up to 2-3x slower) but
    /// gives a *deterministic* bound: the same call with the same input
    /// always stops at the same point. Use it only when that matters.
    /// Changing it changes the engine configuration, so cached artifacts of
    /// the other setting are rejected and rebuilt.
    pub fuel: Option<u64>,

    /// Bytes of the JSON payload handed to the guest. Default 1 MiB.
    ///
    /// Checked before anything is instantiated; a bigger payload is never
    /// copied into a guest.
    pub max_payload_bytes: usize,

    /// Bytes of the `ok` result a guest may return. Default 1 MiB.
    ///
    /// Stops a guest from filling the task record in Redis. Error messages
    /// of `retryable` and `fatal` are truncated to this size instead.
    pub max_result_bytes: usize,

    /// Bytes of task log kept per call: `log` import lines plus everything
    /// written to stdout and stderr. Default 64 KiB.
    ///
    /// Stops log flooding. Output past the cap is dropped and a marker line
    /// says how much; it is not a failure.
    pub max_log_bytes: usize,

    /// Host import calls (kv, idempotency, log) one call may make. Default
    /// 10 000.
    ///
    /// Stops a guest from turning the worker into a Redis load generator.
    /// The call past the cap traps: [`Limit::HostCalls`].
    pub max_host_calls: u64,

    /// Bytes of a key a guest names. Default 512.
    ///
    /// A longer or empty key gets the WIT error `invalid-key`.
    pub max_key_bytes: usize,

    /// Bytes of a value a guest stores. Default 1 MiB.
    ///
    /// Stops a guest from filling Redis; a bigger value gets the WIT error
    /// `value-too-large`.
    pub max_value_bytes: usize,

    /// Longest TTL a guest may set on a kv key or an idempotency claim, in
    /// seconds. Default 30 days.
    ///
    /// Stops keys a guest means to expire from staying for decades; a TTL
    /// of 0 or past this gets the WIT error `invalid-argument`.
    pub max_ttl_seconds: u32,

    /// Bytes of kv writes one idempotent operation may stage (keys and
    /// values). Default 1 MiB.
    ///
    /// Staged writes are held in host memory until the operation commits;
    /// past this a write gets the WIT error `value-too-large`.
    pub max_operation_bytes: usize,

    /// How long the owner of a running idempotency claim counts as alive
    /// without renewing it. Default 5 s.
    ///
    /// A call renews its claim's lease every fifth of this while it runs,
    /// so a worker that dies mid-operation frees the key for the next
    /// caller within about this long. A live owner cut off from Redis for
    /// longer may lose the claim; its commit is then refused, so kv effects
    /// still apply once.
    pub claim_lease: Duration,

    /// Bytes a guest may hand the host at once: one import call's arguments,
    /// or the result `handle` returns (strings and lists the host copies out
    /// of linear memory). Default 4 MiB.
    ///
    /// Linear memory is capped, but one call can name the same buffer many
    /// times (a 1 MiB string as a thousand log fields); this bounds the host
    /// memory one transfer takes, before any of it is built. Past it the call
    /// traps: [`Limit::HostCallData`]. It is wasmtime's "hostcall fuel", and
    /// must stay above [`Limits::max_value_bytes`] and
    /// [`Limits::max_result_bytes`] for those limits to answer first.
    pub max_hostcall_bytes: usize,

    /// Bytes one namespace's kv keys and idempotency claims may be charged
    /// in Redis: names, values and kept results, plus a fixed overhead per
    /// key ([`KEY_OVERHEAD_BYTES`](super::KEY_OVERHEAD_BYTES)) and per claim
    /// ([`CLAIM_OVERHEAD_BYTES`](super::CLAIM_OVERHEAD_BYTES)) for what
    /// Redis holds beside them. Default 256 MiB; 0: no budget. The
    /// operator may set another per handler
    /// ([`HandlerSettings::kv_quota_bytes`](super::HandlerSettings::kv_quota_bytes)).
    ///
    /// Stops one tenant from filling Redis, which with a `maxmemory` would
    /// stop every queue. A kv write, a `begin` or a `commit` past it gets
    /// the WIT error `quota-exceeded` and writes nothing.
    pub kv_quota_bytes: u64,

    /// Idempotency claims one namespace may hold at once (those whose TTL
    /// has not ended). Default 100 000.
    ///
    /// Bounds the claims of a namespace whatever its byte budget (with none,
    /// too); a `begin` that would open one more gets the WIT error
    /// `quota-exceeded`, naming the claims, and writes nothing.
    pub max_live_claims: u64,

    /// Longest an outbound HTTP request may take, response body included;
    /// the call's remaining deadline caps it too. Default 10 s.
    ///
    /// Stops a slow service from holding a call (and its pool slot) for the
    /// whole deadline without the handler being able to react.
    pub http_timeout: Duration,

    /// Bytes of an outbound HTTP response body. Default 4 MiB.
    ///
    /// Stops a response from filling host memory; past it the body read
    /// fails with `HTTP-response-body-size`.
    pub max_http_response_bytes: usize,

    /// Outbound HTTP requests one call may send (they count as host calls
    /// too). Default 100.
    ///
    /// Stops a guest from turning the worker into a request flood; past it
    /// a request fails with `connection-limit-reached`.
    pub max_http_requests: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            deadline: Duration::from_secs(30),
            memory_bytes: 64 << 20,
            table_elements: 20_000,
            instances: 32,
            memories: 4,
            tables: 8,
            stack_bytes: 512 << 10,
            fuel: None,
            max_payload_bytes: 1 << 20,
            max_result_bytes: 1 << 20,
            max_log_bytes: 64 << 10,
            max_host_calls: 10_000,
            max_key_bytes: 512,
            max_value_bytes: 1 << 20,
            max_ttl_seconds: 30 * 86_400,
            max_operation_bytes: 1 << 20,
            claim_lease: Duration::from_secs(5),
            max_hostcall_bytes: 4 << 20,
            kv_quota_bytes: 256 << 20,
            max_live_claims: 100_000,
            http_timeout: Duration::from_secs(10),
            max_http_response_bytes: 4 << 20,
            max_http_requests: 100,
        }
    }
}

/// Which limit a call exceeded; carried by
/// [`Trap::LimitExceeded`](super::Trap::LimitExceeded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// The payload was larger than [`Limits::max_payload_bytes`].
    Payload,
    /// The `ok` result was larger than [`Limits::max_result_bytes`].
    Result,
    /// More host imports were called than [`Limits::max_host_calls`].
    HostCalls,
    /// One import call's arguments, or the result, were more than
    /// [`Limits::max_hostcall_bytes`].
    HostCallData,
    /// The call burnt all of [`Limits::fuel`].
    Fuel,
    /// A table grew past [`Limits::table_elements`].
    TableElements,
    /// Every slot of the instance pool was busy (more concurrent calls than
    /// [`SandboxConfig::max_concurrent_calls`](super::SandboxConfig::max_concurrent_calls)).
    Concurrency,
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::Payload => "payload size",
            Limit::Result => "result size",
            Limit::HostCalls => "host calls",
            Limit::HostCallData => "host-call data",
            Limit::Fuel => "fuel",
            Limit::TableElements => "table elements",
            Limit::Concurrency => "concurrent calls",
        })
    }
}

/// The error a host-side check traps a guest with when it crosses a limit.
///
/// Raised inside wasmtime (limiter, host imports) and recovered by downcast
/// when the call's error is classified, so a limit is never confused with a
/// guest bug.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LimitTrap {
    /// Linear memory growth past [`Limits::memory_bytes`].
    #[error("linear memory limit of {limit} bytes exceeded (asked for {desired} bytes)")]
    Memory { limit: usize, desired: usize },
    /// Any other limit.
    #[error("{0} limit exceeded")]
    Exceeded(Limit),
}

/// Enforces [`Limits::memory_bytes`], [`Limits::table_elements`] and the
/// per-component counts inside one store.
#[derive(Debug)]
pub(crate) struct StoreLimiter {
    memory_limit: usize,
    memory_used: usize,
    table_elements: usize,
    instances: usize,
    memories: usize,
    tables: usize,
}

impl StoreLimiter {
    pub(crate) fn new(limits: &Limits) -> Self {
        StoreLimiter {
            memory_limit: limits.memory_bytes,
            memory_used: 0,
            table_elements: limits.table_elements,
            instances: limits.instances,
            memories: limits.memories,
            tables: limits.tables,
        }
    }
}

impl ResourceLimiter for StoreLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // Accounted over all memories of the store: a component with several
        // memories shares one budget.
        let total = self
            .memory_used
            .saturating_sub(current)
            .saturating_add(desired);
        if total > self.memory_limit {
            // An error, not `Ok(false)`: `memory.grow` returning -1 makes a
            // Rust guest abort with `unreachable`, which would read as a
            // guest panic. Trapping with our own error names the cause.
            return Err(wasmtime::Error::new(LimitTrap::Memory {
                limit: self.memory_limit,
                desired: total,
            }));
        }
        self.memory_used = total;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.table_elements {
            return Err(wasmtime::Error::new(LimitTrap::Exceeded(
                Limit::TableElements,
            )));
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        self.instances
    }

    fn memories(&self) -> usize {
        self.memories
    }

    fn tables(&self) -> usize {
        self.tables
    }
}
