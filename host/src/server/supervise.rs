//! How a server's roles are run together: whichever ends first on its own
//! is the error, and the others are stopped and still waited for.

use std::future::Future;
use std::pin::pin;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::ServerError;
use crate::worker::WorkerError;

/// The API and the metrics listener as one task for [`supervise`]: when
/// either ends, `stop` stops the other (at shutdown it is stopping
/// already), and the task ends once both have, with the first error.
pub(super) fn either(
    api: Option<JoinHandle<std::io::Result<()>>>,
    metrics: Option<JoinHandle<std::io::Result<()>>>,
    stop: CancellationToken,
) -> Option<JoinHandle<std::io::Result<()>>> {
    let (mut api, mut metrics) = match (api, metrics) {
        (None, one) | (one, None) => return one,
        (Some(api), Some(metrics)) => (api, metrics),
    };
    let settle = |ended: Result<std::io::Result<()>, tokio::task::JoinError>| match ended {
        Ok(result) => result,
        Err(e) => Err(std::io::Error::other(e.to_string())),
    };
    Some(tokio::spawn(async move {
        let (first, other) = tokio::select! {
            ended = &mut api => (ended, metrics),
            ended = &mut metrics => (ended, api),
        };
        stop.cancel();
        let second = other.await;
        settle(first).and(settle(second))
    }))
}

/// Wait for `shutdown` or for either role to end; then stop the other and
/// wait for it. The first role to end on its own is the error returned.
pub(super) async fn supervise(
    api: Option<JoinHandle<std::io::Result<()>>>,
    worker: Option<impl Future<Output = Result<(), WorkerError>>>,
    shutdown: impl Future<Output = ()>,
    stop: CancellationToken,
) -> Result<(), ServerError> {
    let mut shutdown = pin!(shutdown);
    let mut worker = worker.map(Box::pin);
    let mut api = api;
    let mut failure = None;
    tokio::select! {
        () = &mut shutdown => info!("shutting down"),
        ended = async { api.as_mut().expect("guarded").await }, if api.is_some() => {
            api = None;
            failure = Some(api_failure(ended));
        }
        ended = async { worker.as_mut().expect("guarded").await }, if worker.is_some() => {
            worker = None;
            failure = Some(ended.map_or_else(ServerError::Worker, |()| ServerError::WorkerReturned));
        }
    }
    if let Some(e) = &failure {
        // Logged for whoever reads the log; the caller reports it too.
        warn!("stopping the server: {e}");
    }
    stop.cancel();
    if let Some(worker) = worker
        && let Err(e) = worker.await
    {
        keep_first(&mut failure, ServerError::Worker(e));
    }
    if let Some(api) = api {
        let ended = api.await;
        if !matches!(ended, Ok(Ok(()))) {
            keep_first(&mut failure, api_failure(ended));
        }
    }
    failure.map_or(Ok(()), Err)
}

/// The error of an API task that ended, however it ended.
fn api_failure(ended: Result<std::io::Result<()>, tokio::task::JoinError>) -> ServerError {
    ServerError::Api(match ended {
        Ok(Ok(())) => "it returned before shutdown".to_owned(),
        Ok(Err(e)) => e.to_string(),
        Err(e) if e.is_panic() => format!("it panicked: {}", panic_message(e.into_panic())),
        Err(e) => e.to_string(),
    })
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    match panic.downcast::<String>() {
        Ok(s) => *s,
        Err(panic) => match panic.downcast::<&'static str>() {
            Ok(s) => (*s).to_owned(),
            Err(_) => "(no message)".to_owned(),
        },
    }
}

/// Keep the first failure; log the later ones, which would otherwise be
/// lost.
fn keep_first(failure: &mut Option<ServerError>, e: ServerError) {
    match failure {
        Some(_) => error!("also: {e}"),
        None => *failure = Some(e),
    }
}
