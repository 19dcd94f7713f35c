"""Which worker holds each stored response (OpenAI's Responses API).

A worker keeps the responses it created in its own memory: a later ``previous_response_id``,
retrieve, cancel, input_items or delete means something only to that worker. The gateway
learns each response's id from the answer it relays (``OwnerTap``) and routes follow-ups
there (``gateway.api_routes``).

``ResponseOwners`` is the whole interface to that memory, ``remember`` and ``where``. In a
group of gateway processes and replicas each one's ``remember`` is told to the others
(``on_remember``; ``gateway.peers`` applies theirs with ``learn``), so a follow-up finds its
worker through any of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import msgspec

DEFAULT_CAPACITY = 100_000  # ids remembered; ~150 bytes each
_SCAN_LIMIT = 65_536  # bytes of a stream searched for its first event naming the response


class ResponseOwners:
    """Response id -> worker url, the least recently used forgotten past ``capacity``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = max(1, capacity)
        self._urls: OrderedDict[str, str] = OrderedDict()
        self.on_remember: Callable[[str, str], None] | None = None  # tells the group's peers

    def remember(self, response_id: str, url: str) -> None:
        """A worker of this process answered with a stored response ``response_id``."""
        self.learn(response_id, url)
        if self.on_remember is not None:
            self.on_remember(response_id, url)

    def learn(self, response_id: str, url: str) -> None:
        """``url`` holds ``response_id`` (here, or by a peer's word)."""
        self._urls[response_id] = url
        self._urls.move_to_end(response_id)
        while len(self._urls) > self.capacity:
            self._urls.popitem(last=False)

    def where(self, response_id: str) -> str | None:
        url = self._urls.get(response_id)
        if url is not None:
            self._urls.move_to_end(response_id)
        return url

    def __len__(self) -> int:
        return len(self._urls)


class _Response(msgspec.Struct):
    id: str | None = None
    object: str | None = None


class _Event(msgspec.Struct):
    response: _Response | None = None


_response = msgspec.json.Decoder(_Response)
_event = msgspec.json.Decoder(_Event)


def response_id(body: bytes) -> str | None:
    """The id of a Responses object (``"object": "response"``), else None."""
    try:
        got = _response.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return got.id if got.object == "response" and got.id else None


def event_response_id(event: bytes) -> str | None:
    """The ``response.id`` of one SSE event (``event: ...`` and ``data: {...}`` lines), else None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                got = _event.decode(line[5:])
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None
            return got.response.id if got.response is not None else None
    return None


class OwnerTap:
    """Sees the 2xx body a worker answered a create with, chunk by chunk as it is relayed
    (the bytes are only read, never re-encoded), and remembers the response id found there.

    A JSON body is one chunk. A stream is searched event by event for the first one that
    names its response (SGLang's first, ``response.created``), within its first
    ``_SCAN_LIMIT`` bytes; after that the tap only returns."""

    __slots__ = ("owners", "url", "stream", "_buf", "_seen", "_done")

    def __init__(self, owners: ResponseOwners, url: str, stream: bool) -> None:
        self.owners = owners
        self.url = url
        self.stream = stream
        self._buf = b""
        self._seen = 0
        self._done = False

    def __call__(self, chunk: bytes) -> None:
        if self._done:
            return
        if not self.stream:
            self._done = True
            rid = response_id(chunk)
            if rid is not None:
                self.owners.remember(rid, self.url)
            return
        self._seen += len(chunk)
        self._buf = (self._buf + chunk).replace(b"\r\n", b"\n")
        while not self._done:
            end = self._buf.find(b"\n\n")
            if end < 0:
                if self._seen > _SCAN_LIMIT:
                    self._done, self._buf = True, b""
                return
            rid = event_response_id(self._buf[:end])
            self._buf = self._buf[end + 2:]
            if rid is not None:
                self.owners.remember(rid, self.url)
                self._done = True
        self._buf = b""


def tap_factory(owners: ResponseOwners):
    """What ``gateway.proxy.Unified.taps`` takes for the create route: a tap per attempt."""

    def make(url: str, stream: bool) -> OwnerTap:
        return OwnerTap(owners, url, stream)

    return make
