//! A namespace's Redis budget: what its kv keys and idempotency claims are
//! charged, and the scripts that keep the count (`lua/include/quota.lua`).
//!
//! The budget ([`Limits::kv_quota_bytes`](super::Limits::kv_quota_bytes))
//! is meant to bound the memory one tenant takes in Redis, so it charges
//! what Redis holds, not only the bytes the guest names:
//!
//! | what | charged |
//! |---|---|
//! | a kv key | [`KEY_OVERHEAD_BYTES`] + its name + its value |
//! | an idempotency claim | [`CLAIM_OVERHEAD_BYTES`] + its key + its kept result |
//!
//! A claim is charged when `begin` takes it and again, with its result, when
//! it commits; an abort, a refused commit or its TTL ending releases it. The
//! number of live claims is bounded on its own too
//! ([`Limits::max_live_claims`](super::Limits::max_live_claims)).
//!
//! The overheads come from measuring what one more key costs in `INFO
//! memory`'s `used_memory` (Redis 7.0, jemalloc), count field and index
//! entries included, over 4,000 to 200,000 keys or claims:
//!
//! | what | Redis holds | charged |
//! |---|---|---|
//! | empty kv value, short name | 172–186 bytes | 262–264 |
//! | the same with a TTL | 326–342 bytes | 262–264 |
//! | claim, 4-byte result (its record a listpack) | 513 bytes | 781 |
//! | claim, 65-byte result (past 64 bytes the record is a hash table) | 1,041 bytes | 842 |
//! | claim, 2,000-byte result | 3,009 bytes | 2,777 |
//!
//! so Redis holds at most about 1.3 times the charge for small keys, and a
//! large value at most 1.25 times its length (jemalloc's size classes). A
//! namespace therefore takes at most twice its budget, with room to spare;
//! docs/sandbox.md turns that into a `maxmemory` rule.

use redis::{Script, ScriptInvocation};

use super::call::LoadedHandler;
use crate::store::scripts::{self, Argv, ArgvLayout};

/// Bytes a kv key is charged beyond its name and value: the key object, its
/// TTL, its encoding, and the budget's own count field and index entry.
pub const KEY_OVERHEAD_BYTES: u64 = 256;

/// Bytes an idempotency claim is charged beyond its key and kept result:
/// its record (owner, task, attempt, lease, state), the key object and TTL,
/// and the budget's count field and index entry.
pub const CLAIM_OVERHEAD_BYTES: u64 = 768;

/// The keys of `namespace`'s budget, in the order the scripts take them
/// (KEYS[2..4]): its count, its kv keys' TTL index and its claims' index.
pub(crate) fn keys(namespace: &str) -> [String; 3] {
    [
        format!("dtq:quota:{{{namespace}}}"),
        format!("dtq:quota-ttl:{{{namespace}}}"),
        format!("dtq:quota-claims:{{{namespace}}}"),
    ]
}

/// A script of `body` after the budget's shared fragment (and Redis's
/// clock, which it reads), with the overheads it charges set in one place.
pub(crate) fn script(body: &str) -> Script {
    let overheads = format!(
        "local KEY_OVERHEAD, CLAIM_OVERHEAD = {KEY_OVERHEAD_BYTES}, {CLAIM_OVERHEAD_BYTES}\n"
    );
    scripts::compose(
        &[
            &overheads,
            scripts::CLOCK,
            include_str!("lua/include/quota.lua"),
        ],
        body,
    )
}

/// An invocation of a budget script on `subject` (KEYS[1]) for `handler`'s
/// namespace, with the keys every such script takes first (KEYS[2..4]);
/// its arguments go through [`argv`].
pub(crate) fn invocation<'a>(
    script: &'a Script,
    subject: &str,
    handler: &LoadedHandler,
) -> ScriptInvocation<'a> {
    let mut invocation = script.prepare_invoke();
    invocation.key(subject);
    for key in &handler.quota_keys {
        invocation.key(key);
    }
    invocation
}

/// The arguments of a budget script of `layout` on `invocation`, the
/// budget's own put: `lua/include/quota.lua`'s `ARG_` locals, the first
/// three names of every such layout. The script's own follow.
pub(crate) fn argv<'c, 'a>(
    invocation: &'c mut ScriptInvocation<'a>,
    layout: &'static ArgvLayout,
    handler: &LoadedHandler,
) -> Argv<'c, ScriptInvocation<'a>> {
    Argv::new(invocation, layout)
        .put("KV_PREFIX", &handler.kv_prefix)
        .put("CLAIM_PREFIX", &handler.claim_prefix)
        .put("BUDGET", handler.kv_quota_bytes)
}

#[cfg(test)]
mod tests {
    use super::super::imports::KV_WRITE_ARGV;
    use super::super::operation::{ABORT_ARGV, BEGIN_ARGV, COMMIT_ARGV, RENEW_ARGV, WRITE_ARGV};
    use super::*;
    use crate::store::argv_check;

    /// Every sandbox script reads its ARGV by name, as its layout says;
    /// a budget script's layout starts with the budget's names, which its
    /// fragment declares.
    #[test]
    fn every_argv_layout_is_its_scripts_locals() {
        let budget = |file: &str| argv_check::text("sandbox", &["include/quota", file]);
        let layouts = [
            (&BEGIN_ARGV, budget("claim_begin")),
            (&COMMIT_ARGV, budget("claim_commit")),
            (&WRITE_ARGV, budget("claim_commit")),
            (&ABORT_ARGV, budget("claim_abort")),
            (&KV_WRITE_ARGV, budget("kv_write")),
            (&RENEW_ARGV, argv_check::text("sandbox", &["claim_renew"])),
        ];
        argv_check::check_room("sandbox", &layouts, &[]);
    }

    #[test]
    fn the_budget_keys_share_the_namespaces_slot() {
        for key in keys("ns") {
            assert!(key.ends_with(":{ns}"), "{key}");
        }
    }
}
