//! `dtq watch`: a queue's events, each with its task's name, as lines
//! (JSON lines for a script) until interrupted.

use dtq_host::client::events::{Interruption, Watched};
use dtq_host::client::{Client, ClientError};

use super::print::print_event_line;
use super::{Failure, fail, shutdown_signal};

/// Print `queue`'s events (of task id `task`, if given), one a line
/// ([`print_event_line`]), until SIGINT or SIGTERM, or until the reader of stdout leaves. The first
/// connection's failure is the command's (its error body printed, its
/// exit code); once connected, an unreachable or overloaded server is
/// waited out with a warning on stderr, and stdout keeps only event lines.
pub(crate) async fn watch(
    api: Client,
    queue: &str,
    task: Option<String>,
    since: Option<String>,
) -> Result<(), Failure> {
    let mut watch = api.watch(queue, task.as_deref(), since)?;
    let follow = async {
        loop {
            let event = match watch.next().await {
                Ok(Watched::Event(event)) => event,
                Ok(Watched::Interrupted(why)) => {
                    warn(&why);
                    continue;
                }
                Err(e) if watch.connected() => return Err(refused_again(&e)),
                Err(e) => return Err(e.into()),
            };
            match print_event_line(&event) {
                Ok(()) => {}
                // `dtq watch | head`: the reader left.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    };
    tokio::select! {
        result = follow => result,
        () = shutdown_signal() => Ok(()),
    }
}

/// The warning on stderr of a lost stream, which is opened again.
fn warn(why: &Interruption) {
    match why {
        Interruption::Ended => eprintln!("warning: the event stream ended; reconnecting"),
        Interruption::Broken(e) => eprintln!("warning: {e}; reconnecting"),
        Interruption::Unavailable { url, status } => {
            eprintln!("warning: {url} answered {status}; retrying");
        }
        Interruption::Unreachable { url, error } => {
            eprintln!("warning: cannot reach {url}: {error}; retrying");
        }
    }
}

/// A refusal met reconnecting: the command's failure (exit 1), its body
/// not printed (stdout keeps only event lines).
fn refused_again(e: &ClientError) -> Failure {
    match e {
        ClientError::Api {
            status,
            code,
            message,
            ..
        } => fail(1, anyhow::anyhow!("{code} ({status}): {message}")),
        ClientError::Http { url, status, .. } => {
            fail(1, anyhow::anyhow!("HTTP error ({status}): {url}"))
        }
        other => fail(1, anyhow::anyhow!("{other}")),
    }
}
