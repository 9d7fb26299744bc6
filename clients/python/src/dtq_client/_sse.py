"""A Server-Sent Events parser: bytes in, events out.

The format is a few rules (lines of ``field: value``, a blank line ends an
event, ``:`` starts a comment, lines end with LF, CRLF or CR), read as the
HTML standard's "event stream interpretation" says. ``retry:`` is ignored:
reconnecting is the caller's.
"""

from __future__ import annotations

import re
from typing import List, NamedTuple, Optional

#: The longest line read, bytes: a server that never ends a line cannot make
#: the parser hold more.
MAX_LINE_BYTES = 1 << 20

_EOL = re.compile(rb"\r\n|\r|\n")


class SseEvent(NamedTuple):
    """One event of the stream."""

    #: Its ``event:`` name; ``message`` when it has none.
    event: str
    #: Its ``data:`` lines, joined by ``\\n``.
    data: str
    #: Its ``id:``, if it carried one.
    id: Optional[str]


class SseError(Exception):
    """The stream cannot be read on (a line longer than MAX_LINE_BYTES)."""


class SseParser:
    """The event stream parser, fed the body as it arrives."""

    def __init__(self) -> None:
        self._buf = bytearray()
        # The last chunk ended with CR: an LF first in the next one ends
        # the same line.
        self._after_cr = False
        self._started = False
        self._event: Optional[str] = None
        self._data: List[str] = []
        self._has_data = False
        self._id: Optional[str] = None
        #: The id of the last event that carried one: what a client sends as
        #: ``Last-Event-ID`` when it reconnects.
        self.last_event_id: Optional[str] = None

    def feed(self, chunk: bytes) -> List[SseEvent]:
        """Read ``chunk``; the events it completes."""
        if self._after_cr:
            self._after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        self._buf += chunk
        events: List[SseEvent] = []
        pos = 0
        for m in _EOL.finditer(self._buf):
            line = bytes(self._buf[pos : m.start()])
            pos = m.end()
            if m.group() == b"\r" and pos == len(self._buf):
                self._after_cr = True
            self._line(line, events)
        del self._buf[:pos]
        if len(self._buf) > MAX_LINE_BYTES:
            raise SseError(f"the event stream has a line longer than {MAX_LINE_BYTES} bytes")
        return events

    def _line(self, raw: bytes, events: List[SseEvent]) -> None:
        if not self._started:
            self._started = True
            if raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
        if not raw:
            self._dispatch(events)
            return
        line = raw.decode("utf-8", "replace")
        if line.startswith(":"):
            return
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
            self._has_data = True
        elif field == "id" and "\0" not in value:
            self._id = value

    def _dispatch(self, events: List[SseEvent]) -> None:
        event, self._event = self._event, None
        event_id, self._id = self._id, None
        if event_id is not None:
            self.last_event_id = event_id
        if not self._has_data:
            return
        self._has_data = False
        data, self._data = "\n".join(self._data), []
        events.append(SseEvent(event or "message", data, event_id))
