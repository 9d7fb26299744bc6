"""A namespaced slice of Redis.

Every key is a suffix: the host stores it under ``dtq:guest:{<namespace>}:<key>``,
where the namespace is the handler's (its task name unless ``@task`` names
one). No key a handler names reaches outside it.

Refusals raise :class:`~dtq_guest.HandlerError` by whether trying again can
help: an invalid key or a value larger than the host allows is fatal; Redis
being unavailable, or a key holding a value of the wrong type, is retryable.

>>> visits = kv.incr("visits")            # doctest: +SKIP
>>> kv.set("last-visit", str(visits))     # doctest: +SKIP
"""

from . import _bindings
from .errors import call_host


def _wit():
    return _bindings.module("kv")


def get(key):
    """The value of ``key`` (a str), or None when it does not exist."""
    return call_host("kv get", _wit().get, key)


def set(key, value):  # noqa: A001 - the Redis name
    """Set ``key`` to ``value``, replacing any value and removing any TTL."""
    set_with(key, value)


def set_nx(key, value):
    """Set ``key`` to ``value`` only if it does not exist; whether it was written."""
    return set_with(key, value, only_if_absent=True)


def set_with(key, value, *, only_if_absent=False, expire_seconds=None):
    """Set ``key`` with options (Redis ``NX`` and ``EX``); False when
    ``only_if_absent`` was asked and the key existed, True when written."""
    wit = _wit()
    options = wit.SetOptions(only_if_absent=only_if_absent, expire_seconds=expire_seconds)
    return call_host("kv set", wit.set, key, str(value), options)


def incr(key):
    """Add 1 to the integer at ``key`` (missing counts as 0); the new value."""
    return incr_by(key, 1)


def incr_by(key, delta):
    """Add ``delta`` to the integer at ``key`` (missing counts as 0); the new value."""
    return call_host("kv incr-by", _wit().incr_by, key, delta)


def delete(key):
    """Delete ``key``; whether it existed. (``del`` is a Python keyword.)"""
    return call_host("kv del", _wit().del_, key)


def expire(key, seconds):
    """Expire ``key`` after ``seconds``; whether the key exists."""
    return call_host("kv expire", _wit().expire, key, seconds)


def exists(key):
    """Whether ``key`` exists."""
    return call_host("kv exists", _wit().exists, key)
