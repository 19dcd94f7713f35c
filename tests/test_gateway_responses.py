"""The Responses API through the gateway: a stored response lives on the worker that
created it, so every follow-up must reach that worker.

Three workers behind a round-robin gateway: a follow-up that went where the policy says
instead of to the owner would land on a worker that never saw the id (its 404), which
these tests tell apart from the gateway's own answers.
"""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from tests.conftest import MODEL, _start_gateway, _start_sim
from tests.support import Proc, request_json

SIM_ARGS = ("--time-scale", "20", "--enable-response-store")


@pytest.fixture(scope="module")
def fleet3():
    procs: list[Proc] = []
    try:
        sims = [_start_sim(procs, *SIM_ARGS, name=f"sim{i}") for i in range(3)]
        gw = _start_gateway(procs, *(s.url for s in sims), args=("--policy", "round_robin"))
        yield gw, sims
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def client(fleet3):
    return openai.OpenAI(base_url=fleet3[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


def holders(sims: list[Proc], response_id: str) -> list[str]:
    """The workers that hold ``response_id``, asked directly."""
    return [s.url for s in sims if request_json("GET", f"{s.url}/v1/responses/{response_id}")[0] == 200]


def test_a_conversation_continues_on_the_worker_that_holds_it(fleet3, client):
    _, sims = fleet3
    first = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=8)
    owner = holders(sims, first.id)
    assert len(owner) == 1 and first.output_text
    chain = [first]
    for turn in ("And then?", "How does it end?", "Thanks"):
        chain.append(client.responses.create(model=MODEL, input=turn, max_output_tokens=8,
                                             previous_response_id=chain[-1].id))
    for prev, nxt in zip(chain, chain[1:]):
        assert nxt.previous_response_id == prev.id
        assert nxt.usage.input_tokens > prev.usage.input_tokens + prev.usage.output_tokens  # history prepended
        assert holders(sims, nxt.id) == owner
    for response in chain:
        again = client.responses.retrieve(response.id)
        assert again.id == response.id and again.output_text == response.output_text
    items = list(client.responses.input_items.list(chain[-1].id))
    assert [i.content[0].text for i in items] == ["Thanks"]


def test_plain_requests_still_spread_across_the_fleet(fleet3, client):
    _, sims = fleet3
    ids = [client.responses.create(model=MODEL, input=f"q{i}", max_output_tokens=2).id for i in range(3)]
    assert sorted(h for rid in ids for h in holders(sims, rid)) == sorted(s.url for s in sims)


def test_a_streamed_response_is_learned_from_its_first_event(fleet3, client):
    gw, sims = fleet3
    events = list(client.responses.create(model=MODEL, input="stream it", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    rid = events[0].response.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert client.responses.retrieve(rid).output_text == text
    follow = list(client.responses.create(model=MODEL, input="more", max_output_tokens=4, stream=True,
                                          previous_response_id=rid))
    assert follow[-1].response.previous_response_id == rid
    assert holders(sims, follow[0].response.id) == holders(sims, rid)
    # the events reach the client as the worker wrote them: SGLang's framing, no [DONE]
    req = urllib.request.Request(gw.url + "/v1/responses", json.dumps(
        {"model": MODEL, "input": "raw", "max_output_tokens": 3, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    assert all(b.startswith("event: response.") and "\ndata: {" in b for b in blocks) and "[DONE]" not in raw


def test_a_background_response_is_cancelled_on_its_worker(fleet3, client):
    _, sims = fleet3
    started = client.responses.create(model=MODEL, input="long job", max_output_tokens=3000, background=True)
    assert started.status in ("queued", "in_progress")
    cancelled = client.responses.cancel(started.id)
    assert cancelled.id == started.id and cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    done = client.responses.create(model=MODEL, input="short job", max_output_tokens=2, background=True)
    deadline = time.monotonic() + 20
    while client.responses.retrieve(done.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "background response never finished"
        time.sleep(0.05)
    assert client.responses.retrieve(done.id).output_text


def test_delete_reaches_the_owner(fleet3, client):
    gw, sims = fleet3
    rid = client.responses.create(model=MODEL, input="forget me", max_output_tokens=2).id
    owner = holders(sims, rid)
    client.responses.delete(rid)
    assert holders(sims, rid) == []
    status, body = request_json("GET", f"{gw.url}/v1/responses/{rid}")
    assert status == 404 and "not found" in body["error"]["message"] and owner  # the owner's own 404


def test_unknown_ids_are_openai_shaped_404s(fleet3, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve("resp_never_created")
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_never_created")
    assert err.value.body["param"] == "response_id"
    for method, path in (("POST", "/cancel"), ("GET", "/input_items"), ("DELETE", "")):
        status, body = request_json(method, f"{fleet3[0].url}/v1/responses/resp_never_created{path}")
        assert status == 404 and body["error"]["code"] == "response_not_found", (method, path, body)


@pytest.mark.parametrize("body,status", [
    (b"not json", 400), (b"[]", 400), (b'{"input": "x", "stream": "yes"}', 400),
    (b'{"input": "x", "previous_response_id": 7}', 400), (b'{"input": "x", "model": "nope"}', 404),
    (b'{"model": "' + MODEL.encode() + b'"}', 400),  # the worker's: input is required
    (b'{"input": "x", "background": true, "store": false}', 400),
])
def test_bad_create_requests_are_openai_shaped_4xx(fleet3, body, status):
    got, data = request_json("POST", fleet3[0].url + "/v1/responses", body)
    assert got == status, data
    assert isinstance(data["error"]["message"], str) and "type" in data["error"] and "code" in data["error"]


def test_a_response_whose_worker_died_is_a_clear_error(start_sim, start_gateway):
    sims = [start_sim(*SIM_ARGS, name=f"sim{i}") for i in range(3)]
    gw = start_gateway(*(s.url for s in sims), args=("--policy", "round_robin"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    rid = client.responses.create(model=MODEL, input="remember this", max_output_tokens=2).id
    (owner_url,) = holders(sims, rid)
    owner = next(s for s in sims if s.url == owner_url)
    owner.stop()

    def refused() -> None:
        for call in (lambda: client.responses.retrieve(rid), lambda: client.responses.cancel(rid),
                     lambda: client.responses.create(model=MODEL, input="again", previous_response_id=rid)):
            with pytest.raises(openai.InternalServerError) as err:
                call()
            assert err.value.status_code == 503 and err.value.body["code"] == "response_worker_unavailable"
            assert owner_url in err.value.body["message"]

    refused()  # at once: the owner does not answer; no other worker is asked
    deadline = time.monotonic() + 20
    while next(w for w in request_json("GET", gw.url + "/workers")[1]["workers"] if w["url"] == owner_url)["healthy"]:
        assert time.monotonic() < deadline, "the gateway never marked the stopped worker unhealthy"
        time.sleep(0.1)
    refused()  # known unhealthy: refused before any attempt
    assert request_json("DELETE", f"{gw.url}/workers?url={owner_url}")[0] == 200
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.retrieve(rid)
    assert err.value.status_code == 410 and err.value.body["code"] == "response_worker_gone"
    assert client.responses.create(model=MODEL, input="fresh start", max_output_tokens=2).output_text


def test_a_replica_of_the_group_routes_a_follow_up_to_the_owner(start_sim, start_gateway):
    """Owners travel on the group's state bus: a response made through one replica is
    continued and retrieved through another, on the worker that stores it."""
    from gateway.nats_server import EmbeddedNats
    from tests.test_gateway_peers import wait_for

    with EmbeddedNats() as nats:
        sims = [start_sim(*SIM_ARGS, name=f"sim{i}") for i in range(3)]
        args = ("--policy", "round_robin", "--state-url", nats.url)
        a, b = (start_gateway(*(s.url for s in sims), args=args) for _ in range(2))
        alone = start_gateway(*(s.url for s in sims), args=("--policy", "round_robin"))  # the control
        first = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=30).responses.create(
            model=MODEL, input="Tell me a story", max_output_tokens=8)
        owner = holders(sims, first.id)
        got = wait_for(lambda: request_json("GET", f"{b.url}/v1/responses/{first.id}")[0] == 200 or None,
                       why="b learns the owner")
        assert got
        nxt = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0, timeout=30).responses.create(
            model=MODEL, input="And then?", max_output_tokens=8, previous_response_id=first.id)
        assert holders(sims, nxt.id) == owner
        assert request_json("GET", f"{alone.url}/v1/responses/{first.id}")[0] == 404
