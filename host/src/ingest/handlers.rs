//! Whether a submission's task has a handler, and the defaults its
//! operator deployed it with.
//!
//! The submission path asks through [`Handlers`], which its caller
//! implements (the API, from the handler registry), so that it needs
//! nothing of the deploy side but this answer.

use std::collections::HashMap;
use std::future::Future;

use super::validate::validate_task_name;
use super::{IngestError, SubmitRequest};

/// A deployed handler, as a submission of its task sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deployed {
    /// The operator's default attempts for the task, set at deploy: what
    /// a submission that does not say gets.
    pub max_attempts: Option<u32>,
}

/// Where the submission path learns which tasks are deployed.
pub trait Handlers: Sync {
    /// What fails a lookup, as the caller answers it; an [`IngestError`]
    /// of the submission becomes one too.
    type Error: From<IngestError> + Send;

    /// `task`'s handler, if one is deployed.
    fn deployed(
        &self,
        task: &str,
    ) -> impl Future<Output = Result<Option<Deployed>, Self::Error>> + Send;
}

/// Give `req` the defaults of its task's handler, when one is deployed;
/// a field the submission sets wins.
pub(super) fn apply(req: &mut SubmitRequest, deployed: Option<Deployed>) {
    if let Some(deployed) = deployed {
        req.max_attempts = req.max_attempts.or(deployed.max_attempts);
    }
}

/// Look up each task name of a batch's `items` once and give every item
/// its handler's defaults, as a single submission gets them. Returns what
/// each name resolved to. Names that cannot be valid are not looked up:
/// their items fail on the name.
pub(super) async fn apply_to_batch<H: Handlers>(
    handlers: &H,
    items: &mut [Result<SubmitRequest, IngestError>],
) -> Result<HashMap<String, Option<Deployed>>, H::Error> {
    let mut known: HashMap<String, Option<Deployed>> = HashMap::new();
    for req in items.iter_mut().flatten() {
        if validate_task_name(&req.task).is_err() {
            continue;
        }
        let deployed = match known.get(&req.task) {
            Some(deployed) => *deployed,
            None => {
                let deployed = handlers.deployed(&req.task).await?;
                known.insert(req.task.clone(), deployed);
                deployed
            }
        };
        apply(req, deployed);
    }
    Ok(known)
}
