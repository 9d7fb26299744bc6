"""Unit tests of :mod:`dtq_guest.tasks` and the handler wrapper's part of
:class:`~dtq_guest.tasks.WaitForChildren`, against stand-ins for the
bindings componentize-py generates (``wit_world``, ``componentize_py_types``),
in an ordinary Python:

    python -m unittest discover -s guest-sdk/python/tests
"""

import sys
import types
import unittest
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


# -- Stand-ins for the generated bindings, installed before the SDK is imported.


class Err(Exception):
    """``componentize_py_types.Err``: a WIT error, raised."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value


@dataclass
class SubmitOptions:
    key: Optional[str]
    delay_ms: Optional[int]
    max_attempts: Optional[int]
    group: Optional[str]
    child: bool


@dataclass
class WitChild:
    task_id: str
    queue: str
    task: str
    status: str
    result: Optional[str]
    error: Optional[str]


@dataclass
class HostError_InvalidArgument:  # noqa: N801 - the generated name
    value: str


@dataclass
class HostError_ValueTooLarge:  # noqa: N801
    value: int


@dataclass
class HostError_Unavailable:  # noqa: N801
    value: str


@dataclass
class HandlerError_Retryable:  # noqa: N801
    value: str


@dataclass
class HandlerError_Fatal:  # noqa: N801
    value: str


class Host:
    """What the stand-in ``tasks`` import was asked, and what it answers."""

    def reset(self):
        self.submitted = []
        self.children = []
        self.waited = 0
        self.refusal = None

    def submit(self, queue, task, payload, options):
        if self.refusal is not None:
            raise Err(self.refusal)
        self.submitted.append((queue, task, payload, options))
        return f"id-{len(self.submitted)}"

    def list_children(self):
        if self.refusal is not None:
            raise Err(self.refusal)
        return self.children

    def wait_for_children(self):
        self.waited += 1


HOST = Host()


def _install_bindings():
    cpt = types.ModuleType("componentize_py_types")
    cpt.Err = Err
    tasks = types.ModuleType("wit_world.imports.tasks")
    tasks.SubmitOptions = SubmitOptions
    tasks.Child = WitChild
    tasks.submit = lambda *args: HOST.submit(*args)
    tasks.children = lambda: HOST.list_children()
    tasks.wait_for_children = lambda: HOST.wait_for_children()
    handler_types = types.ModuleType("wit_world.imports.dtq_handler_types")
    handler_types.HandlerError_Retryable = HandlerError_Retryable
    handler_types.HandlerError_Fatal = HandlerError_Fatal
    world = types.ModuleType("wit_world")
    imports = types.ModuleType("wit_world.imports")
    world.imports = imports
    imports.tasks = tasks
    imports.dtq_handler_types = handler_types
    sys.modules.update(
        {
            "componentize_py_types": cpt,
            "wit_world": world,
            "wit_world.imports": imports,
            "wit_world.imports.tasks": tasks,
            "wit_world.imports.dtq_handler_types": handler_types,
        }
    )


_install_bindings()

from dtq_guest import (  # noqa: E402 - after the stand-ins
    FatalError,
    HandlerError,
    RawJson,
    Refusal,
    RetryableError,
    handler,
    tasks,
)


class SubmitTest(unittest.TestCase):
    def setUp(self):
        HOST.reset()

    def test_submit_serializes_like_results_and_returns_the_id(self):
        id = tasks.submit("emails", "send", {"to": "é", "n": [1, 2]})
        self.assertEqual(id, "id-1")
        queue, task, payload, options = HOST.submitted[0]
        self.assertEqual((queue, task, payload), ("emails", "send", '{"to":"é","n":[1,2]}'))
        self.assertEqual(options, SubmitOptions(None, None, None, None, False))

    def test_options(self):
        tasks.submit(
            "q", "t", None, key="k", delay_ms=2**64 - 1, max_attempts=5, group="g", child=True
        )
        payload, options = HOST.submitted[0][2:]
        self.assertEqual(payload, "null")
        self.assertEqual(options, SubmitOptions("k", 2**64 - 1, 5, "g", True))

    def test_raw_json_goes_as_it_is(self):
        tasks.submit("q", "t", RawJson('{ "a" : 1 }'))
        self.assertEqual(HOST.submitted[0][2], '{ "a" : 1 }')

    def test_a_payload_that_does_not_serialize_is_fatal(self):
        with self.assertRaises(FatalError) as caught:
            tasks.submit("q", "t", {"when": object()})
        self.assertIn("tasks submit: cannot serialize the payload", caught.exception.message)
        self.assertEqual(HOST.submitted, [])

    def test_numbers_out_of_range_are_refused_before_the_host(self):
        for kwargs in (
            {"delay_ms": -1},
            {"delay_ms": 2**64},
            {"delay_ms": 1.5},
            {"delay_ms": True},
            {"max_attempts": 2**32},
            {"max_attempts": "3"},
        ):
            with self.subTest(**kwargs), self.assertRaises(FatalError) as caught:
                tasks.submit("q", "t", {}, **kwargs)
            self.assertEqual(caught.exception.refusal, Refusal.INVALID_ARGUMENT)
        self.assertEqual(HOST.submitted, [])

    def test_host_refusals_map_like_kv(self):
        HOST.refusal = HostError_InvalidArgument("task t on queue q is not granted")
        with self.assertRaises(FatalError) as caught:
            tasks.submit("q", "t", {})
        self.assertEqual(
            caught.exception.message,
            "tasks submit: invalid argument: task t on queue q is not granted",
        )
        self.assertEqual(caught.exception.refusal, Refusal.INVALID_ARGUMENT)

        HOST.refusal = HostError_ValueTooLarge(2_000_000)
        with self.assertRaises(FatalError) as caught:
            tasks.submit("q", "t", {})
        self.assertEqual(caught.exception.refusal, Refusal.VALUE_TOO_LARGE)

        HOST.refusal = HostError_Unavailable("down")
        with self.assertRaises(RetryableError) as caught:
            tasks.children()
        self.assertEqual(caught.exception.message, "tasks children: storage unavailable: down")


class ChildrenTest(unittest.TestCase):
    def setUp(self):
        HOST.reset()

    def test_children_parse_results(self):
        HOST.children = [
            WitChild("c1", "q", "t", "SUCCEEDED", '{"n":1}', None),
            WitChild("c2", "q", "t", "FAILED", None, "boom"),
        ]
        self.assertEqual(
            tasks.children(),
            [
                tasks.Child("c1", "q", "t", "SUCCEEDED", {"n": 1}, None),
                tasks.Child("c2", "q", "t", "FAILED", None, "boom"),
            ],
        )

    def test_no_children(self):
        self.assertEqual(tasks.children(), [])

    def test_a_result_that_does_not_parse_is_fatal(self):
        HOST.children = [WitChild("c1", "q", "t", "SUCCEEDED", "{", None)]
        with self.assertRaises(FatalError):
            tasks.children()


class WaitForChildrenTest(unittest.TestCase):
    CTX = types.SimpleNamespace(
        task_id="t-1",
        queue="q",
        task_name="parent",
        attempt=1,
        max_attempts=3,
        idempotency_key=None,
        deadline_ms=30_000,
    )

    def setUp(self):
        HOST.reset()
        handler._registered = None

    def tearDown(self):
        handler._registered = None

    def run_handler(self, fn):
        handler.task("parent")(fn)
        try:
            return handler.WitWorld().handle(self.CTX, "{}")
        except Err as e:
            return e.value

    def test_it_is_a_retryable_handler_error(self):
        err = tasks.WaitForChildren()
        self.assertIsInstance(err, HandlerError)
        self.assertFalse(err.is_fatal)
        self.assertEqual(err.message, "waiting for children")
        self.assertIsInstance(err.context("fan out"), tasks.WaitForChildren)

    def test_escaping_the_handler_asks_the_host_to_wait(self):
        def parent(payload):
            tasks.submit("q", "child", {"n": 1}, child=True)
            raise tasks.WaitForChildren()

        self.assertEqual(self.run_handler(parent), HandlerError_Retryable("waiting for children"))
        self.assertEqual(HOST.waited, 1)

    def test_async_handlers_too(self):
        async def parent(payload):
            raise tasks.WaitForChildren()

        self.assertEqual(self.run_handler(parent), HandlerError_Retryable("waiting for children"))
        self.assertEqual(HOST.waited, 1)

    def test_caught_it_does_nothing(self):
        def parent(payload):
            try:
                raise tasks.WaitForChildren()
            except HandlerError:
                return {"caught": True}

        self.assertEqual(self.run_handler(parent), '{"caught":true}')
        self.assertEqual(HOST.waited, 0)

    def test_other_errors_do_not_wait(self):
        def parent(payload):
            raise RetryableError("busy")

        self.assertEqual(self.run_handler(parent), HandlerError_Retryable("busy"))
        self.assertEqual(HOST.waited, 0)


if __name__ == "__main__":
    unittest.main()
