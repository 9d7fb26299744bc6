//! Completing attempts (`lua/complete.lua`): a batch of completions, one
//! script call per queue, pipelined into one round trip.

use super::scripts::{Argv, ArgvLayout};
use super::{
    Code, CompleteOutcome, Completion, CompletionKind, GROUP, QueueKeys, Store, StoreError, flag,
    unexpected,
};

/// `complete.lua`'s ARGV by name; then, from `COMPLETIONS`, each
/// completion's values ([`COMPLETION_ARGV`]).
pub(super) static COMPLETE_ARGV: ArgvLayout = ArgvLayout {
    script: "complete",
    prefix: "ARG_",
    first: 1,
    names: &["GROUP", "RETENTION", "EVENTS_MAX_LEN"],
    rest: Some("COMPLETIONS"),
};

/// One completion's values in `complete.lua`'s ARGV, by their offsets
/// from where it starts; then, from `OPTIONAL`, those only some outcomes
/// send (see the script's header).
pub(super) static COMPLETION_ARGV: ArgvLayout = ArgvLayout {
    script: "complete",
    prefix: "C_",
    first: 0,
    names: &[
        "TASK_ID",
        "MSG_ID",
        "OUTCOME",
        "DETAIL",
        "LOG",
        "NOW",
        "HAS_KEY",
        "DIGEST",
        "CARRIED_AT",
    ],
    rest: Some("OPTIONAL"),
};

impl Store {
    /// Write a batch of completions: one `complete` script call per queue
    /// (each atomic for all its completions), pipelined into one round trip.
    /// Outcomes come back in the order of `completions`.
    pub async fn complete(
        &self,
        completions: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        if completions.is_empty() {
            return Ok(Vec::new());
        }
        // Indexes into `completions`, grouped by queue.
        let mut by_queue: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, c) in completions.iter().enumerate() {
            match by_queue.iter_mut().find(|(q, _)| *q == c.queue) {
                Some((_, batch)) => batch.push(i),
                None => by_queue.push((&c.queue, vec![i])),
            }
        }
        let calls: Vec<_> = by_queue
            .iter()
            .map(|(queue, batch)| {
                let batch: Vec<&Completion> = batch.iter().map(|&i| &completions[i]).collect();
                self.completion_call(queue, &batch)
            })
            .collect();
        let replies: Vec<String> = if self.backend.is_cluster() {
            // A pipeline reaches one node: each queue's call goes on its
            // own (its slot's shard), all of them at once.
            futures::future::try_join_all(
                calls.into_iter().map(|call| self.complete_pipeline([call])),
            )
            .await?
            .into_iter()
            .flatten()
            .collect()
        } else {
            self.complete_pipeline(calls).await?
        };
        let mut outcomes: Vec<Option<CompleteOutcome>> = vec![None; completions.len()];
        for ((_, batch), reply) in by_queue.iter().zip(replies) {
            // A word per completion: its status, or `code:status` for a
            // code other than OK (complete.lua).
            let mut reply = reply.split(' ');
            for &i in batch {
                let word = reply.next().ok_or_else(|| {
                    StoreError::Protocol(format!(
                        "complete answered fewer than {} outcomes",
                        batch.len()
                    ))
                })?;
                // `^<parent>` after the status: a child that ended.
                let (word, parent) = word
                    .split_once('^')
                    .map_or((word, None), |(w, p)| (w, Some(p)));
                let (code, status) = match word.split_once(':') {
                    None => (Code::Ok, word),
                    Some((code, status)) => {
                        let known = code.parse().ok().and_then(Code::from_i64);
                        let code = known.ok_or_else(|| {
                            StoreError::Protocol(format!("complete answered {word:?}"))
                        })?;
                        (code, status)
                    }
                };
                outcomes[i] = Some(match (code, parent) {
                    (Code::Ok, Some(parent)) => CompleteOutcome::Ended {
                        status: status.parse()?,
                        parent: parent.to_owned(),
                    },
                    (Code::Ok, None) => CompleteOutcome::Done(status.parse()?),
                    (Code::Stale, _) => CompleteOutcome::Stale(status.to_owned()),
                    (other, _) => return Err(unexpected("complete", other)),
                });
            }
            if reply.next().is_some() {
                return Err(StoreError::Protocol(format!(
                    "complete answered more than {} outcomes",
                    batch.len()
                )));
            }
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.ok_or_else(|| StoreError::Protocol("complete returned too few outcomes".into()))
            })
            .collect()
    }

    /// Run `calls` of the complete script in one pipeline: one reply each,
    /// in order.
    async fn complete_pipeline(
        &self,
        calls: impl IntoIterator<Item = redis::Cmd>,
    ) -> Result<Vec<String>, StoreError> {
        let mut pipe = redis::pipe();
        for call in calls {
            pipe.add_command(call);
        }
        match self
            .trip("complete", pipe.query_async(&mut self.conn.clone()))
            .await
        {
            Ok(replies) => Ok(replies),
            // The scripts were flushed (a restart or failover): load them and
            // try once more. EVALSHA of a missing script runs nothing.
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.load_scripts().await?;
                Ok(self
                    .trip("complete", pipe.query_async(&mut self.conn.clone()))
                    .await?)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The `complete` call for one queue's batch, as the EVALSHA it is:
    /// written straight into one command buffer, where a
    /// `ScriptInvocation` would hold each argument in a buffer of its own
    /// and copy them all into the command when sent. A missing script is
    /// loaded by [`Store::complete_pipeline`].
    fn completion_call(&self, queue: &str, batch: &[&Completion]) -> redis::Cmd {
        let keys = QueueKeys::new(queue);
        let keyed = batch.iter().filter(|c| c.idempotency_key.is_some()).count();
        let staging = batch.iter().filter(|c| c.stages()).count();
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.scripts.complete.get_hash())
            .arg(7 + batch.len() + keyed + staging)
            .arg(&keys.stream)
            .arg(&keys.delayed)
            .arg(&keys.dlq)
            .arg(&keys.events)
            .arg(keys.flows())
            .arg(keys.settle())
            .arg(keys.waiting());
        for c in batch {
            cmd.arg(keys.task(&c.task_id));
        }
        // Only the completions with a key name a record (complete.lua),
        // and only those that stage or wait their flow.
        for key in batch.iter().filter_map(|c| c.idempotency_key.as_deref()) {
            cmd.arg(keys.idempotency(Some(key)));
        }
        for c in batch.iter().filter(|c| c.stages()) {
            cmd.arg(keys.flow(&c.task_id));
        }
        Argv::new(&mut cmd, &COMPLETE_ARGV)
            .put("GROUP", GROUP)
            .put("RETENTION", self.settings.task_retention_s)
            .put("EVENTS_MAX_LEN", self.settings.events_max_len)
            .done();
        for c in batch {
            let carried_at = c.carried_at.filter(|_| c.attempt == 1);
            let argv = Argv::new(&mut cmd, &COMPLETION_ARGV)
                .put("TASK_ID", &c.task_id)
                .put("MSG_ID", &c.msg_id)
                .put("OUTCOME", c.outcome())
                .put("DETAIL", &c.detail)
                .put("LOG", &c.log)
                .put("NOW", c.now)
                .put("HAS_KEY", flag(c.idempotency_key.is_some()))
                .put("DIGEST", c.digest.as_deref().unwrap_or(""));
            let call = match carried_at {
                Some(at) => argv.put("CARRIED_AT", at),
                None => argv.put("CARRIED_AT", ""),
            }
            .done();
            // Each sends only what its outcome reads (complete.lua): the
            // attempt unless it is a carried one (attempt 1), the retry
            // time only for a failed attempt, the defer limit only for a
            // deferral.
            match (carried_at, c.kind) {
                (Some(_), _) => {}
                (None, CompletionKind::Expired) => {
                    call.arg("");
                }
                (None, _) => {
                    call.arg(c.attempt);
                }
            }
            match c.kind {
                CompletionKind::Retry | CompletionKind::Lost => {
                    call.arg(c.retry_at);
                }
                CompletionKind::Defer => {
                    call.arg(c.defer_limit_ms);
                }
                _ => {}
            }
            // The staged submissions of a success that staged, or a wait.
            if c.stages() {
                call.arg(c.staged.len());
                for staged in &c.staged {
                    call.arg(staged.as_str());
                }
            }
        }
        cmd
    }
}
