"""What the host tells a handler about the call it is running."""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Context:
    """The task a handler call runs, as the host describes it."""

    #: The task's unique id, stable across retries.
    task_id: str
    #: The queue the task was submitted to.
    queue: str
    #: The task name; it selects the handler module.
    task_name: str
    #: The attempt this call is, starting at 1.
    attempt: int
    #: Attempts the task has in all before it is dead-lettered.
    max_attempts: int
    #: The submission's idempotency key, if it carried one.
    idempotency_key: Optional[str]
    #: Milliseconds left before the host interrupts this call.
    deadline_ms: int

    @property
    def is_last_attempt(self):
        """Whether a retryable error from this call dead-letters the task."""
        return self.attempt >= self.max_attempts

    @classmethod
    def _from_wit(cls, ctx):
        return cls(
            task_id=ctx.task_id,
            queue=ctx.queue,
            task_name=ctx.task_name,
            attempt=ctx.attempt,
            max_attempts=ctx.max_attempts,
            idempotency_key=ctx.idempotency_key,
            deadline_ms=ctx.deadline_ms,
        )
