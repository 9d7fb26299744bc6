"""Leveled log lines, captured into the task's log.

The host caps how many bytes of log a task may write; lines past the cap are
dropped. ``print`` output lands in the same log, without a level or fields.

>>> log.info("charged", order_id="A-1", amount_cents=1999)  # doctest: +SKIP
"""

from . import _bindings

DEBUG, INFO, WARN, ERROR = "debug", "info", "warn", "error"


def write(level, message, fields=()):
    """Write one line at ``level`` (``"debug"``, ``"info"``, ``"warn"``,
    ``"error"``) with ``fields``, key/value pairs kept beside the message."""
    wit = _bindings.module("log")
    pairs = [(str(k), str(v)) for k, v in (fields.items() if isinstance(fields, dict) else fields)]
    wit.write(wit.Level[level.upper()], str(message), pairs)


def debug(message, **fields):
    """Write a debug line; keyword arguments are its fields."""
    write(DEBUG, message, fields)


def info(message, **fields):
    """Write an info line; keyword arguments are its fields."""
    write(INFO, message, fields)


def warn(message, **fields):
    """Write a warning line; keyword arguments are its fields."""
    write(WARN, message, fields)


def error(message, **fields):
    """Write an error line; keyword arguments are its fields."""
    write(ERROR, message, fields)
