"""The gateway as an OpenAI drop-in, driven by the official ``openai`` SDK and raw HTTP."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import MODEL
from tests.support import request_json


@pytest.fixture(scope="module")
def client(fleet):
    gw, _ = fleet
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_are_merged_across_workers(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=8)
    assert resp.choices[0].message.content
    assert resp.usage.prompt_tokens > 0 and resp.usage.completion_tokens == 8


def test_chat_streaming_delivers_every_delta(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Stream please"}],
                                            max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def test_completions_plain_and_streaming(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert resp.choices[0].text and resp.usage.completion_tokens == 5
    parts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Once", max_tokens=5, stream=True)
             if c.choices]
    assert "".join(parts)


def test_unknown_model_is_404_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["code"] == "model_not_found"


def test_missing_messages_is_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


@pytest.mark.parametrize("body,fragment", [
    (b"{not json", "malformed JSON"),
    (b"", "empty"),
    (b'{"model": 3, "messages": []}', "invalid request"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "'model' is required"),
])
def test_malformed_bodies_get_openai_errors(fleet, body, fragment):
    gw, _ = fleet
    status, data = request_json("POST", gw.url + "/v1/chat/completions", body)
    assert status == 400
    assert fragment in data["error"]["message"] and data["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("ids", [[""], [[""]], [[]], [], "12", [1, [2]]])
def test_input_ids_that_are_not_token_ids_are_400(fleet, ids):
    """Found by the fuzzer: strings passed as a "list of prompts" reached the policy as
    token ids and the gateway answered 500."""
    gw, _ = fleet
    status, data = request_json("POST", gw.url + "/generate", {"input_ids": ids})
    assert status == 400 and data["error"]["param"] == "input_ids", data


def test_native_generate_batch_and_rid(fleet):
    gw, _ = fleet
    status, data = request_json("POST", gw.url + "/generate", {
        "text": ["first prompt", "second prompt"], "rid": ["a-1", "a-2"],
        "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and isinstance(data, list) and len(data) == 2
    assert [d["meta_info"]["id"] for d in data] == ["a-1", "a-2"]
    assert all(d["meta_info"]["completion_tokens"] == 3 for d in data)


def test_engine_errors_pass_through(fleet):
    """An unknown sampling key is the engine's 400 (SGLang 0.5.23), proving the field reached it."""
    gw, _ = fleet
    status, data = request_json("POST", gw.url + "/generate",
                                {"text": "x", "sampling_params": {"max_new_tokens": 2, "not_a_knob": 1}})
    assert status == 400 and "not_a_knob" in str(data)


def test_oversized_body_is_413(start_gateway, fleet):
    _, sims = fleet
    gw = start_gateway(sims[0].url, args=("--max-payload-size", "2048"))
    status, data = request_json("POST", gw.url + "/v1/completions",
                                {"model": MODEL, "prompt": "x" * 4096, "max_tokens": 1})
    assert status == 413 and data["error"]["code"] == "payload_too_large"
    status, _ = request_json("POST", gw.url + "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1})
    assert status == 200


def test_no_worker_means_503_and_not_ready(start_gateway):
    gw = start_gateway(ready=False)
    status, data = request_json("GET", gw.url + "/readiness")
    assert status == 503 and data["status"] == "not_ready"
    status, data = request_json("POST", gw.url + "/generate", {"text": "x"})
    assert status == 503 and data["error"]["code"] == "no_worker_available"


def test_flush_cache_and_abort_fan_out(fleet):
    gw, sims = fleet
    status, data = request_json("POST", gw.url + "/flush_cache")
    assert status == 200 and set(data["workers"]) == {s.url for s in sims}
    status, data = request_json("POST", gw.url + "/abort_request", {"rid": "nothing-running"})
    assert status == 200 and set(data["workers"]) == {s.url for s in sims}
