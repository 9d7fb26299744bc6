"""The asyncio client: the blocking client's calls, run in threads."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Dict, Iterable, Mapping, Optional

from ._client import Client, RunAt, _Stop


class AsyncClient:
    """:class:`Client`'s methods as coroutines, for asyncio code.

    Each call runs the blocking client's in the loop's default thread pool
    (``asyncio.to_thread``), so it holds a thread while it waits for its
    answer: size the pool (``loop.set_default_executor``) for the calls
    you run at once. A cancelled :meth:`wait` or :meth:`events` ends its
    thread's read at once (its socket is shut down).
    """

    def __init__(self, url: str, token: Optional[str] = None, timeout: float = 30.0) -> None:
        #: The blocking client the calls run on.
        self.sync = Client(url, token, timeout)

    def __repr__(self) -> str:
        return f"AsyncClient({self.sync.url!r})"

    async def submit(
        self,
        queue: str,
        task: str,
        payload: Any,
        idempotency_key: Optional[str] = None,
        max_attempts: Optional[int] = None,
        delay_ms: Optional[int] = None,
        run_at: Optional[RunAt] = None,
        timeout_ms: Optional[int] = None,
        expires_in_ms: Optional[int] = None,
        group: Optional[str] = None,
    ) -> Dict[str, Any]:
        """See :meth:`Client.submit`."""
        return await asyncio.to_thread(
            self.sync.submit,
            queue,
            task,
            payload,
            idempotency_key,
            max_attempts,
            delay_ms,
            run_at,
            timeout_ms,
            expires_in_ms,
            group,
        )

    async def submit_batch(self, queue: str, items: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
        """See :meth:`Client.submit_batch`."""
        return await asyncio.to_thread(self.sync.submit_batch, queue, list(items))

    async def status(self, queue: str, task_id: str) -> Dict[str, Any]:
        """See :meth:`Client.status`."""
        return await asyncio.to_thread(self.sync.status, queue, task_id)

    async def cancel(self, queue: str, task_id: str) -> Dict[str, Any]:
        """See :meth:`Client.cancel`."""
        return await asyncio.to_thread(self.sync.cancel, queue, task_id)

    async def wait(
        self, queue: str, task_id: str, timeout: float = 60.0, poll_interval: float = 1.0
    ) -> Dict[str, Any]:
        """See :meth:`Client.wait`."""
        stop = _Stop()
        try:
            return await asyncio.to_thread(
                self.sync._wait, queue, task_id, timeout, poll_interval, stop
            )
        except asyncio.CancelledError:
            stop.set()
            raise

    async def events(
        self, queue: str, since: Optional[str] = None, task_id: Optional[str] = None
    ) -> AsyncIterator[Dict[str, Any]]:
        """See :meth:`Client.events`: ``async for event in
        client.events(queue)``. Unlike the blocking one it connects when
        first iterated. Close it (``aclose()``, or ``contextlib.aclosing``)
        to end its stream at once."""
        stream = await asyncio.to_thread(self.sync.events, queue, since, task_id)
        try:
            while True:
                event = await asyncio.to_thread(next, stream, None)
                if event is None:
                    return
                yield event
        finally:
            stream.close()
