"""What a client has been sent of one stream, kept so that another worker can finish it.

A stream that may migrate (``gateway.migration``) passes through a sink on its way to the
client. The first worker's events go through a ``Record``: it cuts the bytes at event
boundaries, withholds an engine's error event (the stream is broken there, not over), notes
``[DONE]`` and keeps the raw events, unparsed. Only when the stream breaks are they read back
into a ``Transcript``, so a stream parses nothing on its way; one whose kept events pass
``FOLD_BYTES`` has them read into its transcript then and dropped, so that a long stream
costs a transcript's memory (its text and ids), not its events'.

A ``Transcript`` is the answer so far in the client's terms: its id, its text, its output
token ids (``/generate`` streams them; a completion carries them where the gateway asked
for ``return_token_ids``) and how many tokens it counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.request import CHAT, COMPLETIONS, GENERATE

FOLD_BYTES = 256 << 10
_DONE = b"data: [DONE]\n\n"
_ERROR = b'data: {"error"'
_ID_KEYS = (b'"token_ids":[', b'"prompt_token_ids":[')
_decode = msgspec.json.decode


def null_ids(events: bytes) -> bytes:
    """The events with every ``token_ids`` / ``prompt_token_ids`` list replaced by null (what
    an engine sends where they were not asked for). A key found by its bytes is a real key:
    inside a JSON string every quote is escaped."""
    for key in _ID_KEYS:
        start = events.find(key)
        while start >= 0:
            end = events.find(b"]", start)
            events = events[:start + len(key) - 1] + b"null" + events[end + 1:]
            start = events.find(key, start)
    return events


def split_events(buf: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """(the complete SSE events in ``buf + chunk``, the incomplete rest)."""
    data = buf + chunk if buf else chunk
    end = data.rfind(b"\n\n")
    if end < 0:
        return b"", data
    return data[:end + 2], data[end + 2:]


def error_at(events: bytes) -> int:
    """Where an error event starts in complete events, or -1 (a JSON string holds no raw newline)."""
    pos = events.find(_ERROR)
    while pos > 0 and events[pos - 1:pos] != b"\n":
        pos = events.find(_ERROR, pos + 1)
    return pos


def json_events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for event in data.split(b"\n\n"):
        event = event.strip()
        if event.startswith(b"data: {"):
            try:
                obj = _decode(event[6:])
            except msgspec.DecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


@dataclass(slots=True)
class Transcript:
    """The answer a client has been sent so far (one choice), in its own terms."""

    route: str
    id: str | None = None
    created: int | None = None
    text: str = ""
    ids: list[int] = field(default_factory=list)
    tokens: int = 0  # output tokens so far (for chat: content events, unless the gateway tokenizes)
    prompt_ids: list[int] | None = None  # a completion's, as the engine echoed them
    prompt_tokens: int | None = None  # the engine's count for the client's prompt, where it said
    cached_tokens: int | None = None
    logprobs: dict[str, list] = field(default_factory=dict)  # /generate: output_*_logprobs so far
    usable: bool = True  # False: a tool call or reasoning part, which no continuation can resume

    def apply(self, ev: dict[str, Any]) -> None:
        """One event as the client received it."""
        if self.route == GENERATE:
            meta = ev.get("meta_info") or {}
            self.id = meta.get("id", self.id)
            self.text = ev.get("text", self.text)
            ids = ev.get("output_ids") or []
            n = meta.get("completion_tokens")
            self.ids = list(ids) if n is not None and len(ids) == n else self.ids + list(ids)
            self.tokens = n if n is not None else len(self.ids)
            if self.prompt_tokens is None:
                self.prompt_tokens, self.cached_tokens = meta.get("prompt_tokens"), meta.get("cached_tokens")
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if meta.get(key) is not None:
                    self.logprobs[key] = meta[key]
            return
        self.id = ev.get("id", self.id)
        self.created = ev.get("created", self.created)
        usage = ev.get("usage")
        if isinstance(usage, dict) and self.prompt_tokens is None:
            self.prompt_tokens = usage.get("prompt_tokens")
        for choice in ev.get("choices") or ():
            if self.route == COMPLETIONS:
                self.text += choice.get("text") or ""
                self.ids += choice.get("token_ids") or []
                self.tokens = len(self.ids)
                if choice.get("prompt_token_ids") and self.prompt_ids is None:
                    self.prompt_ids = list(choice["prompt_token_ids"])
            else:
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("reasoning_content"):
                    self.usable = False
                if delta.get("content"):
                    self.text += delta["content"]
                    self.tokens += 1

    def copy(self) -> Transcript:
        return Transcript(self.route, self.id, self.created, self.text, list(self.ids), self.tokens,
                          self.prompt_ids, self.prompt_tokens, self.cached_tokens, dict(self.logprobs), self.usable)


class Record:
    """The first worker's stream: complete events to the client, raw events kept."""

    __slots__ = ("route", "strip_ids", "chunks", "size", "buf", "done", "response", "watch", "t")

    def __init__(self, route: str, strip_ids: bool, watch: Callable[[str, Any], Callable[[], None]]) -> None:
        self.watch = watch  # (worker url, upstream response) -> forget it: see Migration.watch
        self.route = route
        self.strip_ids = strip_ids  # the gateway asked for return_token_ids; the client did not
        self.chunks: list[bytes] = []
        self.size = 0
        self.t = Transcript(route)  # what the events folded so far said
        self.buf = b""
        self.done = False  # [DONE] came
        self.response: Any = None  # the client's response, once prepared

    def take(self, chunk: bytes) -> tuple[bytes, bool]:
        """What of ``chunk`` goes to the client now, and whether an error event came (it is withheld)."""
        out, self.buf = split_events(self.buf, chunk)
        if not out:
            return b"", False
        err = error_at(out)
        if err >= 0:
            out, self.buf = out[:err], b""
        elif out.endswith(_DONE):
            self.done = True
        self.chunks.append(out)
        self.size += len(out)
        if self.size > FOLD_BYTES:
            self._fold()
        return (null_ids(out) if self.strip_ids else out), err >= 0

    @property
    def resumable(self) -> bool:
        return self.response is not None

    def _fold(self) -> None:
        for ev in json_events(b"".join(self.chunks)):
            self.t.apply(ev)
        self.chunks, self.size = [], 0

    def transcript(self) -> Transcript:
        self._fold()
        return self.t


__all__ = ["CHAT", "COMPLETIONS", "GENERATE", "FOLD_BYTES", "Record", "Transcript", "error_at", "json_events",
           "null_ids", "split_events"]
