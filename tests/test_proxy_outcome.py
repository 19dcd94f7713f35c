"""``outcome_from_sse_tail`` searches from the end for speed; it must agree with the plain
split-every-event reading on any tail, including keys quoted inside content and cut events."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy import outcome_from_json, outcome_from_sse_tail
from policies.base import Outcome

_enc = msgspec.json.encode


def reference(tail: bytes, status: int) -> Outcome:
    for event in reversed(tail.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data: {") and (b'"usage"' in event or b'"meta_info"' in event):
            out = outcome_from_json(event[6:], status)
            if out.prompt_tokens is not None:
                return out
    return Outcome(ok=status < 400, status=status)


_tokens = st.integers(0, 50)
_events = st.one_of(
    st.just(b"data: " + _enc({"choices": [{"delta": {"content": "x"}}], "usage": None})),
    st.just(b"data: " + _enc({"choices": [{"delta": {"content": '"usage": {"prompt_tokens": 3}'}}]})),
    st.builds(lambda p, c: b"data: " + _enc({"usage": {"prompt_tokens": p, "completion_tokens": c}}), _tokens, _tokens),
    st.builds(lambda p: b"data: " + _enc({"meta_info": {"prompt_tokens": p, "cached_tokens": 1}}), _tokens),
    st.just(b"data: " + _enc({"meta_info": {}})),
    st.just(b"data: [DONE]"),
    st.just(b": keep-alive"),
    st.builds(lambda p: b"event: x\ndata: " + _enc({"usage": {"prompt_tokens": p}}), _tokens),
    st.just(b'  data: {"usage": {"prompt_tokens": 11}, "meta_info": {"prompt_tokens": 12}}  '),
    st.just(b'data: {broken "usage"'),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_events, max_size=8), st.sampled_from([b"\n\n", b"\n\n\n", b"\r\n\r\n"]),
       st.integers(0, 40), st.sampled_from([200, 500]))
def test_tail_search_matches_reference(events: list[bytes], sep: bytes, cut: int, status: int) -> None:
    tail = (sep.join(events) + sep)[cut:]
    assert outcome_from_sse_tail(tail, status) == reference(tail, status)


def test_last_usage_wins() -> None:
    tail = b"".join(b"data: " + _enc({"usage": {"prompt_tokens": p}}) + b"\n\n" for p in (1, 2, 3))
    assert outcome_from_sse_tail(tail + b"data: [DONE]\n\n", 200).prompt_tokens == 3
