"""Unit tests of dtq_client that need no dtq: the event stream parser, the
request each call sends (against a stand-in HTTP server that records it and
answers as dtq would), error parsing, and wait's fallback to polling.

    python -m unittest discover -s clients/python/tests -p 'test_*.py'
"""

from __future__ import annotations

import datetime
import http.server
import json
import os
import sys
import threading
import time
import unittest
from typing import Any, Dict, List, Tuple

try:
    import dtq_client
except ImportError:  # run from the source tree, not installed
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    import dtq_client

from dtq_client import AsyncClient, Client, DtqError, WaitTimeout, segment, submission
from dtq_client._client import task_created_ms
from dtq_client._errors import error_from_answer
from dtq_client._sse import SseError, SseEvent, SseParser

TASK_ID = "019af1c2-3b4d-7e5f-8a9b-0c1d2e3f4a5b"


class SseParserTest(unittest.TestCase):
    def parse(self, *chunks: bytes) -> Tuple[List[SseEvent], SseParser]:
        parser = SseParser()
        events: List[SseEvent] = []
        for chunk in chunks:
            events.extend(parser.feed(chunk))
        return events, parser

    def test_events_as_the_api_sends_them(self) -> None:
        events, parser = self.parse(
            b": keep-alive\n\n",
            b'id: 1-0\nevent: QUEUED\ndata: {"task_id":"t"}\n\n',
            b"event: gap\ndata: {}\n\n",
        )
        self.assertEqual(
            events,
            [SseEvent("QUEUED", '{"task_id":"t"}', "1-0"), SseEvent("gap", "{}", None)],
        )
        self.assertEqual(parser.last_event_id, "1-0")

    def test_any_line_ending_split_anywhere(self) -> None:
        text = b"\xef\xbb\xbfid: 7\r\nevent: A\rdata: x\r\ndata:y\n\r\n"
        for cut in range(len(text) + 1):
            events, _ = self.parse(text[:cut], text[cut:])
            self.assertEqual(events, [SseEvent("A", "x\ny", "7")], cut)
        # One byte at a time too.
        events, _ = self.parse(*[text[i : i + 1] for i in range(len(text))])
        self.assertEqual(events, [SseEvent("A", "x\ny", "7")])

    def test_an_event_without_data_is_not_dispatched_but_keeps_its_id(self) -> None:
        events, parser = self.parse(b"id: 9\nevent: x\n\ndata\n\n")
        self.assertEqual(events, [SseEvent("message", "", None)])
        self.assertEqual(parser.last_event_id, "9")

    def test_an_endless_line_is_refused(self) -> None:
        parser = SseParser()
        with self.assertRaises(SseError):
            for _ in range(20):
                parser.feed(b"x" * 65536)


class HelpersTest(unittest.TestCase):
    def test_segment_escapes_every_reserved_character(self) -> None:
        self.assertEqual(segment("a/b?c#d %e"), "a%2Fb%3Fc%23d%20%25e")
        self.assertEqual(segment("é"), "%C3%A9")
        self.assertEqual(segment("plain-name_1.2"), "plain-name_1.2")

    def test_task_created_ms_reads_the_uuid7(self) -> None:
        self.assertEqual(task_created_ms(TASK_ID), 0x019AF1C23B4D)
        self.assertEqual(task_created_ms(TASK_ID + ".3"), 0x019AF1C23B4D)
        self.assertIsNone(task_created_ms("not-a-uuid"))
        self.assertIsNone(task_created_ms("019af1c2-3b4d-4e5f-8a9b-0c1d2e3f4a5b"))

    def test_submission_has_the_api_field_names(self) -> None:
        at = datetime.datetime(2026, 12, 3, 14, 0, tzinfo=datetime.timezone.utc)
        self.assertEqual(
            submission("echo", {"n": 1}, "k", 3, None, at, 500, 9000, "customer-7"),
            {
                "task": "echo",
                "payload": {"n": 1},
                "idempotency_key": "k",
                "max_attempts": 3,
                "run_at": 1796306400000,
                "timeout_ms": 500,
                "expires_in_ms": 9000,
                "group": "customer-7",
            },
        )
        self.assertEqual(submission("echo", None), {"task": "echo", "payload": None})
        with self.assertRaises(ValueError):
            submission("echo", 1, run_at=datetime.datetime(2026, 1, 1))

    def test_the_api_error_body_becomes_a_dtq_error(self) -> None:
        body = {"error": {"code": "UNKNOWN_TASK", "message": "no task", "details": {"t": 1}}}
        e = error_from_answer(400, json.dumps(body).encode())
        self.assertIsInstance(e, DtqError)
        self.assertEqual((e.code, e.status, e.details, str(e)), ("UNKNOWN_TASK", 400, {"t": 1}, "no task"))
        self.assertIn("UNKNOWN_TASK", repr(e))

    def test_an_answer_without_the_error_body_is_an_invalid_response(self) -> None:
        e = error_from_answer(502, b"<html>Bad Gateway</html>")
        self.assertEqual((e.code, e.status, e.details), ("INVALID_RESPONSE", 502, {}))
        self.assertIn("Bad Gateway", str(e))

    def test_wait_timeout_is_a_dtq_error_and_a_timeout_error(self) -> None:
        self.assertTrue(issubclass(WaitTimeout, DtqError))
        self.assertTrue(issubclass(WaitTimeout, TimeoutError))

    def test_only_http_urls(self) -> None:
        with self.assertRaises(ValueError):
            Client("localhost:8080")


class StandIn(http.server.ThreadingHTTPServer):
    """An HTTP server that records each request and answers with the
    `(status, body)` its `answer` callable gives."""

    daemon_threads = True

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.requests: List[Dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(http.server.BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args: Any) -> None:
        pass

    def handle_one(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        request = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": json.loads(raw) if raw else None,
        }
        self.server.requests.append(request)
        status, body = self.server.answer(request)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = handle_one


def api_error(status: int, code: str, details: Any = None) -> Tuple[int, Any]:
    return status, {"error": {"code": code, "message": f"{code} here", "details": details or {}}}


class RequestsTest(unittest.TestCase):
    def test_paths_are_encoded_and_the_token_and_key_sent(self) -> None:
        server = StandIn(lambda r: (202, {"task_id": TASK_ID, "duplicate": False}))
        self.addCleanup(server.stop)
        client = Client(server.url + "/prefix/", token="s3cret")
        answer = client.submit("q", "echo", {"n": 1}, idempotency_key="order-1", delay_ms=5)
        self.assertEqual(answer, {"task_id": TASK_ID, "duplicate": False})
        client.submit("q", "echo", [1], idempotency_key="clé")
        client.status("q", "a/b?c")
        client.cancel("q", "x y")
        client.submit_batch("q", [submission("echo", 1), {"task": "echo", "run_at": "2026-12-03T14:00:00Z"}])
        first, second, status, cancel, batch = server.requests
        self.assertEqual(first["path"], "/prefix/v1/queues/q/tasks")
        self.assertEqual(first["headers"]["authorization"], "Bearer s3cret")
        self.assertEqual(first["headers"]["idempotency-key"], "order-1")
        self.assertEqual(first["headers"]["content-type"], "application/json")
        self.assertEqual(first["body"], {"task": "echo", "payload": {"n": 1}, "delay_ms": 5})
        # A key a header cannot carry goes in the body.
        self.assertNotIn("idempotency-key", second["headers"])
        self.assertEqual(second["body"]["idempotency_key"], "clé")
        self.assertEqual((status["method"], status["path"]), ("GET", "/prefix/v1/queues/q/tasks/a%2Fb%3Fc"))
        self.assertEqual((cancel["method"], cancel["path"]), ("POST", "/prefix/v1/queues/q/tasks/x%20y/cancel"))
        self.assertEqual(batch["path"], "/prefix/v1/queues/q/tasks/batch")
        self.assertEqual(
            batch["body"],
            {"tasks": [{"task": "echo", "payload": 1}, {"task": "echo", "run_at": "2026-12-03T14:00:00Z"}]},
        )

    def test_an_error_answer_raises_its_code_status_and_details(self) -> None:
        server = StandIn(lambda r: api_error(409, "IDEMPOTENCY_IN_PROGRESS", {"task_id": TASK_ID}))
        self.addCleanup(server.stop)
        with self.assertRaises(DtqError) as caught:
            Client(server.url).submit("q", "echo", 1, idempotency_key="k")
        e = caught.exception
        self.assertEqual((e.code, e.status, e.details), ("IDEMPOTENCY_IN_PROGRESS", 409, {"task_id": TASK_ID}))
        self.assertEqual(str(e), "IDEMPOTENCY_IN_PROGRESS here")

    def test_no_server_is_a_connection_failure(self) -> None:
        server = StandIn(lambda r: (200, {}))
        url = server.url
        server.stop()
        with self.assertRaises(DtqError) as caught:
            Client(url, timeout=2).status("q", "t")
        self.assertEqual((caught.exception.code, caught.exception.status), ("CONNECTION_FAILED", None))

    def test_wait_polls_when_events_are_off(self) -> None:
        polls = []

        def answer(r: Dict[str, Any]) -> Tuple[int, Any]:
            if "/events" in r["path"]:
                return api_error(409, "EVENTS_OFF")
            polls.append(time.monotonic())
            status = "SUCCEEDED" if len(polls) >= 3 else "RUNNING"
            return 200, {"task_id": TASK_ID, "status": status, "result": 42}

        server = StandIn(answer)
        self.addCleanup(server.stop)
        task = Client(server.url).wait("q", TASK_ID, timeout=10, poll_interval=0.05)
        self.assertEqual((task["status"], task["result"]), ("SUCCEEDED", 42))
        self.assertEqual(len(polls), 3)
        events = server.requests[0]
        self.assertEqual(events["path"], f"/v1/queues/q/events?task_id={TASK_ID}")
        self.assertEqual(events["headers"]["last-event-id"], f"{0x019AF1C23B4D - 2000}-0")
        self.assertEqual(events["headers"]["accept"], "text/event-stream")
        with self.assertRaises(DtqError) as caught:
            Client(server.url).events("q")
        self.assertEqual((caught.exception.code, caught.exception.status), ("EVENTS_OFF", 409))

    def test_wait_gives_up_naming_the_task(self) -> None:
        server = StandIn(
            lambda r: api_error(409, "EVENTS_OFF") if "/events" in r["path"] else (200, {"status": "QUEUED"})
        )
        self.addCleanup(server.stop)
        start = time.monotonic()
        with self.assertRaises(WaitTimeout) as caught:
            Client(server.url).wait("q", TASK_ID, timeout=0.3, poll_interval=0.05)
        self.assertLess(time.monotonic() - start, 3)
        e = caught.exception
        self.assertEqual((e.code, e.details["task_id"], e.details["status"]), ("WAIT_TIMEOUT", TASK_ID, "QUEUED"))
        self.assertIn(TASK_ID, str(e))

    def test_the_async_client_makes_the_same_calls(self) -> None:
        import asyncio

        server = StandIn(lambda r: (200, {"task_id": TASK_ID, "status": "SUCCEEDED", "duplicate": True}))
        self.addCleanup(server.stop)

        async def run() -> None:
            client = AsyncClient(server.url)
            self.assertTrue((await client.submit("q", "echo", 1, idempotency_key="k"))["duplicate"])
            self.assertEqual((await client.wait("q", TASK_ID, timeout=5))["status"], "SUCCEEDED")

        asyncio.run(run())
        self.assertEqual(server.requests[0]["headers"]["idempotency-key"], "k")


if __name__ == "__main__":
    unittest.main()
