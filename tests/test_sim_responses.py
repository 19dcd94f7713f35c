"""The simulated worker's Responses API over real HTTP: storage, previous_response_id,
SGLang's event stream, background and cancel, input items, and the store's bound."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.sim_support import sim_worker
from tests.support import request_json

MODEL = "sim-llama-8b"


@pytest.fixture(scope="module")
def worker():
    with sim_worker("--time-scale", "50", "--enable-response-store", "--response-store-size", "8") as (url, _):
        yield url


def create(url: str, **body: object) -> tuple[int, dict]:
    return request_json("POST", url + "/v1/responses", {"model": MODEL, "max_output_tokens": 4, **body})


def tokens(url: str, messages: list[dict]) -> int:
    return request_json("POST", url + "/v1/tokenize", {"messages": messages})[1]["count"]


def test_previous_response_id_prepends_the_stored_conversation(worker):
    status, first = create(worker, input="hello", instructions="be brief")
    assert status == 200 and first["object"] == "response" and first["id"].startswith("resp_")
    assert first["status"] == "incomplete" and first["incomplete_details"] == {"reason": "max_output_tokens"}
    said = first["output"][0]["content"][0]["text"]
    assert first["usage"]["input_tokens"] == tokens(worker, [{"role": "system", "content": "be brief"},
                                                              {"role": "user", "content": "hello"}])
    status, second = create(worker, input="again", previous_response_id=first["id"])
    assert status == 200 and second["previous_response_id"] == first["id"]
    # the previous instructions are not carried over, as in SGLang; the conversation is
    assert second["usage"]["input_tokens"] == tokens(worker, [{"role": "user", "content": "hello"},
                                                               {"role": "assistant", "content": said},
                                                               {"role": "user", "content": "again"}])
    assert request_json("GET", f"{worker}/v1/responses/{second['id']}")[1] == second


def test_the_stream_is_sglangs_event_sequence(worker):
    body = json.dumps({"model": MODEL, "input": "stream", "max_output_tokens": 5, "stream": True}).encode()
    req = urllib.request.Request(worker + "/v1/responses", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read().decode()
    events = []
    for block in filter(None, raw.split("\n\n")):
        head, data = block.split("\n")
        events.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    kinds = [k for k, _ in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert all(k == d["type"] for k, d in events) and [d["sequence_number"] for _, d in events] == list(range(len(events)))
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert len(text) == 5 and final["output"][0]["content"][0]["text"] == text
    assert request_json("GET", f"{worker}/v1/responses/{final['id']}")[1]["status"] == "incomplete"
    status, _ = create(worker, input="not kept", store=False)
    assert status == 200


def test_background_responses_run_detached_and_cancel(worker):
    status, job = create(worker, input="long", max_output_tokens=3000, background=True)
    assert status == 200 and job["status"] == "queued"
    status, cancelled = request_json("POST", f"{worker}/v1/responses/{job['id']}/cancel")
    assert status == 200 and cancelled["status"] == "cancelled"
    status, short = create(worker, input="short", background=True)
    deadline = time.monotonic() + 20
    while (got := request_json("GET", f"{worker}/v1/responses/{short['id']}")[1])["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got["status"] == "incomplete" and got["usage"]["output_tokens"] == 4
    assert request_json("POST", f"{worker}/v1/responses/{short['id']}/cancel")[1]["status"] == "incomplete"
    assert request_json("GET", f"{worker}/v1/responses/{job['id']}")[1]["status"] == "cancelled"


def test_input_items_delete_and_errors(worker):
    items = [{"role": "user", "content": f"part {i}"} for i in range(3)]
    _, resp = create(worker, input=items)
    url = f"{worker}/v1/responses/{resp['id']}"
    page = request_json("GET", url + "/input_items")[1]
    assert [i["content"][0]["text"] for i in page["data"]] == ["part 2", "part 1", "part 0"]  # newest first
    page = request_json("GET", url + "/input_items?order=asc&limit=2")[1]
    assert [i["content"][0]["text"] for i in page["data"]] == ["part 0", "part 1"] and page["has_more"]
    after = request_json("GET", url + f"/input_items?order=asc&after={page['last_id']}")[1]
    assert [i["content"][0]["text"] for i in after["data"]] == ["part 2"] and not after["has_more"]
    assert request_json("DELETE", url)[1]["deleted"] is True
    status, err = request_json("GET", url)
    assert status == 404 and err["error"]["param"] == "response_id"
    assert request_json("GET", f"{worker}/v1/responses/not-a-resp-id")[0] == 400
    for body, status in (({"input": "x", "model": "other"}, 404), ({"input": 5}, 400), ({}, 400),
                         ({"input": "x", "previous_response_id": "resp_missing"}, 404),
                         ({"input": "x", "background": True, "store": False}, 400)):
        got, out = request_json("POST", worker + "/v1/responses", body)
        assert got == status and isinstance(out["error"]["message"], str), (body, out)


def test_the_store_keeps_only_the_most_recently_used(worker):
    ids = [create(worker, input=f"n{i}", max_output_tokens=1)[1]["id"] for i in range(9)]
    assert request_json("GET", f"{worker}/v1/responses/{ids[0]}")[0] == 404
    assert all(request_json("GET", f"{worker}/v1/responses/{rid}")[0] == 200 for rid in ids[1:])


def test_without_the_store_only_stateless_requests_are_served():
    with sim_worker("--time-scale", "50") as (url, _):
        status, resp = create(url, input="x")
        assert status == 200
        for method, path, body in (("GET", f"/v1/responses/{resp['id']}", None),
                                   ("POST", "/v1/responses", {"input": "x", "previous_response_id": resp["id"]}),
                                   ("POST", "/v1/responses", {"input": "x", "background": True})):
            status, out = request_json(method, url + path, body)
            assert status == 400 and "--enable-response-store" in out["error"]["message"], (path, out)
