"""How far the running call is, for whoever watches the task."""

from . import _bindings


def progress(fraction, message=""):
    """Report that the call is ``fraction`` (0 to 1) done, with a ``message``
    for people: the task's JSON shows it (``progress``: ``fraction``,
    ``message``, ``updated_at``) while the task runs and after, as does its
    page on the dashboard.

    Report as often as is handy, in a loop if need be: the host keeps the
    latest report and writes it at most every 250 ms (and the last one when
    the call ends), so a report never waits on Redis. It never fails for its
    values: a fraction below 0 (or NaN) is taken as 0, above 1 as 1, and a
    message is cut to 1024 bytes. ``fraction`` must be a number.

    >>> progress(0.5, "half of the images resized")  # doctest: +SKIP
    """
    _bindings.module("progress").report(float(fraction), str(message))
