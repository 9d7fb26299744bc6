//! The command line: every command, its arguments and its help.

use clap::{Args, Parser, Subcommand};
use dtq_host::Config;

pub(crate) const EXIT_CODES: &str = "\
Exit codes:
  0  success (with --wait: the task SUCCEEDED)
  1  the server refused the request; stderr has its error code and message
  2  bad command line
  3  the server (or Redis) cannot be reached
  4  --wait: the task ended FAILED, DEAD_LETTERED, CANCELLED or EXPIRED
  5  --wait: the task did not finish within --wait-timeout-s";

pub(crate) const SERVER_EXIT_CODES: &str = "\
Exit codes:
  0  stopped by SIGTERM or SIGINT (running tasks finished or were abandoned
     to be reclaimed after --shutdown-grace-ms)
  1  failed while running (e.g. cannot listen on --listen)
  2  bad configuration (a flag, or the --handlers directory)
  3  Redis cannot be reached";

/// dtq: a task queue on Redis whose handlers are WebAssembly components.
///
/// Deploy `<task>.wasm` handlers (built for wasm32-wasip2 against the
/// dtq:handler WIT contract) into a directory, run `dtq serve --handlers DIR`,
/// and submit tasks over HTTP or with `dtq submit`. Every flag of the server
/// commands can also be set by a `DTQ_*` environment variable (the Redis URL
/// by `DTQ_REDIS_URL`, the handlers directory by `DTQ_HANDLERS`, ...); `dtq
/// serve --help` shows each one.
///
/// The client commands print tables with local times when stdout is a
/// terminal, and JSON (what scripts read) when it is not, or with --json.
#[derive(Parser)]
#[command(name = "dtq", version, after_help = EXIT_CODES)]
pub(crate) struct Cli {
    /// Print answers as JSON (events as JSON lines) even on a terminal,
    /// where tables with local times are printed otherwise. Output that is
    /// not a terminal (a pipe, a file) is always JSON. `DTQ_JSON=1` (any
    /// value but empty, 0, false, no, off) does the same.
    #[arg(
        long,
        global = true,
        env = "DTQ_JSON",
        value_parser = clap::builder::FalseyValueParser::new()
    )]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run the HTTP API and a worker in one process.
    #[command(after_help = SERVER_EXIT_CODES)]
    Serve(Config),
    /// Run a worker only: consume --queues and run their tasks.
    #[command(after_help = SERVER_EXIT_CODES)]
    Worker(Config),
    /// Run the HTTP API only (submissions, status, cancel, DLQ).
    #[command(after_help = SERVER_EXIT_CODES)]
    Api(Config),
    /// Submit a task through the API and print the response.
    ///
    /// With --wait, follow the task until it ends and print its record;
    /// with -k KEY too, a key whose task is still in flight (409
    /// IDEMPOTENCY_IN_PROGRESS) is followed the same way, that task's
    /// record printed. A warning on stderr says when no live worker
    /// consumes the queue (the task waits until one does).
    #[command(after_help = EXIT_CODES)]
    Submit(SubmitArgs),
    /// Submit the tasks of a file of JSON lines, each line a submission
    /// body (`{"task", "payload", "idempotency_key"?, ...}`), in batches of
    /// 1000: print each line's result as a JSON line (`line`, `status`,
    /// `body`) and a summary on stderr. Exit code 1 if any was refused.
    #[command(after_help = EXIT_CODES)]
    SubmitBatch {
        /// The queue.
        queue: String,
        /// The file of JSON lines, or `-` for stdin.
        file: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show a task: status, attempts, result, error, log, timestamps, and
    /// `attempt_history`: each attempt kept (the last 20), oldest first,
    /// with its outcome, error, log, start, end, duration and digest.
    Status {
        /// The task's queue.
        queue: String,
        /// The task id.
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List a queue's tasks, newest first: one page, and the cursor of the
    /// next (`next_cursor`, null at the end).
    ///
    /// A filtered listing (--status, --task) reads at most 2000 tasks per
    /// request, so a page may be short, even empty, while a cursor says
    /// there is more: pass it with --cursor to go on.
    Tasks {
        /// The queue.
        queue: String,
        /// Only tasks of this status (QUEUED, SCHEDULED, RUNNING, RETRYING,
        /// SUCCEEDED, FAILED, DEAD_LETTERED, CANCELLED, EXPIRED).
        #[arg(long)]
        status: Option<String>,
        /// Only tasks of this name (the handler's), exactly.
        #[arg(long, value_name = "NAME")]
        task: Option<String>,
        /// Tasks per page, 1 to 1000 (server default 100).
        #[arg(long)]
        limit: Option<u32>,
        /// Continue after a page: its `next_cursor`.
        #[arg(long)]
        cursor: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Print a queue's events as they happen until interrupted: on a
    /// terminal one line each (local time, status, task name, task id,
    /// attempt), else (or with --json) one JSON object per line (`id`,
    /// `event`, `task_id`, `task`, `status`, `attempt`, `at`). A dropped
    /// connection is resumed where it left off; a `gap` event says events
    /// were trimmed before they were read.
    Watch {
        /// The queue.
        queue: String,
        /// Only the events of this task (its id).
        #[arg(long, value_name = "TASK_ID")]
        task: Option<String>,
        /// Start after this event id (a line's `id`) instead of with new
        /// events.
        #[arg(long)]
        since: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Cancel a waiting or running task.
    Cancel {
        /// The task's queue.
        queue: String,
        /// The task id.
        id: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Show the counts of every queue, or of one.
    Queues {
        /// Only this queue.
        queue: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Raise a queue's partition count (needs `admin` on every queue, e.g.
    /// the admin token).
    ///
    /// A partitioned queue is spread over COUNT Redis Cluster slots, so one
    /// busy queue uses every shard: a keyed submission goes to the
    /// partition of its key, an unkeyed one round-robin, and workers
    /// consume every partition (new ones within 2 s, without a restart).
    /// The count can only be raised. On a single Redis it changes nothing
    /// but the layout.
    Partitions {
        /// The queue.
        queue: String,
        /// The new count, 1 to 256, at least the present one.
        count: u32,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List, requeue or purge dead-lettered tasks.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Set, list or delete a queue's periodic tasks (cron schedules, UTC).
    #[command(subcommand)]
    Schedule(ScheduleCommand),
    /// Deploy a handler module to the fleet (needs a `deploy` grant
    /// covering the task, its namespace and hosts, or the admin token).
    ///
    /// The module is checked first (it compiles, fits the handler world,
    /// its imports are provided, its namespace is granted, some live worker
    /// can honour its settings unless --force), stored in Redis
    /// by its SHA-256, and made the active version of the task. Every API
    /// and worker picks it up without a restart; tasks already running
    /// finish on the version they started with. Then this waits until every
    /// live worker runs it (--wait-s) and prints the rollout.
    #[command(after_help = DEPLOY_HELP)]
    Deploy(DeployArgs),
    /// Show the deployed handlers and the fleet: each live worker, the
    /// queues it consumes and the handlers it runs; `history TASK` shows a
    /// task's versions.
    Handlers {
        #[command(subcommand)]
        command: Option<HandlersCommand>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Make an earlier version of a task's handler active again (needs a
    /// `deploy` grant covering the version it restores, or the admin
    /// token): by default the newest one in its history that differs
    /// from the active one.
    Rollback {
        /// The task.
        task: String,
        /// Return to this digest (see `dtq handlers history TASK`).
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Write a signing key pair for `dtq deploy --sign-key`: NAME (private,
    /// mode 0600) and NAME.pub (public: add its line to the fleet's
    /// --trusted-keys file). Existing files are not overwritten.
    Keygen {
        /// The private key's path; the public key goes beside it with
        /// `.pub` added, and the key is named by the file's name.
        name: std::path::PathBuf,
    },
    /// Remove a task's handler from the fleet (needs a `deploy` grant
    /// covering the task, or the admin token). New
    /// submissions of the task are refused; waiting ones wait for a deploy.
    /// Its history stays, so `dtq rollback TASK` brings it back.
    Undeploy {
        /// The task.
        task: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

pub(crate) const DEPLOY_HELP: &str = "\
A manifest deploys several handlers at once; each table names a task, its
module (relative to the manifest) and its settings:

  [handlers.send_receipt]
  file = \"send_receipt.wasm\"
  namespace = \"billing\"
  memory_mib = 32
  timeout_ms = 10000
  max_attempts = 5
  kv_quota_mib = 16

Unset settings take each worker's flags (--memory-mib, --task-timeout-ms, ...).
The manifest is read whole first (a bad key stops everything); then the
handlers are deployed in order, and a refused module stops there, those
before it deployed.";

#[derive(Subcommand)]
pub(crate) enum HandlersCommand {
    /// A task's active version and its history, newest first.
    History {
        /// The task.
        task: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Args)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["file", "manifest"]))]
pub(crate) struct DeployArgs {
    /// The component (`.wasm`, built for wasm32-wasip2).
    pub(crate) file: Option<std::path::PathBuf>,
    /// The task it handles. Default: the file's stem, `-` read as `_`.
    #[arg(long, conflicts_with = "manifest")]
    pub(crate) task: Option<String>,
    /// Deploy every handler of this TOML manifest instead (see below).
    #[arg(long, conflicts_with_all = ["file", "task"])]
    pub(crate) manifest: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub(crate) settings: dtq_host::deploy::DeploySettings,
    /// Sign each deploy with this private key (`dtq keygen`), as a fleet
    /// with --trusted-keys requires: over the task, the module's SHA-256
    /// and the settings, sent as the `Dtq-Signature` header.
    #[arg(long)]
    pub(crate) sign_key: Option<std::path::PathBuf>,
    /// Wait up to this many seconds for every live worker to run the new
    /// version; 0 does not wait.
    #[arg(long, default_value_t = 10)]
    pub(crate) wait_s: u64,
    /// Deploy even when no live worker can honour the settings (the server
    /// refuses it otherwise, 409 NO_WORKER_CAN_RUN with each worker's
    /// reason): its tasks wait for a worker that can.
    #[arg(long)]
    pub(crate) force: bool,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

#[derive(Subcommand)]
pub(crate) enum ScheduleCommand {
    /// Create or replace a schedule (needs `admin` on the queue and a grant
    /// covering the task, or the admin token): one task per
    /// tick across the fleet, fired by the workers consuming the queue.
    Set {
        /// The queue.
        queue: String,
        /// The schedule's name, unique in the queue.
        name: String,
        /// 5 fields (minute hour day-of-month month day-of-week), or 6 with
        /// seconds first; UTC. E.g. '*/5 * * * *'.
        #[arg(long)]
        cron: String,
        /// The task each tick submits (a deployed handler).
        #[arg(long)]
        task: String,
        /// The payload of each tick's task, JSON text.
        #[arg(long, default_value = "null")]
        payload: String,
        /// Attempts of each task.
        #[arg(long)]
        max_attempts: Option<u32>,
        /// Deadline of one attempt, ms.
        #[arg(long)]
        timeout_ms: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// List a queue's schedules, with their next and last ticks.
    List {
        /// The queue.
        queue: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Delete a schedule (needs `admin` on the queue and a grant covering
    /// its task, or the admin token).
    Delete {
        /// The queue.
        queue: String,
        /// The schedule.
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Subcommand)]
pub(crate) enum DlqCommand {
    /// List a queue's dead-lettered tasks.
    List {
        /// The queue.
        queue: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Requeue dead-lettered tasks (needs the admin token): the named ones,
    /// or --all. Attempt numbers go on rising, and each gets its original
    /// budget of attempts again.
    #[command(group = clap::ArgGroup::new("which").required(true).args(["ids", "all"]))]
    Requeue {
        /// The queue.
        queue: String,
        /// The task ids (one prints the task; several print
        /// `{"requeued", "not_dead_lettered", "key_taken"}`).
        ids: Vec<String>,
        /// Every task the DLQ holds now.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Purge dead-lettered tasks for good (needs the admin token): each
    /// task's record and its idempotency record (the key can be submitted
    /// afresh, as a new task). Prints `{"purged"}`.
    #[command(group = clap::ArgGroup::new("which").required(true).args(["ids", "all", "older_than"]))]
    Purge {
        /// The queue.
        queue: String,
        /// The task ids.
        ids: Vec<String>,
        /// Every task the DLQ holds now.
        #[arg(long)]
        all: bool,
        /// Those dead-lettered longer ago than this: `500ms`, `45s`, `90m`,
        /// `12h`, `30d`.
        #[arg(long, value_name = "DURATION", value_parser = duration_ms)]
        older_than: Option<u64>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Args, Clone)]
pub(crate) struct ClientArgs {
    /// Base URL of the dtq API.
    #[arg(long, env = "DTQ_API", default_value = "http://127.0.0.1:8080")]
    pub(crate) api: String,
    /// API token sent as `Authorization: Bearer`, when the API has tokens
    /// configured; the admin token is sent when this is not set.
    #[arg(long, env = "DTQ_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// Admin token, for admin routes.
    #[arg(long, env = "DTQ_ADMIN_TOKEN", hide_env_values = true)]
    pub(crate) admin_token: Option<String>,
}

#[derive(Args)]
pub(crate) struct SubmitArgs {
    /// The queue.
    pub(crate) queue: String,
    /// The task name (a deployed `<task>.wasm`).
    pub(crate) task: String,
    /// The payload: JSON text, `@FILE` to read it from a file, or `-` for stdin.
    pub(crate) payload: String,
    /// Idempotency key: one logical task per key while its record lives.
    #[arg(long, short = 'k')]
    pub(crate) idempotency_key: Option<String>,
    /// Attempts before dead-lettering (server default if unset).
    #[arg(long)]
    pub(crate) max_attempts: Option<u32>,
    /// Deadline of one attempt, ms.
    #[arg(long)]
    pub(crate) timeout_ms: Option<u64>,
    /// Run no earlier than this many ms from now.
    #[arg(long)]
    pub(crate) delay_ms: Option<u64>,
    /// Expire if not started within this many ms.
    #[arg(long)]
    pub(crate) expires_in_ms: Option<u64>,
    /// Run no earlier than this time: RFC 3339 (`2026-12-03T14:00:00Z`) or
    /// ms since the Unix epoch. Not with --delay-ms.
    #[arg(long, conflicts_with = "delay_ms")]
    pub(crate) run_at: Option<String>,
    /// Wait for the task to finish and print its final record (exit code
    /// 4 if it did not succeed, 5 if it had not ended by --wait-timeout-s).
    /// With -k, a task of the key still in flight is waited for instead.
    #[arg(long)]
    pub(crate) wait: bool,
    /// With --wait: give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    pub(crate) wait_timeout_s: u64,
    #[command(flatten)]
    pub(crate) client: ClientArgs,
}

/// `--older-than`: a duration as humantime reads it (`500ms`, `45s`,
/// `90m`, `12h`, `30d`, and combinations and fractions such as `1h 30m`
/// or `1.5h`), as milliseconds. A number without a unit is refused.
pub(crate) fn duration_ms(text: &str) -> Result<u64, String> {
    let duration = humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration (e.g. 30d, 12h, 45s): {e}"))?;
    u64::try_from(duration.as_millis()).map_err(|_| format!("{text:?} is too long a duration"))
}

#[cfg(test)]
mod tests {
    use super::duration_ms;

    #[test]
    fn durations_read_as_before() {
        let cases = [
            ("500ms", 500),
            ("0s", 0),
            ("45s", 45_000),
            ("90m", 5_400_000),
            ("12h", 43_200_000),
            ("30d", 2_592_000_000),
            ("007s", 7_000),
        ];
        for (text, ms) in cases {
            assert_eq!(duration_ms(text), Ok(ms), "{text}");
        }
    }

    #[test]
    fn a_number_without_a_unit_or_a_unit_without_a_number_is_refused() {
        for text in ["", "30", "d", "-5s", "5x", "s5"] {
            assert!(duration_ms(text).is_err(), "{text:?} accepted");
        }
        assert!(duration_ms("99999999999999999999d").is_err());
    }

    #[test]
    fn combinations_and_fractions_are_read_too() {
        assert_eq!(duration_ms("1h 30m"), Ok(5_400_000));
        assert_eq!(duration_ms("1d12h"), Ok(129_600_000));
        assert_eq!(duration_ms("1.5h"), Ok(5_400_000));
    }
}
