//! mimalloc's settings for a process that runs a worker: the `dtq`
//! binary, and the benches that run a worker in their own process (so that
//! they measure what the binary does).
//!
//! Two defaults differ from mimalloc's own on Linux, both for a worker
//! that allocates and frees a little per task on a few threads:
//!
//! - **arenas are committed as they are used** (`arena_eager_commit` 0),
//!   not all at once: an idle worker with one handler loaded keeps 30 MiB
//!   resident instead of 51 (`docs/sandbox.md`);
//! - **no transparent huge pages** (`allow_thp` 0, which mimalloc applies
//!   to the whole process with `PR_SET_THP_DISABLE`): mimalloc asks for
//!   them on its arenas, and each first touch of a 2 MiB region then costs
//!   the kernel zeroing all of it. In the queue bench that was about 2% of
//!   the worker's CPU per task (`docs/queue-bench.md`); the wasm guests'
//!   memories never use huge pages either way.
//!
//! Only the defaults change: `MIMALLOC_ARENA_EAGER_COMMIT=1` and
//! `MIMALLOC_ALLOW_THP=1` still turn either back on.

use libmimalloc_sys::mi_option_t;

/// mimalloc's options by their index in `mi_option_t` (the crate exports
/// no constants for these two).
const ARENA_EAGER_COMMIT: mi_option_t = 4;
const ALLOW_THP: mi_option_t = 43;

/// Set the defaults above. mimalloc reads them when it first reserves
/// memory, so this must run before the first allocation: from an
/// `.init_array` entry, which [`mimalloc_defaults!`](crate::mimalloc_defaults)
/// makes.
#[doc(hidden)]
pub fn set_defaults() {
    for option in [ARENA_EAGER_COMMIT, ALLOW_THP] {
        // SAFETY: sets the default of one option; called before `main`,
        // on the only thread.
        unsafe { libmimalloc_sys::mi_option_set_default(option, 0) };
    }
}

/// Put [`set_defaults`](crate::allocator::set_defaults) in the calling
/// binary's `.init_array` (on Linux), so that it runs before Rust's runtime
/// starts and anything is allocated. For the crate root of a binary whose
/// global allocator is mimalloc.
#[macro_export]
macro_rules! mimalloc_defaults {
    () => {
        #[cfg(target_os = "linux")]
        #[used]
        #[unsafe(link_section = ".init_array")]
        static MIMALLOC_DEFAULTS: extern "C" fn() = {
            extern "C" fn set_defaults() {
                $crate::allocator::set_defaults();
            }
            set_defaults
        };
    };
}
