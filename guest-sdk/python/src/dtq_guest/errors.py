"""The errors a handler raises, and how they map onto the WIT ``handler-error``.

A :class:`RetryableError` makes the host retry the task with backoff until
its attempts run out (then it is dead-lettered); a :class:`FatalError` fails
the task at once. Any other exception that escapes a handler counts as
retryable, like ``?`` on any error in the Rust SDK; its traceback goes to the
task log.
"""

from enum import Enum


class Refusal(Enum):
    """Why a host import refused a request (:attr:`HandlerError.refusal`)."""

    #: The key is empty or too long (fatal).
    INVALID_KEY = "invalid-key"
    #: A value, or an operation's staged writes, larger than the host allows (fatal).
    VALUE_TOO_LARGE = "value-too-large"
    #: The stored value is not what the operation needs (retryable).
    WRONG_TYPE = "wrong-type"
    #: Redis could not be reached, or refused the request; nothing was written (retryable).
    UNAVAILABLE = "unavailable"
    #: An argument out of range: a TTL of 0 or too long, an operation inside another (fatal).
    INVALID_ARGUMENT = "invalid-argument"
    #: A write may or may not have taken effect (retryable).
    OUTCOME_UNKNOWN = "outcome-unknown"
    #: The idempotency claim was taken over or expired; nothing applied (retryable).
    CLAIM_LOST = "claim-lost"
    #: The write would take the namespace over its Redis budget (retryable).
    QUOTA_EXCEEDED = "quota-exceeded"


class HandlerError(Exception):
    """Why a handler call failed, and whether the host should try again.

    Raise :class:`RetryableError` or :class:`FatalError`; catch this class to
    handle both. ``message`` is what the host records for the task.
    """

    fatal = False

    def __init__(self, message, *, refusal=None):
        super().__init__(str(message))
        self.message = str(message)
        #: The :class:`Refusal` of a host import behind this error, if any.
        self.refusal = refusal

    @property
    def is_fatal(self):
        """Whether the host fails the task without retrying it."""
        return self.fatal

    def context(self, context):
        """The same error with ``context: `` in front of its message."""
        return type(self)(f"{context}: {self.message}", refusal=self.refusal)


class RetryableError(HandlerError):
    """A transient failure: the host retries the task with backoff."""

    fatal = False


class FatalError(HandlerError):
    """A permanent failure: the host marks the task FAILED without retrying."""

    fatal = True


# The message and kind of each host refusal, as the Rust SDK words them: a
# request that can never succeed is fatal, the rest retryable.
_HOST_ERRORS = {
    "InvalidKey": (Refusal.INVALID_KEY, FatalError, "{op}: invalid key: {v}"),
    "ValueTooLarge": (
        Refusal.VALUE_TOO_LARGE,
        FatalError,
        "{op}: {v} bytes is larger than the host allows",
    ),
    "WrongType": (Refusal.WRONG_TYPE, RetryableError, "{op}: value has the wrong type: {v}"),
    "Unavailable": (Refusal.UNAVAILABLE, RetryableError, "{op}: storage unavailable: {v}"),
    "InvalidArgument": (
        Refusal.INVALID_ARGUMENT,
        FatalError,
        "{op}: invalid argument: {v}",
    ),
    "OutcomeUnknown": (
        Refusal.OUTCOME_UNKNOWN,
        RetryableError,
        "{op}: outcome unknown, the write may or may not have applied: {v}",
    ),
    "ClaimLost": (Refusal.CLAIM_LOST, RetryableError, "{op}: claim lost: {v}"),
    "QuotaExceeded": (
        Refusal.QUOTA_EXCEEDED,
        RetryableError,
        "{op}: namespace quota exceeded: {v}",
    ),
}


def from_host(op, err):
    """The :class:`HandlerError` for ``err``, a WIT ``host-error`` of import ``op``."""
    case = type(err).__name__.rpartition("_")[2]
    refusal, kind, template = _HOST_ERRORS.get(
        case, (None, RetryableError, "{op}: {v}")
    )
    return kind(template.format(op=op, v=getattr(err, "value", err)), refusal=refusal)


def call_host(op, fn, *args):
    """Call the host import ``fn``; its WIT error becomes a :class:`HandlerError`."""
    from . import _bindings

    try:
        return fn(*args)
    except Exception as e:  # the bindings raise componentize_py_types.Err
        value = _bindings.err_value(e)
        if value is None:
            raise
        raise from_host(op, value) from None
