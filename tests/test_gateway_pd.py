"""Prefill/decode disaggregation through the gateway, on simulated 2P+2D clusters whose
KV really moves through the Mooncake transfer engine over TCP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time

import openai
import pytest

from tests.conftest import MODEL, _start_gateway, _start_sim
from tests.requires import need
from tests.support import FREE_PORT, get_text, metric_value, request_json
from tests.test_gateway_faults import _stream

need("mooncake.engine", "the Mooncake transfer engine, pip extra 'mooncake'")


def pd_args(prefills, decodes) -> tuple[str, ...]:
    args: list[str] = ["--pd-disaggregation"]
    for url, port in prefills:
        args += ["--prefill", url, str(port)]
    for url in decodes:
        args += ["--decode", url]
    return tuple(args)


def start_pd(procs, n_prefill=2, n_decode=2, prefill_args=(), decode_args=(), gateway_args=()):
    prefills, decodes = [], []
    for i in range(n_prefill):
        p = _start_sim(procs, "--time-scale", "20", "--disaggregation-mode", "prefill",
                       "--disaggregation-bootstrap-port", FREE_PORT, *prefill_args, name=f"prefill{i}")
        prefills.append((p.url, p.ports[0]))
    for i in range(n_decode):
        d = _start_sim(procs, "--time-scale", "20", "--disaggregation-mode", "decode",
                       "--disaggregation-waiting-timeout", "60", *decode_args, name=f"decode{i}")
        decodes.append(d)
    gw = _start_gateway(procs, args=pd_args(prefills, [d.url for d in decodes]) + tuple(gateway_args))
    return gw, prefills, decodes


@pytest.fixture(scope="module")
def pd_fleet():
    procs: list = []
    try:
        yield start_pd(procs)
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in started:
        p.stop()


def test_readiness_and_models_in_pd_mode(pd_fleet):
    gw, _, _ = pd_fleet
    status, data = request_json("GET", gw.url + "/readiness")
    assert status == 200 and data["healthy_workers"] == 4
    assert request_json("GET", gw.url + "/v1/models")[1]["data"][0]["id"] == MODEL
    status, info = request_json("GET", gw.url + "/server_info")
    assert status == 200 and info["disaggregation_mode"] == "decode"


def test_chat_plain_and_streamed_through_a_pair(pd_fleet):
    gw, prefills, decodes = pd_fleet
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "PD hello " * 20}],
                                          max_tokens=10)
    assert resp.usage.completion_tokens == 10 and resp.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "PD stream"}],
                                                 max_tokens=10, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    moved = sum(metric_value(get_text(d.url + "/metrics"), "sglang:kv_transfer_latency_ms_count") for d in decodes)
    assert moved >= 2  # both answers really came through a KV transfer


def test_input_logprobs_from_prefill_are_merged_in_front(pd_fleet):
    gw, _, _ = pd_fleet
    body = {"text": "logprob prompt with several tokens", "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 4}}
    status, data = request_json("POST", gw.url + "/generate", body)
    assert status == 200
    meta = data["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == 4
    events = asyncio.run(_stream(gw.url + "/generate", {**body, "stream": True}))
    first = json.loads(events[0].removeprefix(b"data: "))
    assert len(first["meta_info"]["input_token_logprobs"]) == meta["prompt_tokens"]


def test_batch_gets_one_room_per_item(pd_fleet):
    gw, _, _ = pd_fleet
    status, data = request_json("POST", gw.url + "/generate", {
        "text": ["batch one", "batch two", "batch three"], "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(data) == 3
    assert all(d["meta_info"]["completion_tokens"] == 3 for d in data)
    status, data = request_json("POST", gw.url + "/generate", {"text": "n items", "sampling_params": {
        "max_new_tokens": 2, "n": 2}})
    assert status == 200 and len(data) == 2


def wait_for_abort(worker, rid: str, timeout: float = 10.0) -> None:
    """Until ``worker`` (a simulator) has received ``/abort_request`` for ``rid``: its log
    names the rid and its ``kvgate_sim_abort_requests_total`` counts the call."""
    deadline = time.monotonic() + timeout
    while f"abort_request rid={rid} " not in worker.output():
        assert time.monotonic() < deadline, f"{worker.name} got no /abort_request for {rid}:\n{worker.output()[-2000:]}"
        time.sleep(0.05)
    assert metric_value(get_text(worker.url + "/metrics"), "kvgate_sim_abort_requests_total") >= 1


def test_prefill_rejection_fails_fast_and_aborts_the_decode_leg(procs):
    gw, prefills, decodes = start_pd(procs, 1, 1, prefill_args=("--context-length", "64"))
    started = time.monotonic()
    status, data = request_json("POST", gw.url + "/generate", {"text": "x" * 200, "sampling_params": {
        "max_new_tokens": 4}}, headers={"X-Request-ID": "prefill-fails"})
    assert status == 400 and "context length" in json.dumps(data)
    assert time.monotonic() - started < 30  # the decode leg would otherwise wait out its 60 s room timeout
    wait_for_abort(decodes[0], "prefill-fails-0")  # the gateway's rid: request id and attempt
    deadline = time.monotonic() + 10
    while metric_value(get_text(decodes[0].url + "/metrics"), "sglang:num_decode_transfer_queue_reqs"):
        assert time.monotonic() < deadline, "the decode leg still waits for its KV"
        time.sleep(0.05)
    assert request_json("POST", gw.url + "/generate", {"text": "short", "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_decode_rejection_aborts_the_prefill_leg(procs):
    gw, prefills, _ = start_pd(procs, 1, 1, decode_args=("--context-length", "64"))
    status, data = request_json("POST", gw.url + "/generate", {"text": "y" * 200, "sampling_params": {
        "max_new_tokens": 4}}, headers={"X-Request-ID": "decode-fails"})
    assert status == 400 and "context length" in json.dumps(data)
    wait_for_abort(next(p for p in procs if p.url == prefills[0][0]), "decode-fails-0")


def test_decode_killed_mid_stream_without_migration_ends_with_error_frame(procs):
    gw, _, decodes = start_pd(procs, 1, 1, decode_args=("--time-scale", "1"), gateway_args=("--migration-limit", "0"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 3000, "stream": True}

    def kill(n: int) -> None:
        if n == 3:
            decodes[0].kill(signal.SIGKILL)

    events = asyncio.run(_stream(gw.url + "/v1/chat/completions", body, on_chunk=kill))
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2].removeprefix(b"data: "))["error"]["type"] == "upstream_error"


def test_transfer_failures_are_retried_and_everyone_else_succeeds(procs):
    gw, prefills, decodes = start_pd(procs, 2, 2, prefill_args=("--fault-transfer-fail-rate", "0.05"),
                                     gateway_args=("--cb-failure-threshold", "50", "--max-retries", "3"))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: request_json("POST", gw.url + "/generate", {
            "text": f"request {i} " * 10, "sampling_params": {"max_new_tokens": 3}}), range(80)))
    assert [s for s, _ in results].count(200) == 80, [d for s, d in results if s != 200][:3]
    _, state = request_json("GET", gw.url + "/workers")
    assert all(w["healthy"] for w in state["workers"])
    failed = sum(metric_value(get_text(p) , "sglang:num_transfer_failed_reqs_total")
                 for p in [u + "/metrics" for u, _ in prefills] + [d.url + "/metrics" for d in decodes])
    assert failed >= 1  # the fault really fired, and the gateway hid it
    assert metric_value(get_text(gw.url + "/metrics"), "kvgate_retries_total") >= 1  # by trying another pair


def test_hanging_decode_times_out_with_504_and_the_leg_still_waiting_is_aborted(procs):
    """A hanging decode never asks prefill for the KV, so both legs hit the read timeout at
    about the same moment: whichever the gateway sees fail first, the other is aborted."""
    gw, prefills, decodes = start_pd(procs, 1, 1, decode_args=("--fault-hang-rate", "1.0"),
                                     gateway_args=("--request-timeout-secs", "2", "--max-retries", "0"))
    status, data = request_json("POST", gw.url + "/generate", {"text": "hang", "sampling_params": {"max_new_tokens": 2}},
                                headers={"X-Request-ID": "decode-hangs"})
    assert status == 504 and data["error"]["code"] == "upstream_timeout"
    prefill = next(p for p in procs if p.url == prefills[0][0])
    deadline = time.monotonic() + 10
    while not any("abort_request rid=decode-hangs-0 " in w.output() for w in (prefill, decodes[0])):
        assert time.monotonic() < deadline, "neither leg got /abort_request"
        time.sleep(0.05)


def test_decode_connection_lost_aborts_the_prefill_leg(procs):
    gw, prefills, decodes = start_pd(procs, 1, 1, decode_args=("--fault-crash-after", "1"),
                                     gateway_args=("--max-retries", "0"))
    assert request_json("POST", gw.url + "/generate", {"text": "warm", "sampling_params": {"max_new_tokens": 2}})[0] == 200
    status, _ = request_json("POST", gw.url + "/generate", {"text": "z" * 100, "sampling_params": {"max_new_tokens": 2}},
                             headers={"X-Request-ID": "decode-crashes"})
    assert status == 502 and decodes[0].popen.wait(10) == 17  # decode exited on arrival; prefill waited for it
    wait_for_abort(next(p for p in procs if p.url == prefills[0][0]), "decode-crashes-0")


def test_joint_pair_policy_serves_through_the_gateway(procs):
    gw, _, _ = start_pd(procs, 2, 2, gateway_args=("--policy", "pd_cost"))
    for i in range(4):
        status, data = request_json("POST", gw.url + "/generate", {
            "text": "joint pair " * 30 + str(i), "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and data["meta_info"]["completion_tokens"] == 2
    metrics = get_text(gw.url + "/metrics")
    assert metric_value(metrics, "kvgate_policy_stat", policy="prefill:pd_cost", stat="hit_verified_requests_total") == 4


def test_two_replicas_deciding_at_once_claim_different_prefill_workers(procs):
    """PD replicas claim the prefill worker as unified ones claim theirs: two requests that
    reach two replicas at once would both pick the first prefill worker (``least_load``)."""
    import threading

    from gateway.nats_server import EmbeddedNats
    from tests.test_gateway_peers import Stream

    with EmbeddedNats() as nats:
        shared = ("--policy", "least_load", "--state-url", nats.url, "--state-heartbeat-secs", "0.3")
        a, prefills, decodes = start_pd(procs, gateway_args=shared)
        b = _start_gateway(procs, args=pd_args(prefills, [d.url for d in decodes]) + shared)

        def state(gw, name, **labels):
            return metric_value(get_text(gw.url + "/metrics"), name, **labels)

        deadline = time.monotonic() + 20
        while not all(state(gw, "kvgate_state_claims_ready") == 1 and state(gw, "kvgate_state_peers") >= 1
                      for gw in (a, b)):
            assert time.monotonic() < deadline, "the replicas never heard each other"
            time.sleep(0.1)
        start = threading.Barrier(2)
        streams = [Stream(a, max_tokens=400, start=start), Stream(b, max_tokens=400, start=start)]
        for s in streams:
            s.thread.join(60)
        assert all(s.error is None for s in streams)
        per_prefill = [sum(state(gw, "kvgate_routed_total", worker=url) for gw in (a, b)) for url, _ in prefills]
        assert per_prefill == [1, 1]
