"""The records gateway processes share: what each routed where, and what each admitted.

One message on the bus is a batch: a msgpack array of records, each a tagged array (msgspec
``array_like``), so a field costs its value and no name. A routed request is a ``Routed``
per leg (one unified worker, or a prefill and a decode worker), then a ``FirstToken`` and a
``Completed`` per leg; the prompt travels once per request and origin (the first leg's
record carries it, later legs and retries of the same request id leave it out). ``Alive``
says every second which requests its origin still has in flight, ``Hello`` asks every
peer to send its in-flight requests again (a process that joined or reconnected), and
``Spent`` charges a client's rate-limit bucket everywhere, ``Used`` a tenant's request
and token budgets (``gateway.budgets``), ``Owned`` names the worker that stores a
Responses object, ``Member`` a worker added or removed through an admin route
(``gateway.membership``). Seconds are ``time.time()`` at the origin, for the lag metric only.
"""

from __future__ import annotations

import sys
from array import array

import msgspec

from index.views import Outcome, RequestView


class Routed(msgspec.Struct, tag=1, array_like=True):
    origin: str
    rid: str
    role: str
    url: str
    sent: float
    cached: int | None = None  # the choice's predicted cached tokens (None: not a policy's prefix choice)
    prompt: bool = False  # the request's fields below are set (else: a later leg of one already sent)
    route: str = ""
    model: str | None = None
    text: str | None = None
    ids: bytes | None = None  # token ids, uint32 little-endian
    max_tokens: int | None = None
    stream: bool = False
    cache_salt: str | None = None
    session_key: str | None = None
    first_token: bool = False  # set in a resync: the leg is past its first token


class FirstToken(msgspec.Struct, tag=2, array_like=True):
    origin: str
    rid: str
    role: str
    url: str
    sent: float


class Completed(msgspec.Struct, tag=3, array_like=True):
    origin: str
    rid: str
    role: str
    url: str
    sent: float
    ok: bool
    status: int = 200
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


class Alive(msgspec.Struct, tag=4, array_like=True):
    origin: str
    sent: float
    live: list[str]  # request ids the origin has in flight, each ``rid`` or ``rid\x00role``


class Hello(msgspec.Struct, tag=5, array_like=True):
    origin: str
    sent: float


class Spent(msgspec.Struct, tag=6, array_like=True):
    origin: str
    sent: float
    client: str  # the rate limiter's client key (an API key is hashed before it gets here)


class Owned(msgspec.Struct, tag=7, array_like=True):
    origin: str
    sent: float
    response_id: str  # a stored Responses object, kept by the worker at ``url`` only
    url: str


class Used(msgspec.Struct, tag=8, array_like=True):
    origin: str
    sent: float
    tenant: str  # a name from the tenants file (never a key)
    requests: int = 0
    tokens: int = 0


class Member(msgspec.Struct, tag=9, array_like=True):
    origin: str
    sent: float
    url: str
    present: bool  # added (True) or removed (False) through an admin route
    role: str = "unified"
    bootstrap_port: int | None = None
    api_key: str | None = None  # the worker's own key, for the peers that will call it


Record = Routed | FirstToken | Completed | Alive | Hello | Spent | Owned | Used | Member
encode = msgspec.msgpack.Encoder().encode
decode_batch = msgspec.msgpack.Decoder(list[Record]).decode


def request_fields(view: RequestView) -> dict:
    """The parts of a request a peer's policy reads (headers and hold state stay here)."""
    ids = view.packed() if view.token_ids is not None else None
    return {"prompt": True, "route": view.route, "model": view.model, "text": None if ids is not None else view.text,
            "ids": ids, "max_tokens": view.max_tokens, "stream": view.stream, "cache_salt": view.cache_salt,
            "session_key": view.session_key}


def peer_view(record: Routed, request_id: str) -> RequestView:
    """The request a peer routed, as this process's policies read it."""
    ids = None
    if record.ids is not None:
        ids = array("I")
        ids.frombytes(record.ids)
        if sys.byteorder == "big":
            ids.byteswap()
    return RequestView(request_id, record.route, record.model, record.text, ids, record.ids, record.session_key,
                       record.stream, record.max_tokens, record.cache_salt)


def outcome_of(record: Completed) -> Outcome:
    return Outcome(ok=record.ok, status=record.status, prompt_tokens=record.prompt_tokens,
                   cached_tokens=record.cached_tokens, completion_tokens=record.completion_tokens)
