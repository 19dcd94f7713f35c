"""Embeddings, rerank, score, classify, encode, model retrieval and logprobs through the
gateway, in a fleet that mixes an embedding model and a chat model: each request goes only
to a worker serving its model (the other one would refuse it, as SGLang does)."""

from __future__ import annotations

import base64
import struct

import openai
import pytest

from tests.conftest import MODEL, _start_gateway, _start_sim
from tests.support import Proc, get_text, metric_value, request_json

EMBED = "org/sim-embed"  # a slash, as Hugging Face names have: the SDK sends it percent-encoded


@pytest.fixture(scope="module")
def mixed():
    procs: list[Proc] = []
    try:
        chat = _start_sim(procs, "--time-scale", "20", name="chat")
        embed = _start_sim(procs, "--time-scale", "20", "--is-embedding", "--model-name", EMBED, name="embed")
        # round robin: a request that could go to either worker would alternate, so routing by
        # model (or kind) is what keeps every one of them on the right worker
        gw = _start_gateway(procs, chat.url, embed.url, args=("--policy", "round_robin"))
        yield gw, chat, embed
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def client(mixed):
    return openai.OpenAI(base_url=mixed[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


def routed(gw: Proc, worker: Proc) -> float:
    return metric_value(get_text(gw.url + "/metrics"), "kvgate_routed_total", worker=worker.url)


def post(gw: Proc, path: str, body: object, method: str = "POST") -> tuple[int, object]:
    return request_json(method, gw.url + path, body)


def test_models_are_retrieved_by_id(client):
    assert {m.id for m in client.models.list().data} == {MODEL, EMBED}
    for name in (MODEL, EMBED):
        card = client.models.retrieve(name)
        assert card.id == name and card.object == "model" and card.owned_by == "sglang"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_embeddings_go_to_the_embedding_worker(mixed, client):
    gw, chat, embed = mixed
    before = routed(gw, embed), routed(gw, chat)
    one = client.embeddings.create(model=EMBED, input=["the cat sat", "the cat sat", "stock prices fell"])
    assert [d.index for d in one.data] == [0, 1, 2] and one.usage.prompt_tokens > 0
    vectors = [d.embedding for d in one.data]
    assert len(vectors[0]) == 64 and vectors[0] == vectors[1] != vectors[2]
    assert abs(sum(x * x for x in vectors[0]) - 1) < 1e-3
    short = client.embeddings.create(model=EMBED, input="the cat sat", dimensions=8)
    assert len(short.data[0].embedding) == 8
    raw = client.embeddings.create(model=EMBED, input=[[1, 2, 3]], encoding_format="base64")
    assert isinstance(raw.data[0].embedding, str)
    assert len(struct.unpack("<64f", base64.b64decode(raw.data[0].embedding))) == 64
    assert (routed(gw, embed), routed(gw, chat)) == (before[0] + 3, before[1])


def test_generation_goes_to_the_chat_worker_and_each_worker_refuses_the_other_kind(mixed, client):
    gw, chat, embed = mixed
    before = routed(gw, embed), routed(gw, chat)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert resp.choices[0].message.content
    assert (routed(gw, embed), routed(gw, chat)) == (before[0], before[1] + 1)
    with pytest.raises(openai.BadRequestError) as err:  # the embedding worker's own refusal
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert "embedding model" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # the chat worker's own refusal
        client.embeddings.create(model=MODEL, input="hi")
    assert "--is-embedding" in err.value.message


def test_rerank_score_classify_and_encode(mixed):
    gw, chat, embed = mixed
    before = routed(gw, embed), routed(gw, chat)
    docs = ["a cat on a mat", "quarterly earnings", "the cat sat on the mat"]
    for method in ("POST", "PUT"):  # no model in SGLang's rerank: it goes to an embedding worker
        status, ranked = post(gw, "/v1/rerank", {"query": "the cat sat on the mat", "documents": docs}, method)
        assert status == 200 and [r["index"] for r in ranked][0] == 2, ranked
        assert [r["score"] for r in ranked] == sorted((r["score"] for r in ranked), reverse=True)
    status, top = post(gw, "/v1/rerank", {"model": EMBED, "query": "cat", "documents": docs, "top_n": 1,
                                          "return_documents": False})
    assert status == 200 and len(top) == 1 and "document" not in top[0]
    status, scored = post(gw, "/v1/score", {"model": EMBED, "query": "is it", "items": ["yes", "no"],
                                            "apply_softmax": True})
    assert status == 200 and scored["object"] == "scoring" and len(scored["scores"]) == 2
    assert all(abs(sum(row) - 1) < 1e-3 for row in scored["scores"])
    status, classified = post(gw, "/v1/classify", {"model": EMBED, "input": ["good", "bad"]})
    assert status == 200 and [d["num_classes"] for d in classified["data"]] == [2, 2]
    status, encoded = post(gw, "/encode", {"text": ["one", "two"]}, "PUT")
    assert status == 200 and [len(e["embedding"]) for e in encoded] == [64, 64]
    assert all(e["meta_info"]["prompt_tokens"] > 0 for e in encoded)
    status, logits = post(gw, "/classify", {"input_ids": [5, 6, 7]})
    assert status == 200 and len(logits["embedding"]) == 2
    assert (routed(gw, embed), routed(gw, chat)) == (before[0] + 7, before[1])
    status, scored = post(gw, "/v1/score", {"model": MODEL, "query": "is it", "items": ["a", "b"],
                                            "label_token_ids": [89, 78]})
    assert status == 200 and [len(r) for r in scored["scores"]] == [2, 2]
    assert routed(gw, chat) == before[1] + 1


def test_logprobs_through_the_gateway(client):
    def ask():
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                              logprobs=True, top_logprobs=3, seed=7)

    chat = ask()
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [c.logprob for c in t.top_logprobs] == sorted((c.logprob for c in t.top_logprobs), reverse=True)
    assert ask().choices[0].logprobs == chat.choices[0].logprobs  # deterministic
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "s"}],
                                                          max_tokens=6, logprobs=True, stream=True) if c.choices]
    tokens = [t.token for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(tokens) == "".join(c.choices[0].delta.content or "" for c in streamed)
    comp = client.completions.create(model=MODEL, prompt="Once", max_tokens=4, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("path", ["/v1/decisions", "/v1/messages", "/v1/messages/count_tokens"])
def test_routes_the_simulator_lacks_are_forwarded_to_a_worker(mixed, path):
    """SGLang's decisions and Anthropic's Messages API: the simulator serves neither, so the
    worker's own 404 comes back, after a routed attempt."""
    gw, chat, embed = mixed
    before = routed(gw, chat)
    status, body = post(gw, path, {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert routed(gw, chat) == before + 1


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/classify", "/encode", "/classify",
                                  "/v1/decisions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("body,status", [
    (b"", 400), (b"{not json", 400), (b'"a string"', 400), (b'{"model": 5}', 400),
    (b'{"model": "no-such-model", "input": "x"}', 404),
])
def test_bad_bodies_are_the_gateways_openai_shaped_4xx(mixed, path, body, status):
    got, data = request_json("POST", mixed[0].url + path, body)
    assert got == status and isinstance(data["error"]["message"], str), (path, body, data)
    assert {"type", "param", "code"} <= set(data["error"]), data


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"model": EMBED, "input": ""}),
    ("/v1/embeddings", {"model": EMBED, "input": "x", "dimensions": 9999}),
    ("/v1/embeddings", {"model": EMBED, "input": "x", "encoding_format": "hex"}),
    ("/v1/rerank", {"model": EMBED, "query": "q", "documents": []}),
    ("/v1/rerank", {"model": EMBED, "query": "q", "documents": ["a"], "top_n": 0}),
    ("/v1/score", {"model": EMBED, "query": "q"}),
    ("/v1/score", {"model": MODEL, "items": ["a"]}),
    ("/v1/classify", {"model": EMBED, "input": [1, "a"]}),
    ("/encode", {"model": EMBED}),
    ("/classify", {"model": EMBED, "text": "a", "input_ids": [1]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": "many"}),
])
def test_bad_requests_the_engine_refuses_come_back_openai_shaped(mixed, path, body):
    got, data = request_json("POST", mixed[0].url + path, body)
    assert got == 400 and isinstance(data["error"]["message"], str), (path, body, data)
    assert {"type", "param", "code"} <= set(data["error"]), data
