"""The simulated worker over real HTTP: the official openai SDK, /generate semantics, errors."""

from __future__ import annotations

import datetime
import json
import threading
import time
import urllib.request

import openai
import pytest

from tests.support import request_json, wait_until

from tests.sim_support import sim_worker


@pytest.fixture(scope="module")
def worker():
    with sim_worker("--time-scale", "50", "--model-name", "sim-llama-8b") as (url, proc):
        yield url


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, object]:
    return request_json("POST", url, body, timeout=timeout)


def get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def sse_events(url: str, body: dict) -> list:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:]
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def test_openai_sdk_chat_completions_and_cache_report(worker):
    client = openai.OpenAI(base_url=worker + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "system", "content": "S" * 700}, {"role": "user", "content": "hello there"}]
    first = client.chat.completions.create(model="sim-llama-8b", messages=msgs, max_tokens=16)
    assert first.object == "chat.completion"
    assert first.choices[0].finish_reason == "length"
    assert len(first.choices[0].message.content) == 16
    assert first.usage.completion_tokens == 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="sim-llama-8b", messages=msgs, max_tokens=16)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 640 and cached % 64 == 0 and cached < again.usage.prompt_tokens


def test_openai_sdk_streaming_and_completions(worker):
    client = openai.OpenAI(base_url=worker + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []
    comp = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=7)
    assert comp.object == "text_completion" and len(comp.choices[0].text) == 7
    sc = list(client.completions.create(model="m", prompt="abc", max_tokens=9, stream=True))
    assert "".join(c.choices[0].text for c in sc if c.choices) and sc[-1].choices[0].finish_reason == "length"


def test_generate_batch_rid_n_and_determinism(worker):
    status, out = post(worker + "/generate", {"text": ["a", "b"], "rid": "req", "sampling_params": {"max_new_tokens": 5}})
    assert status == 200 and isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["req_0", "req_1"]
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 5} for o in out)
    assert all(len(o["output_ids"]) == 5 and o["text"].isprintable() for o in out)
    # 2-D input_ids batch, and n > 1 on a single prompt
    status, out2 = post(worker + "/generate", {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and [o["meta_info"]["prompt_tokens"] for o in out2] == [3, 2]
    status, out3 = post(worker + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "n": 3}})
    assert status == 200 and len(out3) == 3
    # same rid -> same tokens (deterministic given rid)
    a = post(worker + "/generate", {"text": "q", "rid": "same", "sampling_params": {"max_new_tokens": 12}})[1]
    b = post(worker + "/generate", {"text": "q", "rid": "same", "sampling_params": {"max_new_tokens": 12}})[1]
    assert a["output_ids"] == b["output_ids"]


def test_generate_single_shape_logprobs_and_stop(worker):
    status, out = post(worker + "/generate", {"input_ids": [5, 6, 7, 8], "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 6}})
    meta = out["meta_info"]
    assert status == 200
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "cached_tokens_details", "e2e_latency"):
        assert key in meta
    assert set(meta["cached_tokens_details"]) >= {"device", "host"}
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(t) == 3 and t[2] is None for t in meta["output_token_logprobs"])
    # a stop string that certainly occurs: take a piece of a known output
    probe = post(worker + "/generate", {"text": "s", "rid": "stopper", "sampling_params": {"max_new_tokens": 40}})[1]
    stop = probe["text"][10:12]
    cut = probe["text"].find(stop)
    out = post(worker + "/generate", {"text": "s", "rid": "stopper",
                                      "sampling_params": {"max_new_tokens": 40, "stop": [stop]}})[1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == probe["text"][:cut]


def test_generate_stream_cumulative(worker):
    events = sse_events(worker + "/generate", {"text": "stream me", "stream": True,
                                               "sampling_params": {"max_new_tokens": 30}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert len(chunks[-1]["output_ids"]) == 30 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_unknown_sampling_key_is_400(worker):
    status, body = post(worker + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "bogus_key": 1}})
    assert status == 400 and "unknown field" in body["error"] and "bogus_key" in body["error"]
    status, body = post(worker + "/generate", {"sampling_params": {}})
    assert status == 400 and "message" in body["error"]
    client = openai.OpenAI(base_url=worker + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[], max_tokens=2)


def test_token_ids_the_engine_cannot_hash_are_400_and_it_keeps_serving(worker):
    """Found by the gateway's fuzzer: a negative id reached the output's page hashes (packed
    as uint32) and killed the simulated scheduler, so every later request hung."""
    for ids in ([-1], [0, 1 << 32]):
        status, body = post(worker + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 80}})
        assert status == 400 and "input_ids" in body["error"]["message"], body
        status, body = post(worker + "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 80})
        assert status == 400, body
    status, out = post(worker + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 80}})
    assert status == 200 and len(out["output_ids"]) == 80


def test_info_models_load_routes(worker):
    info = get(worker + "/server_info")
    for key in ("model_path", "served_model_name", "page_size", "dp_size", "disaggregation_mode",
                "disaggregation_bootstrap_port", "version", "time_scale"):
        assert key in info
    assert info["time_scale"] == 50 and info["version"] == "0.5.23" and "kv_events" not in info
    assert get(worker + "/get_server_info")["served_model_name"] == "sim-llama-8b"
    assert get(worker + "/model_info")["model_path"] == info["model_path"]
    assert get(worker + "/v1/models")["data"][0]["id"] == "sim-llama-8b"
    loads = get(worker + "/v1/loads")
    assert loads["loads"][0]["max_total_num_tokens"] == info["max_total_num_tokens"]
    with pytest.raises(urllib.error.HTTPError) as e:  # 0.5.23 has no /get_load
        get(worker + "/get_load")
    assert e.value.code == 404 and json.loads(e.value.read()) == {"detail": "Not Found"}  # FastAPI's shape
    with urllib.request.urlopen(worker + "/health", timeout=5) as r:
        assert r.headers["Server"] == "uvicorn"
    metrics = urllib.request.urlopen(worker + "/metrics", timeout=5).read().decode()
    assert 'sglang:num_running_reqs{engine_type="unified",model_name="sim-llama-8b",pp_rank="0",tp_rank="0"}' in metrics
    assert "sglang:time_to_first_token_seconds_bucket" in metrics


LOAD_CORE = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_used_tokens",
             "num_total_tokens", "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput",
             "cache_hit_rate", "utilization"}


def test_v1_loads_matches_sglang_and_counts_queued_prefill():
    """/v1/loads as SGLang serves it (a router's serde rejects a record that differs, e.g. a
    numeric timestamp): an ISO 8601 timestamp, the twelve core fields, the sections
    ``include`` names, 400 for an unknown one; the queued prompt less its cached prefix."""
    with sim_worker("--time-scale", "5", "--max-running-requests", "1", "--schedule-policy", "lpm") as (url, _):
        prompt = "P" * 1000  # one token per byte: 15 full pages of 64 cached after it ran
        assert post(url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1}})[0] == 200
        hog = threading.Thread(target=post, args=(url + "/generate", {
            "text": "hog", "rid": "hog", "sampling_params": {"max_new_tokens": 100000}}))
        queued = threading.Thread(target=post, args=(url + "/generate", {
            "text": prompt + "Q" * 500, "sampling_params": {"max_new_tokens": 1}}))
        hog.start()
        wait_until(lambda: get(url + "/v1/loads")["loads"][0]["num_running_reqs"] == 1, "the hog runs")
        queued.start()
        try:
            core = wait_until(lambda: next((r for r in get(url + "/v1/loads?include=core")["loads"]
                                            if r["num_waiting_reqs"] == 1), None), "one request queued")
            assert set(core) == LOAD_CORE
            assert core["num_waiting_uncached_tokens"] == 1500 - 15 * 64
            assert core["num_total_tokens"] == core["num_used_tokens"] + 1500
            assert core["max_running_requests"] == 1 and core["max_total_num_tokens"] > 0
            full = get(url + "/v1/loads")
            datetime.datetime.fromisoformat(full["timestamp"])
            assert full["version"] == "0.5.23" and full["loads"][0]["queues"]["waiting"] == 1
            assert full["loads"][0]["disaggregation"]["mode"] == "null"
            assert full["loads"][0]["memory"]["token_capacity"] == core["max_total_num_tokens"]
            status, body = request_json("GET", url + "/v1/loads?include=core,bogus")
            assert status == 400 and "bogus" in body["detail"]
            assert get(url + "/v1/loads?dp_rank=3")["loads"] == []
        finally:
            post(url + "/abort_request", {"rid": "hog"})
            hog.join(10)
            queued.join(10)


def test_gen_throughput_is_decode_speed_before_anything_finishes():
    """gen_throughput as SGLang measures it, over recent decode steps: a router dividing queued
    work by it must see a worker that decodes as working, not only one that finishes requests."""
    with sim_worker("--time-scale", "5") as (url, _):
        hog = threading.Thread(target=post, args=(url + "/generate", {
            "text": "hog", "rid": "hog", "sampling_params": {"max_new_tokens": 100000}}))
        hog.start()
        try:
            wait_until(lambda: get(url + "/v1/loads")["loads"][0]["gen_throughput"] > 0, "decode throughput")
            metrics = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
            line = next(ln for ln in metrics.splitlines() if ln.startswith("sglang:gen_throughput{"))
            assert float(line.rsplit(" ", 1)[1]) > 0
        finally:
            post(url + "/abort_request", {"rid": "hog"})
            hog.join(10)


def test_flush_cache_refused_while_running_and_abort(worker):
    result = {}

    def long_request():
        result["r"] = post(worker + "/generate", {"text": "long", "rid": "to-abort",
                                                  "sampling_params": {"max_new_tokens": 100000}})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 10
    while get(worker + "/v1/loads")["loads"][0]["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    status, _ = post(worker + "/flush_cache", {})
    assert status == 400
    assert post(worker + "/abort_request", {"rid": "to-abort"})[0] == 200
    t.join(10)
    status, out = result["r"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(worker + "/flush_cache", {})[0] == 200


def test_client_disconnect_aborts_request(worker):
    import http.client

    host, port = worker.split("//")[1].split(":")
    for stream in (True, False):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/generate", body=json.dumps({"text": "bye", "stream": stream,
                                                           "sampling_params": {"max_new_tokens": 100000}}),
                     headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while get(worker + "/v1/loads")["loads"][0]["num_running_reqs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert get(worker + "/v1/loads")["loads"][0]["num_running_reqs"] == 1
        conn.sock.close()
        conn.close()
        deadline = time.monotonic() + 10
        while get(worker + "/v1/loads")["loads"][0]["num_running_reqs"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert get(worker + "/v1/loads")["loads"][0]["num_running_reqs"] == 0, f"stream={stream}"
