//! The store's Lua scripts, the codes they return, and the way every room
//! composes a script from shared fragments.
//!
//! One file per operation under `lua/`, loaded here ([`Scripts`]) but for
//! `progress.lua`, which the sandbox runs on its own connection, loaded in
//! `progress.rs`; the
//! sandbox's scripts live in `sandbox/lua/` and the handler registry's in
//! `deploy/lua/`, each loaded by the code that calls it. A fragment under
//! a room's `lua/include/` is text prepended to the scripts that use it,
//! so each function is written once: here at compile time (`idem.lua` to
//! every store script, the others to the scripts that name them); in the
//! other rooms through [`compose`], which is how a fragment crosses rooms
//! (Redis's clock, [`CLOCK`], is the one that does). Each script opens
//! with a header naming its KEYS, ARGV, outputs and events; [`Code`]
//! mirrors the codes the store's headers list.

use redis::{Script, ToRedisArgs};

/// Redis's clock (`lua/include/clock.lua`): `redisTimeMs()`, the one place
/// a script turns `TIME` into milliseconds. Store scripts include it by
/// name (`script!`); the sandbox's and the registry's scripts through
/// [`compose`] or [`clocked`].
pub(crate) const CLOCK: &str = include_str!("lua/include/clock.lua");

/// A script of `body` after `fragments`, in order: how a room whose
/// scripts share a fragment with another room's composes them, each room
/// passing its own files (`include_str!("lua/...")` beside its code).
pub(crate) fn compose(fragments: &[&str], body: &str) -> Script {
    let mut text =
        String::with_capacity(fragments.iter().map(|f| f.len()).sum::<usize>() + body.len());
    for fragment in fragments {
        text.push_str(fragment);
    }
    text.push_str(body);
    Script::new(&text)
}

/// A script of `body` after Redis's clock ([`CLOCK`]).
pub(crate) fn clocked(body: &str) -> Script {
    compose(&[CLOCK], body)
}

/// The ARGV a script reads by name, in order: its header lists them, and
/// its Lua reads each through a local `<prefix><NAME> = <index>` at the
/// top (`local ARG_NOW = 2`, then `ARGV[ARG_NOW]`), so no value is where
/// it is by coincidence. Every script of every room that takes ARGV has
/// one, beside the code that calls it (a store operation's file,
/// `sandbox/operation.rs` and `imports.rs`, `deploy/scripts.rs`), and that
/// code writes the arguments through [`Argv`]; only `ingest.lua` numbers
/// its names in `submit.rs`'s `argv` instead. A shared fragment's
/// arguments come first and are the first names of each layout of the
/// scripts that include it (`sandbox/lua/include/quota.lua`). Each room's
/// tests hold its layouts to its scripts' locals and headers, and find
/// any script without one (`argv_check.rs`); no Lua file reads ARGV at a
/// literal index.
#[derive(Debug)]
pub(crate) struct ArgvLayout {
    /// The script, `lua/<script>.lua`.
    pub(crate) script: &'static str,
    /// The prefix of its locals: `ARG_` for ARGV indexes, or another for
    /// offsets within a repeated group (a completion's values).
    pub(crate) prefix: &'static str,
    /// The index (or offset) of the first name: 1 for ARGV, 0 for offsets.
    pub(crate) first: usize,
    /// The names, without the prefix, in ARGV order.
    pub(crate) names: &'static [&'static str],
    /// The name of the index right after them, where the script's repeated
    /// groups start (a value per task, say), if it has any.
    pub(crate) rest: Option<&'static str>,
}

/// A call being built: a script invocation or a raw `EVALSHA` command.
pub(crate) trait ArgSink {
    /// Append one argument.
    fn push_arg<T: ToRedisArgs>(&mut self, value: T);
}

impl ArgSink for redis::Cmd {
    fn push_arg<T: ToRedisArgs>(&mut self, value: T) {
        self.arg(value);
    }
}

impl ArgSink for redis::ScriptInvocation<'_> {
    fn push_arg<T: ToRedisArgs>(&mut self, value: T) {
        self.arg(value);
    }
}

/// A script's arguments written by the names of its [`ArgvLayout`]; each
/// name must be the next of the layout (checked in debug builds, which
/// the tests run), so the Rust and the Lua cannot drift apart by one.
pub(crate) struct Argv<'c, S: ArgSink> {
    call: &'c mut S,
    layout: &'static ArgvLayout,
    next: usize,
}

impl<'c, S: ArgSink> Argv<'c, S> {
    /// Write `layout`'s arguments into `call`, from its first name on.
    pub(crate) fn new(call: &'c mut S, layout: &'static ArgvLayout) -> Self {
        Argv {
            call,
            layout,
            next: 0,
        }
    }

    /// The argument `name` of the layout: the next one.
    pub(crate) fn put<T: ToRedisArgs>(mut self, name: &str, value: T) -> Self {
        debug_assert_eq!(
            self.layout.names.get(self.next).copied(),
            Some(name),
            "{}.lua: {}{name} is not its argument {}",
            self.layout.script,
            self.layout.prefix,
            self.layout.first + self.next
        );
        self.next += 1;
        self.call.push_arg(value);
        self
    }

    /// Every name of the layout was put; what follows it (a script's
    /// repeated groups) goes into the call itself.
    pub(crate) fn done(self) -> &'c mut S {
        debug_assert_eq!(
            self.next,
            self.layout.names.len(),
            "{}.lua: arguments missing before {}{}",
            self.layout.script,
            self.layout.prefix,
            self.layout.rest.unwrap_or("the end")
        );
        self.call
    }
}

macro_rules! script {
    ($name:literal $(, $include:literal)*) => {
        Script::new(concat!(
            include_str!("lua/include/idem.lua"),
            $(include_str!(concat!("lua/include/", $include, ".lua")),)*
            include_str!(concat!("lua/", $name, ".lua"))
        ))
    };
}

/// Every script, loaded once per process.
pub(crate) struct Scripts {
    pub(crate) ingest: Script,
    pub(crate) start: Script,
    pub(crate) complete: Script,
    pub(crate) promote: Script,
    pub(crate) cancel: Script,
    pub(crate) requeue: Script,
    pub(crate) heartbeat: Script,
    pub(crate) reclaim: Script,
    pub(crate) dlq_purge: Script,
    pub(crate) expire: Script,
    pub(crate) schedule_put: Script,
    pub(crate) schedule_delete: Script,
    pub(crate) schedule_advance: Script,
    pub(crate) partitions_raise: Script,
    pub(crate) task_read: Script,
    pub(crate) idem_forward: Script,
    pub(crate) queue_register: Script,
    pub(crate) admit: Script,
    pub(crate) read_admit: Script,
}

impl Scripts {
    pub(crate) fn new() -> Self {
        Scripts {
            ingest: script!("ingest"),
            start: script!("start"),
            complete: script!("complete", "carried", "attempts", "flow"),
            promote: script!("promote"),
            cancel: script!("cancel", "carried", "flow"),
            requeue: script!("requeue", "attempts"),
            heartbeat: script!("heartbeat", "clock", "liveness", "carried"),
            reclaim: script!("reclaim", "clock", "liveness", "carried", "attempts"),
            dlq_purge: script!("dlq_purge"),
            expire: script!("expire"),
            schedule_put: script!("schedule_put"),
            schedule_delete: script!("schedule_delete"),
            schedule_advance: script!("schedule_advance"),
            partitions_raise: script!("partitions_raise"),
            task_read: script!("task_read", "carried"),
            idem_forward: script!("idem_forward"),
            queue_register: script!("queue_register"),
            admit: script!("admit", "clock", "admission"),
            read_admit: script!("read_admit", "clock", "carried", "admission"),
        }
    }

    pub(crate) fn all(&self) -> [&Script; 19] {
        [
            &self.ingest,
            &self.start,
            &self.complete,
            &self.promote,
            &self.cancel,
            &self.requeue,
            &self.heartbeat,
            &self.reclaim,
            &self.dlq_purge,
            &self.expire,
            &self.schedule_put,
            &self.schedule_delete,
            &self.schedule_advance,
            &self.partitions_raise,
            &self.task_read,
            &self.idem_forward,
            &self.queue_register,
            &self.admit,
            &self.read_admit,
        ]
    }
}

/// The return codes of the store's scripts, as their headers list them.
/// Codes are unique across these scripts, so a code means one thing
/// wherever it appears among them. The sandbox's scripts answer 1/0 and
/// states, read where they are called; the handler registry's answer
/// codes of their own (`deploy/registry.rs`), whose refusals are numbered
/// from -21 so that no negative code means two things in the crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// start: the message's task is terminal or gone; acknowledged.
    Skipped,
    /// Done: ingest created the task, complete/cancel/requeue applied;
    /// heartbeat: the task is still the attempt's.
    Ok,
    /// ingest: the key's task is terminal; this is a replay.
    Replay,
    /// cancel: the task is running; its worker was asked to interrupt it.
    /// heartbeat: the attempt's task was asked to cancel.
    CancelRequested,
    /// start: the task was not started before its expiry.
    Expired,
    /// start: the task's worker died and no attempts are left.
    Exhausted,
    /// start: the task's record is not a readable task; it was failed
    /// alone.
    Corrupt,
    /// ingest: the key's task is still in flight.
    InProgress,
    /// ingest: the key was used with another payload or task name.
    KeyMismatch,
    /// ingest: the queue is at its depth limit.
    QueueFull,
    /// complete: the task is not in the state this completion belongs to;
    /// heartbeat: the task is no longer the attempt's (reclaimed elsewhere).
    Stale,
    /// cancel: the task is already terminal.
    Terminal,
    /// cancel: no such task.
    NotFound,
    /// requeue: the task is not dead-lettered (or its DLQ entry dangled).
    NotInDlq,
    /// ingest: the queue's partition count is not the one the submission
    /// was routed by; nothing was written.
    Repartitioned,
    /// ingest: the key's records live in another partition (a forward
    /// left by a DLQ requeue); nothing was written.
    Forwarded,
    /// requeue, idem_forward: the task's idempotency key names another
    /// task now; nothing was written.
    KeyTaken,
}

impl Code {
    /// The code a script returned, or `None` for a number no script returns.
    pub fn from_i64(code: i64) -> Option<Code> {
        Some(match code {
            0 => Code::Skipped,
            1 => Code::Ok,
            2 => Code::Replay,
            3 => Code::CancelRequested,
            4 => Code::Expired,
            5 => Code::Exhausted,
            6 => Code::Corrupt,
            -1 => Code::InProgress,
            -2 => Code::KeyMismatch,
            -3 => Code::QueueFull,
            -4 => Code::Stale,
            -5 => Code::Terminal,
            -6 => Code::NotFound,
            -7 => Code::NotInDlq,
            -8 => Code::Repartitioned,
            -9 => Code::Forwarded,
            -10 => Code::KeyTaken,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::super::argv_check;
    use super::{ArgvLayout, Code};

    /// The scripts whose replies carry a [`Code`], with their text.
    const CODED: &[(&str, &str)] = &[
        ("ingest", include_str!("lua/ingest.lua")),
        ("start", include_str!("lua/start.lua")),
        ("complete", include_str!("lua/complete.lua")),
        ("cancel", include_str!("lua/cancel.lua")),
        ("requeue", include_str!("lua/requeue.lua")),
        ("heartbeat", include_str!("lua/heartbeat.lua")),
        ("idem_forward", include_str!("lua/idem_forward.lua")),
    ];

    /// The scripts whose replies are not codes of [`Code`] (counts, XCLAIM
    /// entries, reads).
    const UNCODED: &[&str] = &[
        "admit",
        "read_admit",
        "promote",
        "reclaim",
        "dlq_purge",
        "expire",
        "task_read",
        "schedule_put",
        "schedule_delete",
        "schedule_advance",
        "partitions_raise",
        "queue_register",
        "progress",
        "flow_record",
        "flow_stage",
    ];

    /// Every variant; the match makes a new variant fail to compile here
    /// until it is listed.
    fn every_code() -> Vec<Code> {
        let all = [
            Code::Skipped,
            Code::Ok,
            Code::Replay,
            Code::CancelRequested,
            Code::Expired,
            Code::Exhausted,
            Code::Corrupt,
            Code::InProgress,
            Code::KeyMismatch,
            Code::QueueFull,
            Code::Stale,
            Code::Terminal,
            Code::NotFound,
            Code::NotInDlq,
            Code::Repartitioned,
            Code::Forwarded,
            Code::KeyTaken,
        ];
        for code in all {
            match code {
                Code::Skipped
                | Code::Ok
                | Code::Replay
                | Code::CancelRequested
                | Code::Expired
                | Code::Exhausted
                | Code::Corrupt
                | Code::InProgress
                | Code::KeyMismatch
                | Code::QueueFull
                | Code::Stale
                | Code::Terminal
                | Code::NotFound
                | Code::NotInDlq
                | Code::Repartitioned
                | Code::Forwarded
                | Code::KeyTaken => {}
            }
        }
        all.to_vec()
    }

    /// A leading integer of `text` (after an optional `{`), followed by a
    /// comma, a space or the end.
    fn leading_int(text: &str) -> Option<i64> {
        let text = text.strip_prefix('{').unwrap_or(text);
        let end = text
            .char_indices()
            .find(|&(i, c)| !(c.is_ascii_digit() || (i == 0 && c == '-')))
            .map_or(text.len(), |(i, _)| i);
        let rest = &text[end..];
        if !(rest.is_empty() || rest.starts_with(',') || rest.starts_with(' ')) {
            return None;
        }
        text[..end].parse().ok()
    }

    /// The codes the header's `Output` section lists: the lines indented
    /// under it that start with a number (`{-1, id}`, `1, status`, `-4 STALE`).
    fn header_codes(script: &str) -> BTreeSet<i64> {
        let header = &script[..script.find("]]").expect("a header")];
        let mut lines = header
            .lines()
            .skip_while(|l| !l.trim_start().starts_with("Output"));
        let output = lines.next().expect("an Output section");
        let indent = output.len() - output.trim_start().len();
        lines
            .take_while(|l| !l.trim().is_empty())
            .filter(|l| l.len() - l.trim_start().len() > indent)
            .filter_map(|l| leading_int(l.trim()))
            .collect()
    }

    /// The values of `text` (split at `,`, `and`, `or`) that are integer
    /// literals, outside brackets and strings.
    fn bare_ints(text: &str) -> Vec<i64> {
        let mut kept = String::new();
        let (mut depth, mut quoted) = (0, false);
        for c in text.chars() {
            match c {
                '"' => quoted = !quoted,
                '[' if !quoted => depth += 1,
                ']' if !quoted => depth -= 1,
                _ if quoted || depth > 0 => {}
                _ => kept.push(c),
            }
        }
        kept.split(',')
            .flat_map(|t| t.split(" or "))
            .flat_map(|t| t.split(" and "))
            .filter_map(|t| t.trim().parse().ok())
            .collect()
    }

    /// The codes the body returns: `return {N, ...}`, `return N, ...`,
    /// `emit(N, ...)`, and values put into the reply table `out[...] = ...`.
    fn body_codes(script: &str) -> BTreeSet<i64> {
        let body = &script[script.find("]]").expect("a header") + 2..];
        let mut codes = BTreeSet::new();
        for line in body.lines().map(str::trim) {
            if line.starts_with("--") {
                continue;
            }
            for prefix in ["return ", "emit("] {
                if let Some(at) = line.find(prefix)
                    && let Some(code) = leading_int(&line[at + prefix.len()..])
                {
                    codes.insert(code);
                }
            }
            if line.starts_with("out[")
                && let Some((_, value)) = line.split_once(" = ")
            {
                codes.extend(bare_ints(value));
            }
        }
        codes
    }

    #[test]
    fn every_script_is_classified() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/store/lua");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .expect("the lua directory")
            .filter_map(|e| {
                let name = e.expect("an entry").file_name().into_string().ok()?;
                name.strip_suffix(".lua").map(str::to_owned)
            })
            .collect();
        on_disk.sort();
        let mut known: Vec<String> = CODED
            .iter()
            .map(|(name, _)| *name)
            .chain(UNCODED.iter().copied())
            .map(str::to_owned)
            .collect();
        known.sort();
        assert_eq!(on_disk, known, "list a new script in CODED or UNCODED");
    }

    #[test]
    fn every_script_code_is_a_code_and_every_code_is_returned() {
        let mut used = Vec::new();
        for (name, script) in CODED {
            let header = header_codes(script);
            let body = body_codes(script);
            assert!(!header.is_empty(), "{name}.lua: its header lists no code");
            assert_eq!(
                header, body,
                "{name}.lua: the codes its header lists (left) are not those its body returns (right)"
            );
            for code in header {
                let known = Code::from_i64(code);
                assert!(
                    known.is_some(),
                    "{name}.lua returns {code}, which Code does not know"
                );
                used.extend(known);
            }
        }
        for code in every_code() {
            assert!(used.contains(&code), "no script returns {code:?}");
        }
    }

    /// Every layout of the store's scripts, with its script's text.
    fn layouts() -> Vec<(&'static ArgvLayout, String)> {
        use super::super::{
            QUEUE_REGISTER_ARGV, cancel, complete, dlq, expiry, flow, limits, partitions, progress,
            promote, reclaim, schedules, start, task_read,
        };
        let text = |file: &str| argv_check::text("store", &[file]);
        let admission = |file: &str| argv_check::text("store", &["include/admission", file]);
        vec![
            (&start::START_ARGV, text("start")),
            (&start::HEARTBEAT_ARGV, text("heartbeat")),
            (&reclaim::RECLAIM_ARGV, text("reclaim")),
            (&complete::COMPLETE_ARGV, text("complete")),
            (&complete::COMPLETION_ARGV, text("complete")),
            (&cancel::CANCEL_ARGV, text("cancel")),
            (&promote::PROMOTE_ARGV, text("promote")),
            (&expiry::EXPIRE_ARGV, text("expire")),
            (&dlq::REQUEUE_ARGV, text("requeue")),
            (&dlq::IDEM_FORWARD_ARGV, text("idem_forward")),
            (&dlq::DLQ_PURGE_ARGV, text("dlq_purge")),
            (&schedules::SCHEDULE_PUT_ARGV, text("schedule_put")),
            (&schedules::SCHEDULE_DELETE_ARGV, text("schedule_delete")),
            (&schedules::SCHEDULE_ADVANCE_ARGV, text("schedule_advance")),
            (&partitions::PARTITIONS_RAISE_ARGV, text("partitions_raise")),
            (&task_read::TASK_READ_ARGV, text("task_read")),
            (&QUEUE_REGISTER_ARGV, text("queue_register")),
            (&limits::ADMIT_ARGV, admission("admit")),
            (&limits::READ_ADMIT_ARGV, admission("read_admit")),
            (&progress::PROGRESS_ARGV, text("progress")),
            (&flow::FLOW_RECORD_ARGV, text("flow_record")),
            (&flow::FLOW_STAGE_ARGV, text("flow_stage")),
        ]
    }

    /// Every store script reads its ARGV by name, as its layout says;
    /// `ingest.lua`'s names are held to `submit.rs`'s `argv` by the test
    /// there.
    #[test]
    fn every_argv_layout_is_its_scripts_locals() {
        argv_check::check_room("store", &layouts(), &["ingest"]);
    }

    #[test]
    fn the_parsers_read_the_header_forms() {
        assert_eq!(leading_int("{-1, id}"), Some(-1));
        assert_eq!(leading_int("-4   STALE"), Some(-4));
        assert_eq!(leading_int("1, status"), Some(1));
        assert_eq!(leading_int("5 500 instructions"), Some(5));
        assert_eq!(leading_int("where"), None);
        assert_eq!(bare_ints(r#"f[4] == "1" and 3 or 1"#), vec![3, 1]);
        assert_eq!(bare_ints(r#"0, status or "MISSING""#), vec![0]);
        assert_eq!(
            bare_ints("f(KEYS[5 + 2 * i], 4 + 9 * i)"),
            Vec::<i64>::new()
        );
    }
}
