"""``gateway.responses``: the bounded id -> worker memory, and learning ids from the bytes
a worker answered (JSON, and SSE however it is cut into chunks)."""

from __future__ import annotations

import json

import pytest

from gateway.api_body import RESPONSES, parse_api_body, prompt_of
from gateway.errors import GatewayError
from gateway.responses import OwnerTap, ResponseOwners, response_id


def sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


STREAM = (sse("response.created", {"type": "response.created", "sequence_number": 0,
                                   "response": {"id": "resp_abc", "object": "response", "status": "in_progress"}})
          + sse("response.in_progress", {"type": "response.in_progress", "response": {"id": "resp_abc"}})
          + sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"}))


def test_owners_forget_the_least_recently_used_past_capacity():
    owners = ResponseOwners(capacity=3)
    for i in range(3):
        owners.remember(f"resp_{i}", f"http://w{i}")
    assert owners.where("resp_0") == "http://w0"  # now the most recently used
    owners.remember("resp_3", "http://w3")
    assert owners.where("resp_1") is None and len(owners) == 3
    assert [owners.where(f"resp_{i}") for i in (0, 2, 3)] == ["http://w0", "http://w2", "http://w3"]
    owners.remember("resp_2", "http://moved")
    assert owners.where("resp_2") == "http://moved"


def test_a_json_response_is_learned_and_other_json_is_not():
    owners = ResponseOwners()
    OwnerTap(owners, "http://a", stream=False)(b'{"id": "resp_1", "object": "response", "output": []}')
    OwnerTap(owners, "http://a", stream=False)(b'{"id": "chatcmpl-1", "object": "chat.completion"}')
    OwnerTap(owners, "http://a", stream=False)(b'{"id": "resp_2", "object": "response"')  # cut short
    assert owners.where("resp_1") == "http://a"
    assert owners.where("chatcmpl-1") is None and owners.where("resp_2") is None
    assert response_id(b"[1, 2]") is None


@pytest.mark.parametrize("size", [1, 2, 7, 64, len(STREAM)])
def test_a_stream_is_learned_from_its_first_event_however_it_is_chunked(size):
    owners = ResponseOwners()
    tap = OwnerTap(owners, "http://b", stream=True)
    for i in range(0, len(STREAM), size):
        tap(STREAM[i:i + size])
    assert owners.where("resp_abc") == "http://b"


def test_a_stream_with_crlf_lines_is_learned():
    owners = ResponseOwners()
    OwnerTap(owners, "http://c", stream=True)(STREAM.replace(b"\n", b"\r\n"))
    assert owners.where("resp_abc") == "http://c"


def test_a_stream_without_a_response_stops_being_searched():
    owners = ResponseOwners()
    tap = OwnerTap(owners, "http://d", stream=True)
    noise = sse("ping", {"type": "ping"})
    for _ in range(70_000 // len(noise) + 2):
        tap(noise)
    tap(b"data: no end of event " * 4000)  # past the scan limit: dropped, not buffered
    tap(STREAM)
    assert owners.where("resp_abc") is None and len(owners) == 0


def test_api_body_errors_are_400_and_prompts_are_found():
    for raw in (b"", b"[1]", b"{bad", b'{"model": 3}', b'{"stream": "yes"}', b'{"previous_response_id": ""}'):
        with pytest.raises(GatewayError) as err:
            parse_api_body(raw)
        assert err.value.status == 400, raw
    body = parse_api_body(b'{"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}')
    assert prompt_of(RESPONSES, body) == (None, None)  # the engine words that error
    body = parse_api_body(b'{"input": "hello", "instructions": "be brief"}')
    text, ids = prompt_of(RESPONSES, body)
    assert "be brief" in text and "hello" in text and ids is None
    assert prompt_of("/v1/embeddings", parse_api_body(b'{"input": [[1, 2], [3]]}')) == (None, [1, 2])
    assert prompt_of("/v1/rerank", parse_api_body(b'{"query": "q", "documents": ["a"]}')) == ("q", None)
