"""Read the few fields routing needs from a request body, without touching the rest.

The body is decoded once with msgspec into a struct that names only these fields (msgspec
skips the others without building them); the original bytes are what goes upstream, so no
engine field can be lost or reordered.
"""

from __future__ import annotations

import logging
import os
import re
from array import array
from typing import Any

import msgspec

from gateway.encoding import PromptEncoder
from gateway.errors import GatewayError
from index.views import RequestView
from wire.chat_template import apply_chat_template, sglang_tools, template_kwargs
from wire.hashing import uint32_le
from wire.prefix_ids import RecentIds

log = logging.getLogger("kvgate.request")
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"


class _Sampling(msgspec.Struct):
    max_new_tokens: int | None = None
    n: int | None = None


class Body(msgspec.Struct):
    model: str | None = None
    stream: bool = False
    messages: list[dict[str, Any]] | None = None  # whole: a model's chat template may read any field
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Any = None
    continue_final_message: bool = False
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]: checked in parse_body (*)
    text: str | list[str] | None = None
    input_ids: Any = None  # list[int] | list[list[int]]: checked in parse_body (*)
    sampling_params: _Sampling | list[_Sampling] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    rid: str | list[str] | None = None
    logprobs: bool | int | None = None
    return_logprob: bool | list[bool] | None = None
    n: int | None = None
    return_token_ids: bool = False  # SGLang's: a completion's choices carry their token ids
    priority: Any = None  # SGLang's request priority; a QoS gateway reads it as a class (gateway.qos)
    # (*) one list of ids that read_body read is an array("I") (wire.prefix_ids), not a list


class _SingleBody(Body):
    """A body with one prompt, as nearly every request has: a string, or token ids typed
    here so msgspec checks them in C as it decodes. Checking a decoded list of 2,600 ids
    in Python (``_is_ids``) cost 100 us, more than decoding it (bench/RESULTS.md, "Parsing
    a request body"). Batches, and bodies this does not fit, take the general ``Body``."""

    prompt: str | list[int] | None = None
    input_ids: list[int] | None = None


class _MarkedBody(_SingleBody):
    """A one-prompt body whose id list was cut out and a mark put in its place (``_ids_cut``)."""

    prompt: str | None = None
    input_ids: str | None = None


_single = msgspec.json.Decoder(_SingleBody)
_decoder = msgspec.json.Decoder(Body)
_marked = msgspec.json.Decoder(_MarkedBody)
_decode_ids = msgspec.json.Decoder(list[int]).decode
_enc = msgspec.json.encode
# No client can send this string: where it lands as the decoded field, the cut was that field.
_MARK = "kvgate-ids-" + os.urandom(8).hex()
_MARK_JSON = msgspec.json.encode(_MARK)
# The field's key, then the list's opening bracket (JSON's whitespace between)
_ID_FIELDS = {route: (name, re.compile(rb'"%s"[ \t\r\n]*:[ \t\r\n]*\[' % name.encode()))
              for route, name in ((GENERATE, "input_ids"), (COMPLETIONS, "prompt"))}
MAX_N = 128


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _valid_ids(ids: Any) -> bool:
    """Token ids, or a batch of them; never strings (which a prompt may be)."""
    return isinstance(ids, list) and bool(ids) and (_is_ids(ids) or all(_is_ids(p) and p for p in ids))


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return all(isinstance(p, str) for p in prompt) or _is_ids(prompt) or all(_is_ids(p) and p for p in prompt)


def _decode(raw: bytes) -> tuple[Body, bool]:
    """The body, and whether it is a ``_SingleBody`` (its prompt and ids type-checked)."""
    try:
        return _single.decode(raw), True
    except msgspec.ValidationError:
        pass  # a batch, or an invalid body: the general decoder words the error
    except msgspec.DecodeError as exc:
        raise GatewayError(400, f"malformed JSON: {exc}") from None
    try:
        return _decoder.decode(raw), False
    except msgspec.ValidationError as exc:
        raise GatewayError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:  # malformed past where the typed decoder stopped
        raise GatewayError(400, f"malformed JSON: {exc}") from None


def splice_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """Append keys to a JSON object's bytes. Appended last, they win over any duplicate the
    client sent (JSON parsers keep the last), and nothing else in the body changes."""
    end = raw.rstrip()
    if not end.endswith(b"}"):
        raise GatewayError(400, "request body must be a JSON object")
    inner = end[:-1].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    extra = b",".join(_enc(k) + b":" + _enc(v) for k, v in fields.items())
    return inner + sep + extra + b"}"


def parse_body(raw: bytes, route: str) -> Body:
    if not raw.strip():
        raise GatewayError(400, "request body is empty; expected a JSON object")
    body, single = _decode(raw)
    return _checked(body, route, single)


def read_body(raw: bytes, route: str, recent: RecentIds | None) -> tuple[Body, bytes | None]:
    """``parse_body``, and the prompt's ids packed (uint32 LE) where they were read with
    ``recent``: a ``/generate`` or completion body whose one prompt is token ids has them
    read from the part of their text that a recent body's list does not share
    (``wire.prefix_ids``), as ``array("I")`` in the body's field, and every such body leaves
    its list there for the next. Anything else, and any body this path cannot read, is
    ``parse_body``'s, so answers are the same."""
    field = _ID_FIELDS.get(route)
    if recent is not None and field is not None:
        got = _read_ids(raw, field, recent)
        if got is not None:
            body, ids = got
            setattr(body, field[0], ids)
            return _checked(body, route, True), uint32_le(ids)
    return parse_body(raw, route), None


def _read_ids(raw: bytes, field: tuple[str, re.Pattern[bytes]], recent: RecentIds) -> tuple[Body, array] | None:
    """The body with the field's list cut out, and the list's ids; None where the body is
    not one this path reads (the general one decides then, errors included).

    The field's text is found by a search of the bytes, then proven to be the body's own
    top-level field: the body is decoded with a mark in its place, and only a mark that comes
    back as that field passes (a nested key of the same name, a duplicate key, a batch or
    anything but one list of ints ends elsewhere or fails to decode)."""
    name, key = field
    found = key.search(raw)
    if found is None:
        return None
    start = found.end() - 1
    end = raw.find(b"]", start) + 1
    ids = recent.decode(raw[start:end])
    if not ids:
        return None
    try:
        body = _marked.decode(raw[:start] + _MARK_JSON + raw[end:])
    except msgspec.DecodeError:
        return None
    if getattr(body, name) != _MARK:
        return None
    return body, ids


def _checked(body: Body, route: str, single: bool) -> Body:
    for n in [body.n, *(sp.n for sp in _as_list(body.sampling_params))]:
        if n is not None and not 1 <= n <= MAX_N:  # OpenAI's bound; an engine would build n requests
            raise GatewayError(400, f"'n' must be between 1 and {MAX_N}, got {n}", param="n")
    if route == CHAT:
        if not body.model:
            raise GatewayError(400, "'model' is required", param="model")
        if not body.messages:
            raise GatewayError(400, "'messages' must be a non-empty list", param="messages")
        if not all(isinstance(m.get("role", "user"), str) for m in body.messages):
            raise GatewayError(400, "each message's 'role' must be a string", param="messages")
    elif route == COMPLETIONS:
        if not body.model:
            raise GatewayError(400, "'model' is required", param="model")
        if not ((isinstance(body.prompt, str) or bool(body.prompt)) if single else _valid_prompt(body.prompt)):
            raise GatewayError(400, "'prompt' must be a string, a list of strings, or token ids", param="prompt")
    elif (body.text is None) == (body.input_ids is None):
        raise GatewayError(400, "exactly one of 'text' or 'input_ids' is required", param="text")
    elif body.input_ids is not None and not (bool(body.input_ids) if single else _valid_ids(body.input_ids)):
        raise GatewayError(400, "'input_ids' must be a list of token ids or a list of such lists", param="input_ids")
    return body


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


async def build_view(body: Body, route: str, headers: Any, request_id: str, encoder: PromptEncoder | None,
                     with_prompt: bool = True, packed_ids: bytes | None = None) -> RequestView:
    """``with_prompt=False`` skips the prompt text and token ids (no policy reads them).
    With an ``encoder`` the prompt is tokenized as the engine tokenizes it (``wire.tokenizer``).
    ``packed_ids``: the body's own ids packed, as ``read_body`` gives them."""
    text: str | None = None
    token_ids: list[int] | None = None
    packed: bytes | None = packed_ids
    if not with_prompt:
        pass
    elif route == CHAT and encoder is not None:
        try:
            chat = encoder.tokenizer.render_chat(body.messages or [], sglang_tools(body.tools, body.tool_choice),
                                                 template_kwargs(body.reasoning_effort, body.chat_template_kwargs),
                                                 body.continue_final_message)
        except Exception as exc:  # the engine answers for its own template; routing goes on by text
            log.debug("chat template failed for %s, routing without token ids: %r", request_id, exc)
            text = apply_chat_template(body.messages or [])
        else:
            text, (token_ids, packed) = chat.text, await encoder.chat(chat)
    elif route == CHAT:
        text = apply_chat_template(body.messages or [])
    elif route == COMPLETIONS:
        prompt = body.prompt
        if isinstance(prompt, array) or isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            token_ids = prompt  # type: ignore[assignment]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            token_ids = prompt[0]  # type: ignore[assignment]
        else:
            text = _first(prompt)
    else:
        if body.input_ids is not None:
            ids = body.input_ids
            token_ids = ids[0] if isinstance(ids, list) and isinstance(ids[0], list) else ids  # type: ignore[assignment]
        else:
            text = _first(body.text)
    if token_ids is None and text is not None and encoder is not None:
        token_ids, packed = await encoder.text(text)
    sp = _first(body.sampling_params)
    max_tokens = body.max_tokens or body.max_completion_tokens or (sp.max_new_tokens if sp else None)
    return RequestView(
        request_id=request_id,
        route=route,
        model=body.model or None,  # /generate may name none: "" is none too
        text=text,
        token_ids=token_ids,
        packed_ids=packed,
        session_key=session_key(headers, body.prompt_cache_key, body.user),
        stream=body.stream,
        max_tokens=max_tokens,
        cache_salt=body.cache_salt,
        headers=headers,
    )


def session_key(headers: Any, prompt_cache_key: Any, user: Any) -> str | None:
    """The client's key for what its requests share (``RequestView.session_key``): the
    ``X-Session-ID`` header, else OpenAI's ``prompt_cache_key``, else the ``user`` field
    (which ``prompt_cache_key`` replaces in OpenAI's API). The narrowest the client named
    comes first: a user may hold several conversations at once."""
    key = headers.get("X-Session-ID") or prompt_cache_key or user
    return key if type(key) is str and key else None


def request_id_from(headers: Any, names: tuple[str, ...]) -> str:
    """The client's id from the first of the headers ``names`` it sent (``--request-id-headers``),
    or 32 random hex digits (``uuid4().hex``'s shape; building the UUID object cost more
    than the id is worth on the hot path)."""
    for name in names:
        rid = headers.get(name)
        if rid and len(rid) <= 256:
            return rid
    return os.urandom(16).hex()
