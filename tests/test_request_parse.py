"""``parse_body`` decodes one-prompt bodies with typed fields (``_SingleBody``) and the rest
with the general ``Body``; whatever the body, it must answer as the general path alone does."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gateway.request as request
from gateway.errors import GatewayError
from gateway.request import CHAT, COMPLETIONS, GENERATE, parse_body

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
           | st.text(max_size=6))
ids = st.lists(st.integers(0, 2**32), max_size=5)
prompts = (st.just([]) | scalars | ids | st.lists(ids, max_size=3) | st.lists(st.text(max_size=4), max_size=3)
           | st.lists(scalars, max_size=3) | st.lists(st.just(1) | st.just([2]) | st.just(True), max_size=4))
bodies = st.fixed_dictionaries({}, optional={
    "model": st.just("m") | scalars, "prompt": prompts, "input_ids": prompts, "text": prompts,
    "messages": st.just([{"role": "user", "content": "hi"}]) | st.just([]) | scalars,
    "stream": st.booleans() | scalars, "n": st.integers(-2, 200) | scalars,
    "sampling_params": st.just({"max_new_tokens": 8}) | st.just([{"n": 2}]) | scalars,
})


class _Refuse:
    """Stands in for the typed decoder: every body takes the general path."""

    def decode(self, raw: bytes) -> None:
        raise msgspec.ValidationError("refused")


def _outcome(raw: bytes, route: str) -> tuple:
    try:
        body = parse_body(raw, route)
    except GatewayError as exc:
        return ("error", exc.status, exc.param, str(exc))
    return ("ok", msgspec.structs.asdict(body))


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, GENERATE])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies | st.binary(max_size=20).map(lambda b: b"{" + b))
def test_typed_single_prompts_answer_as_the_general_path(monkeypatch, route, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got = _outcome(raw, route)
    with monkeypatch.context() as m:
        m.setattr(request, "_single", _Refuse())
        want = _outcome(raw, route)
    assert got == want, raw


def test_a_long_id_list_is_typed_not_checked_in_python():
    ids = list(range(3000))
    body, single = request._decode(json.dumps({"input_ids": ids}).encode())
    assert single and body.input_ids == ids
    body, single = request._decode(json.dumps({"input_ids": [ids, ids]}).encode())
    assert not single and body.input_ids == [ids, ids]


@pytest.mark.parametrize("headers, fields, key", [
    ({}, {}, None),
    ({}, {"user": "u"}, "u"),
    ({}, {"user": "u", "prompt_cache_key": "conv"}, "conv"),
    ({"X-Session-ID": "s"}, {"user": "u", "prompt_cache_key": "conv"}, "s"),
    ({"X-Session-ID": ""}, {"prompt_cache_key": ""}, None),
])
def test_the_session_key_is_the_narrowest_the_client_named(headers, fields, key):
    import asyncio

    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()
    body = parse_body(raw, CHAT)
    view = asyncio.run(request.build_view(body, CHAT, headers, "r", None))
    assert view.session_key == key


def test_a_prompt_cache_key_that_is_no_string_is_refused():
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": 5}).encode()
    with pytest.raises(GatewayError) as err:
        parse_body(raw, CHAT)
    assert err.value.status == 400
