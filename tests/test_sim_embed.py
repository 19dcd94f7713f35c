"""The simulated worker's non-generative routes and logprobs, over real HTTP: SGLang's
shapes, deterministic values, and each kind of model refusing the other kind's requests."""

from __future__ import annotations

import json
import urllib.request

import pytest

from simulator.vectors import embed
from tests.sim_support import sim_worker
from tests.support import request_json


@pytest.fixture(scope="module")
def embedder():
    with sim_worker("--time-scale", "50", "--is-embedding", "--model-name", "sim-embed") as (url, _):
        yield url


@pytest.fixture(scope="module")
def generator():
    with sim_worker("--time-scale", "50") as (url, _):
        yield url


def test_embeddings_are_unit_vectors_of_the_token_ids(embedder):
    status, out = request_json("POST", embedder + "/v1/embeddings", {"input": [[1, 2, 3], [3, 2, 1], [9]]})
    assert status == 200 and out["object"] == "list" and out["usage"]["prompt_tokens"] == 7
    vectors = [d["embedding"] for d in out["data"]]
    assert vectors[0] == vectors[1] == embed([1, 2, 3], 64) != vectors[2]  # a bag of tokens
    status, native = request_json("POST", embedder + "/encode", {"input_ids": [1, 2, 3]})
    assert status == 200 and native["embedding"] == vectors[0] and native["meta_info"]["prompt_tokens"] == 3
    status, short = request_json("POST", embedder + "/v1/embeddings", {"input": "abc", "dimensions": 4})
    assert len(short["data"][0]["embedding"]) == 4


def test_rerank_orders_by_similarity_and_cuts_at_top_n(embedder):
    docs = ["zzzz", "the quick brown fox", "quick fox"]
    status, ranked = request_json("POST", embedder + "/v1/rerank", {"query": "the quick brown fox", "documents": docs})
    assert status == 200 and ranked[0]["index"] == 1 and ranked[0]["document"] == docs[1]
    assert ranked[0]["score"] == pytest.approx(1.0) and ranked[-1]["index"] == 0
    status, top = request_json("POST", embedder + "/v1/rerank", {"query": "fox", "documents": docs, "top_n": 2})
    assert [r["index"] for r in top] == [r["index"] for r in
                                          request_json("POST", embedder + "/v1/rerank",
                                                       {"query": "fox", "documents": docs})[1]][:2]


def test_classify_and_score_on_an_embedding_model(embedder):
    status, out = request_json("POST", embedder + "/v1/classify", {"input": ["good", "bad"]})
    assert status == 200 and [d["index"] for d in out["data"]] == [0, 1]
    assert all(d["label"] in ("LABEL_0", "LABEL_1") and sum(d["probs"]) == pytest.approx(1.0) for d in out["data"])
    status, out = request_json("POST", embedder + "/classify", {"text": ["good", "bad"]})
    assert status == 200 and len(out) == 2 and len(out[0]["embedding"]) == 2
    status, out = request_json("POST", embedder + "/v1/score", {"query": "q", "items": ["a", "b"]})
    assert status == 200 and out["object"] == "scoring" and [len(r) for r in out["scores"]] == [2, 2]
    status, out = request_json("POST", embedder + "/v1/score", {"query": "q", "items": ["a"],
                                                                 "return_token_logprobs": True})
    assert status == 400 and "CausalLM" in out["message"]


def test_score_on_a_generation_model_reads_label_token_logprobs(generator):
    body = {"query": "Is it good? ", "items": ["yes", "no"], "label_token_ids": [89, 78], "apply_softmax": True,
            "return_token_logprobs": True}
    status, out = request_json("POST", generator + "/v1/score", body)
    assert status == 200 and all(sum(r) == pytest.approx(1.0) for r in out["scores"])
    assert len(out["token_logprobs"]) == 2 and out["scores"][0] != out["scores"][1]
    assert request_json("POST", generator + "/v1/score", body)[1]["scores"] == out["scores"]  # deterministic
    for bad, words in (({"items": ["a"]}, "label_token_ids is required"),
                       ({"items": ["a"], "label_token_ids": [1, 1]}, "duplicate"),
                       ({"items": ["a"], "label_token_ids": [1], "temperature": 2.0}, "apply_softmax")):
        status, out = request_json("POST", generator + "/v1/score", bad)
        assert status == 400 and words in out["message"], out


def test_each_kind_of_model_refuses_the_other_kinds_requests(embedder, generator):
    for path, body in (("/generate", {"text": "x"}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        status, out = request_json("POST", embedder + path, body)
        assert status == 400 and "embedding model" in json.dumps(out), (path, out)
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/encode", {"text": "x"}),
                       ("/v1/classify", {"input": "x"}), ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        status, out = request_json("POST", generator + path, body)
        assert status == 400 and "--is-embedding" in json.dumps(out), (path, out)
    assert request_json("GET", embedder + "/model_info")[1]["is_generation"] is False
    assert request_json("GET", embedder + "/server_info")[1]["is_embedding"] is True
    assert request_json("GET", generator + "/server_info")[1]["is_embedding"] is False


def test_generate_logprobs_with_top_candidates_and_text(generator):
    body = {"input_ids": [70, 71, 72, 73], "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 3,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4}}
    status, out = request_json("POST", generator + "/generate", body)
    meta = out["meta_info"]
    assert status == 200 and meta["output_token_logprobs_length"] == 4
    assert [t[1] for t in meta["input_token_logprobs"]] == [71, 72, 73]
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert "".join(t[2] for t in meta["output_token_logprobs"]) == out["text"]
    for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0] == chosen and top[0][0] > top[1][0] > top[2][0]
    assert len(meta["input_top_logprobs"]) == 3
    status, out = request_json("POST", generator + "/generate", {**body, "top_logprobs_num": -1})
    assert status == 400


def test_streamed_completion_logprobs_follow_the_text(generator):
    body = json.dumps({"prompt": "x", "max_tokens": 6, "logprobs": 1, "stream": True}).encode()
    req = urllib.request.Request(generator + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r if line.startswith(b"data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert "".join(tokens) == "".join(texts) and len(tokens) == 6
