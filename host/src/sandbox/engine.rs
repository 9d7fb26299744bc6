//! The one wasmtime [`Engine`] of a sandbox and the thread that drives its
//! epoch.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::{
    Config, Enabled, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig,
};

use super::{SandboxConfig, SandboxError};

/// Host stack reserved beyond the guest's wasm stack on each async fiber, for
/// the host frames (imports, WASI, libcalls) that run on it.
const HOST_STACK_MARGIN: usize = 1 << 20;

/// Dirty linear memory per pool slot that is reset with `memcpy` and kept
/// mapped when an instance is dropped, instead of being handed back to the
/// kernel with `madvise`. A typical handler dirties less than this per call,
/// so reusing a slot costs no system call, no TLB shootdown across cores and
/// no page faults on the next call (3x faster calls, see `docs/sandbox.md`).
/// It is also the RSS each used slot keeps, up to a budget for all slots
/// ([`KEEP_RESIDENT_BUDGET`]).
///
/// Only with `PAGEMAP_SCAN` (Linux 6.7+), which finds the dirty pages:
/// without it wasmtime would `memset` the lowest bytes of every memory
/// whether dirty or not, which costs more than it saves. And only where no
/// page of the pool can be swapped out (see [`SlotReset`]).
const MEMORY_KEEP_RESIDENT: usize = 1 << 20;

/// The same for tables (a Rust guest's function table is a few KiB).
const TABLE_KEEP_RESIDENT: usize = 64 << 10;

/// What the pool's linear memories may keep resident between calls, in
/// all, for calls of one memory each (each further memory a component
/// defines may keep as much again; tables have a budget as large of their
/// own), up to [`BUDGET_CALLS`] calls. A slot keeps its last call's dirty
/// pages until its next call, so a worker of many calls would otherwise
/// keep up to [`MEMORY_KEEP_RESIDENT`] for each after a burst: gigabytes
/// that serve no call. Up to 256 calls each gets the whole per-slot
/// figure, 1,024 calls 256 KiB each.
const KEEP_RESIDENT_BUDGET: usize = 256 << 20;

/// Calls past which the budget itself shrinks, as one over the calls:
/// [`KEEP_RESIDENT_BUDGET`] × `BUDGET_CALLS` ÷ calls in all (64 MiB at
/// 4,096 calls, 16 KiB a slot; a page a slot at 8,192; none at 10,000).
/// A worker of thousands of calls is one whose calls wait (`--concurrency
/// 10000`): there every page a finished call keeps adds to what the
/// worker holds, and the calls still running should be all of it
/// (`docs/sandbox.md`, "Calls in flight"). Below it a slot's share stays
/// large enough for calls that write a lot of memory: one that writes
/// 1 MiB costs about 3× as much where its slot keeps only a quarter of it
/// (`docs/sandbox.md`, "Calls that write more than a slot keeps").
const BUDGET_CALLS: u32 = 1_024;

/// What each of `calls` calls' slots keeps resident of `per_call`: all of
/// it while the calls fit in the budget ([`KEEP_RESIDENT_BUDGET`], less
/// past [`BUDGET_CALLS`] calls), else an equal share of the budget in
/// whole pages of `page` bytes (wasmtime rounds a figure up to the host's
/// page; 0: reset with `madvise`, wasmtime's default).
fn keep_resident(calls: u32, per_call: usize, page: usize) -> usize {
    let calls = u64::from(calls.max(1));
    let budget = KEEP_RESIDENT_BUDGET as u64 * u64::from(BUDGET_CALLS).min(calls) / calls;
    let share = usize::try_from(budget / calls).unwrap_or(usize::MAX);
    share.min(per_call) / page * page
}

/// How much of a finished call's fiber stack its slot keeps, zeroed, for
/// the next call, when `calls` calls share the pool: `None` (wasmtime's
/// default: the stack is left as the call left it, every page it dirtied
/// resident) while each slot may keep more than a page of its memory
/// ([`keep_resident`]), else the top page, which every call uses; the
/// rest goes back to the kernel. Zeroing costs a `memset` of that page and
/// an `madvise` per call, paid only where calls are so many that each
/// page they hold counts (a slot's stack holds about 11 KiB once used).
fn stack_keep_resident(calls: u32, page: usize) -> Option<usize> {
    (keep_resident(calls, MEMORY_KEEP_RESIDENT, page) <= page).then_some(page)
}

/// The host's page size; 4 KiB if the system does not say.
fn host_page_size() -> usize {
    // SAFETY: sysconf only reads a setting of the system; nothing is passed
    // by pointer.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&size| size > 0)
        .unwrap_or(4 << 10)
}

/// What wasmtime reserves per linear memory by default on 64-bit hosts: 4
/// GiB, so a wasm32 address never needs a bounds check, and a 32 MiB guard.
const DEFAULT_RESERVATION: u64 = 4 << 30;
const GUARD: u64 = 32 << 20;

/// The address space the pool's linear memories may reserve in all. The
/// pool reserves a slot per memory a call may define (`calls ×
/// memories`) up front; x86-64 gives a process 128 TiB, of which the
/// kernel's overcommit heuristics grant a share. Past this budget the
/// slots shrink (see [`memory_reservation`]).
const MEMORY_ADDRESS_BUDGET: u64 = 48 << 40;

/// The reservation of each linear memory slot for `slots` slots of at most
/// `cap` bytes of memory each: wasmtime's default when they fit in
/// [`MEMORY_ADDRESS_BUDGET`], else an equal share of it (at least `cap`),
/// with which compiled code checks bounds on each memory access instead of
/// relying on guard pages alone: a few percent of a guest's compute, the
/// price of many thousands of calls in flight. `None` keeps the default.
fn memory_reservation(slots: u64, cap: u64) -> Option<u64> {
    let per_slot = MEMORY_ADDRESS_BUDGET / slots.max(1);
    if per_slot >= DEFAULT_RESERVATION + GUARD {
        return None;
    }
    let wasm_page = 64 << 10;
    let share = per_slot.saturating_sub(GUARD) / wasm_page * wasm_page;
    Some(share.max(cap.div_ceil(wasm_page) * wasm_page))
}

/// How the pool resets a slot's linear memory and table when a call's
/// instance is dropped, so that the next call finds nothing of the last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotReset {
    /// The pages the call dirtied are found with the `PAGEMAP_SCAN` ioctl,
    /// restored with `memcpy` and kept resident, up to 1 MiB a slot (past
    /// 256 calls, a share of 256 MiB for all, less past 1,024 calls); the
    /// rest is handed back with `madvise`.
    PagemapScan,
    /// wasmtime's default: the slot is handed back to the kernel with
    /// `madvise`, because the sandbox's configuration asks for it
    /// ([`super::SandboxConfig::madvise_slot_reset`]).
    Madvise,
    /// wasmtime's default: the slot is handed back to the kernel with
    /// `madvise`, about 3× the cost per call (`docs/sandbox.md`), because
    /// the kernel has no `PAGEMAP_SCAN` (before Linux 6.7).
    MadviseNoPagemapScan,
    /// As [`SlotReset::MadviseNoPagemapScan`], because a page of the pool
    /// may be swapped out: a swap area is active and no cgroup v2 of the
    /// process, its own or one above, sets `memory.swap.max` to 0 (read
    /// once, at start). wasmtime 48's scan asks for present pages only, so
    /// a dirtied page the kernel had swapped out would be neither restored
    /// nor handed back, and the next call in the slot, of any handler,
    /// would read it. (wasmtime 48.0.11 scans swapped pages too; this pins
    /// 48.0.8.)
    MadviseSwapOn,
}

impl SlotReset {
    /// The `mode` label of `dtq_sandbox_slot_reset`.
    pub fn as_str(self) -> &'static str {
        match self {
            SlotReset::PagemapScan => "pagemap_scan",
            SlotReset::Madvise => "madvise",
            SlotReset::MadviseNoPagemapScan => "madvise_no_pagemap_scan",
            SlotReset::MadviseSwapOn => "madvise_swap_on",
        }
    }
}

/// Whether a page of this process may be swapped out, as far as the files
/// under `root` (`/`, but for tests) tell: a swap area is active
/// (`proc/swaps`) and no cgroup of the process, from its own up to the
/// root of its cgroup v2 hierarchy, sets `memory.swap.max` to 0. `true`
/// when it cannot tell (no `proc/swaps`, or swap on with cgroup v1).
///
/// Read once, when the engine is built: swap turned on, or the cgroup's
/// limit lifted, while a worker runs is not seen until it restarts.
pub(crate) fn swap_may_hold_pages(root: &Path) -> bool {
    let Ok(swaps) = std::fs::read_to_string(root.join("proc/swaps")) else {
        return true;
    };
    // A header line, then one line per active swap area.
    if swaps.lines().skip(1).all(|line| line.trim().is_empty()) {
        return false;
    }
    let Ok(cgroups) = std::fs::read_to_string(root.join("proc/self/cgroup")) else {
        return true;
    };
    let Some(own) = cgroups.lines().find_map(|line| line.strip_prefix("0::")) else {
        return true;
    };
    let hierarchy = root.join("sys/fs/cgroup");
    let forbids = |cgroup: &Path| {
        std::fs::read_to_string(hierarchy.join(cgroup).join("memory.swap.max"))
            .is_ok_and(|max| max.trim() == "0")
    };
    !Path::new(own.trim().trim_start_matches('/'))
        .ancestors()
        .any(forbids)
}

/// Build the engine: component model, epoch interruption, optional fuel,
/// Cranelift optimising for speed, and a pooling allocator whose slots are
/// sized from the limits and reset as `reset` says ([`slot_reset`]).
pub(crate) fn build(config: &SandboxConfig, reset: SlotReset) -> Result<Engine, SandboxError> {
    let limits = &config.limits;
    let calls = config.max_concurrent_calls.max(1);
    let per_call = |n: usize| -> u32 { u32::try_from(n).unwrap_or(u32::MAX) };

    let mut pool = PoolingAllocationConfig::new();
    pool.total_component_instances(calls)
        .total_core_instances(calls.saturating_mul(per_call(limits.instances)))
        .total_memories(calls.saturating_mul(per_call(limits.memories)))
        .total_tables(calls.saturating_mul(per_call(limits.tables)))
        .total_stacks(calls)
        .max_core_instances_per_component(per_call(limits.instances))
        .max_memories_per_component(per_call(limits.memories))
        .max_tables_per_component(per_call(limits.tables))
        .max_memories_per_module(per_call(limits.memories))
        .max_tables_per_module(per_call(limits.tables))
        .max_memory_size(limits.memory_bytes)
        .table_elements(limits.table_elements);
    let page = host_page_size();
    if reset == SlotReset::PagemapScan {
        pool.pagemap_scan(Enabled::Yes)
            .linear_memory_keep_resident(keep_resident(calls, MEMORY_KEEP_RESIDENT, page))
            .table_keep_resident(keep_resident(calls, TABLE_KEEP_RESIDENT, page));
    }
    let stack_keep = stack_keep_resident(calls, page);
    if let Some(keep) = stack_keep {
        pool.async_stack_keep_resident(keep);
    }

    let mut cfg = Config::new();
    let slots = u64::from(calls).saturating_mul(limits.memories as u64);
    if let Some(reservation) = memory_reservation(slots, limits.memory_bytes as u64) {
        cfg.memory_reservation(reservation).memory_guard_size(GUARD);
    }
    cfg.wasm_component_model(true)
        .epoch_interruption(true)
        .consume_fuel(limits.fuel.is_some())
        .cranelift_opt_level(OptLevel::Speed)
        .max_wasm_stack(limits.stack_bytes)
        .async_stack_size(limits.stack_bytes + HOST_STACK_MARGIN)
        .async_stack_zeroing(stack_keep.is_some())
        .memory_init_cow(true)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));

    Engine::new(&cfg).map_err(|e| SandboxError::Engine(super::outcome::error_chain(&e)))
}

/// How this host's pool slots are reset: with `PAGEMAP_SCAN` where the
/// kernel has it, no page can be swapped out and `madvise` is not
/// `asked` for, else with `madvise`.
pub(crate) fn slot_reset(asked_for_madvise: bool) -> SlotReset {
    if asked_for_madvise {
        SlotReset::Madvise
    } else if !PoolingAllocationConfig::is_pagemap_scan_available() {
        SlotReset::MadviseNoPagemapScan
    } else if swap_may_hold_pages(Path::new("/")) {
        SlotReset::MadviseSwapOn
    } else {
        SlotReset::PagemapScan
    }
}

/// Advances the engine's epoch every tick until dropped.
///
/// Running wasm checks the epoch at function entries and loop back-edges;
/// each tick makes every running store run its epoch callback, which is
/// where deadlines and cancellation are enforced (see `call.rs`).
pub(crate) struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    pub(crate) fn start(engine: Engine, tick: Duration) -> Result<Self, SandboxError> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("dtq-epoch".to_string())
            .spawn({
                let stop = stop.clone();
                move || {
                    while !stop.load(Ordering::Acquire) {
                        std::thread::park_timeout(tick);
                        engine.increment_epoch();
                    }
                }
            })
            .map_err(|e| SandboxError::Engine(format!("cannot start the epoch thread: {e}")))?;
        Ok(EpochTicker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_memory_is_shared_out_past_the_budget() {
        const PAGE: usize = 4 << 10;
        let keep = |calls| keep_resident(calls, MEMORY_KEEP_RESIDENT, PAGE);
        // The sandbox's default of 64 and the benches' 256 keep
        // everything; 1,024 a quarter of it.
        assert_eq!(keep(8), MEMORY_KEEP_RESIDENT);
        assert_eq!(keep(64), MEMORY_KEEP_RESIDENT);
        assert_eq!(keep(256), MEMORY_KEEP_RESIDENT);
        assert_eq!(keep(1_024), 256 << 10);
        assert_eq!(
            keep_resident(0, TABLE_KEEP_RESIDENT, PAGE),
            TABLE_KEEP_RESIDENT
        );
        // Past it, the calls together keep at most the budget, in pages,
        // whatever the page size; past BUDGET_CALLS calls, a budget that
        // falls as they rise.
        for page in [PAGE, 16 << 10, 64 << 10] {
            for calls in [257, 1_000, 1_024, 1_025, 4_096, 10_000, 100_000] {
                let each = keep_resident(calls, MEMORY_KEEP_RESIDENT, page);
                let budget =
                    KEEP_RESIDENT_BUDGET * BUDGET_CALLS.min(calls) as usize / calls as usize;
                assert!(each < MEMORY_KEEP_RESIDENT, "{calls}: {each}");
                assert!(calls as usize * each <= budget, "{calls}: {each}");
                assert_eq!(each % page, 0, "{calls}, page {page}: {each}");
            }
        }
        assert_eq!(keep(2_048), 64 << 10);
        assert_eq!(keep(4_096), 16 << 10);
        assert_eq!(keep(8_192), PAGE);
        // A worker of 10,000 calls keeps no page of a finished call's
        // memory.
        assert_eq!(keep(10_000), 0);
        assert_eq!(keep(u32::MAX), 0);
    }

    #[test]
    fn stacks_are_zeroed_only_where_memory_keeps_a_page_or_less() {
        const PAGE: usize = 4 << 10;
        for calls in [1, 64, 256, 1_000, 4_096] {
            assert_eq!(stack_keep_resident(calls, PAGE), None, "{calls}");
        }
        for calls in [8_192, 10_000, 1_000_000] {
            assert_eq!(stack_keep_resident(calls, PAGE), Some(PAGE), "{calls}");
        }
        // Larger pages reach it sooner: 4,096 calls keep one 16 KiB page of
        // memory.
        assert_eq!(stack_keep_resident(2_048, 16 << 10), None);
        assert_eq!(stack_keep_resident(4_096, 16 << 10), Some(16 << 10));
    }

    /// A file system root holding some files, removed on drop.
    struct Root(std::path::PathBuf);

    impl Root {
        /// A new root holding `files` (path, contents).
        fn with(files: &[(&str, &str)]) -> Root {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let root = Root(
                std::env::temp_dir().join(format!("dtq-engine-test-{}-{n}", std::process::id())),
            );
            for (path, contents) in files {
                let path = root.0.join(path);
                std::fs::create_dir_all(path.parent().expect("a parent")).expect("directories");
                std::fs::write(path, contents).expect("written");
            }
            root
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn swap_is_trusted_off_only_when_no_area_is_active_or_a_cgroup_forbids_it() {
        const HEADER: &str = "Filename\tType\tSize\tUsed\tPriority\n";
        let active = format!("{HEADER}/swapfile\tfile\t1048572\t0\t-2\n");
        let swap = |files: &[(&str, &str)]| swap_may_hold_pages(&Root::with(files).0);
        // No swap area.
        assert!(!swap(&[("proc/swaps", HEADER)]));
        // Nothing to tell by: assume it may.
        assert!(swap(&[]));
        assert!(swap(&[("proc/swaps", &active)]));
        // Active, and the process's cgroup, or one above it, sets no limit.
        let cgroup = ("proc/self/cgroup", "0::/fleet/dtq\n");
        assert!(swap(&[("proc/swaps", &active), cgroup]));
        assert!(swap(&[
            ("proc/swaps", &active),
            cgroup,
            ("sys/fs/cgroup/fleet/dtq/memory.swap.max", "max\n"),
            ("sys/fs/cgroup/fleet/memory.swap.max", "1073741824\n"),
        ]));
        // Active, but a cgroup on the way up forbids it.
        assert!(!swap(&[
            ("proc/swaps", &active),
            cgroup,
            ("sys/fs/cgroup/fleet/dtq/memory.swap.max", "max\n"),
            ("sys/fs/cgroup/fleet/memory.swap.max", "0\n"),
        ]));
        assert!(!swap(&[
            ("proc/swaps", &active),
            ("proc/self/cgroup", "0::/\n"),
            ("sys/fs/cgroup/memory.swap.max", "0\n"),
        ]));
        // cgroup v1 only (no `0::` line): cannot tell.
        assert!(swap(&[
            ("proc/swaps", &active),
            ("proc/self/cgroup", "4:memory:/fleet\n"),
            ("sys/fs/cgroup/fleet/memory.swap.max", "0\n"),
        ]));
    }

    #[test]
    fn the_host_page_size_is_a_power_of_two() {
        let page = host_page_size();
        assert!(page >= 4 << 10 && page.is_power_of_two(), "{page}");
    }

    #[test]
    fn slots_shrink_only_past_the_budget() {
        // 2,000 calls of 4 memories fit at 4 GiB each.
        assert_eq!(memory_reservation(8_000, 64 << 20), None);
        // 10,000 calls do not: each slot gets its share, a whole number of
        // wasm pages, and never less than the memory cap.
        let share = memory_reservation(40_000, 64 << 20).expect("shrunk");
        assert!((64 << 20..DEFAULT_RESERVATION).contains(&share), "{share}");
        assert_eq!(share % (64 << 10), 0);
        assert!(40_000 * (share + GUARD) <= MEMORY_ADDRESS_BUDGET);
        assert_eq!(memory_reservation(u64::MAX, 64 << 20), Some(64 << 20));
    }
}
