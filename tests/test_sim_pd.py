"""PD disaggregation between two simulated workers, KV bytes moved by Mooncake for real."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.requires import need
from tests.support import request_json

need("mooncake.engine", "the Mooncake transfer engine, pip extra 'mooncake'")

from simulator.cluster import SimCluster  # noqa: E402


@pytest.fixture(scope="module")
def pd():
    with SimCluster(workers=0, prefill=1, decode=1, startup_timeout=40,
                    engine_args=["--time-scale", "20", "--disaggregation-waiting-timeout", "1.5",
                                 "--disaggregation-bootstrap-timeout", "1.5", "--transfer-bandwidth-gbps", "50"]) as c:
        yield c


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, object]:
    return request_json("POST", url, body, timeout=timeout)


def pd_request(pd: SimCluster, body: dict) -> tuple[tuple, tuple]:
    """Send the same body to prefill and decode concurrently, like sglang-router."""
    (purl, bport), durl = pd.prefill[0], pd.decode[0]
    body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=bport, bootstrap_room=random.randrange(2**63))
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("p", post(purl + "/generate", body)))
    t.start()
    d = post(durl + "/generate", body)
    t.join(30)
    return out["p"], d


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_pd_request_moves_kv_through_mooncake(pd):
    (purl, _), durl = pd.prefill[0], pd.decode[0]
    (ps, pout), (ds, dout) = pd_request(pd, {"text": "P" * 3000, "sampling_params": {"max_new_tokens": 12}})
    assert ps == 200 and ds == 200, (pout, dout)
    assert pout["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(pout["output_ids"]) == 1
    assert dout["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert dout["output_ids"][0] == pout["output_ids"][0]  # decode continues prefill's first token
    assert pout["meta_info"]["kv_transfer"]["loopback_bytes"] == 3000 * 4096
    assert metric(durl, "sglang:kv_transfer_latency_ms_count") >= 1
    assert metric(purl, "sglang:kv_transfer_latency_ms_count") >= 1
    info = json.loads(urllib.request.urlopen(purl + "/server_info", timeout=5).read())
    assert info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == pd.prefill[0][1]
    # the bootstrap server answers SGLang's routes
    boot = f"http://127.0.0.1:{pd.prefill[0][1]}"
    assert urllib.request.urlopen(boot + "/health", timeout=5).status == 200
    assert "rank_port" in json.loads(urllib.request.urlopen(boot + "/route?engine_rank=0&target_dp_group=0",
                                                            timeout=5).read())


def server_info(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/server_info", timeout=5).read())


def test_transfer_is_charged_as_the_models_kv_over_the_link(pd):
    """Reported bytes are the profile's KV (llama3-8b: 128 KiB/token) and the time is those
    bytes over --transfer-bandwidth-gbps in simulated time; loopback moves --kv-bytes-per-token."""
    (purl, _), durl = pd.prefill[0], pd.decode[0]
    before = {u: server_info(u)["simulator"]["pd_transfer"] for u in (purl, durl)}
    (ps, pout), (ds, dout) = pd_request(pd, {"text": "Q" * 2000, "sampling_params": {"max_new_tokens": 3}})
    assert ps == 200 and ds == 200, (pout, dout)
    kv = pout["meta_info"]["kv_transfer"]
    model_bytes = 2000 * 131072
    assert kv["bytes"] == model_bytes and kv["loopback_bytes"] == 2000 * 4096
    # one transfer on an idle link: exactly the link time, whatever loopback took
    assert kv["latency_ms"] == pytest.approx(model_bytes / 50e9 * 1000)
    for url in (purl, durl):
        after = server_info(url)["simulator"]["pd_transfer"]
        assert after["transfers"] - before[url]["transfers"] == 1
        assert after["model_bytes"] - before[url]["model_bytes"] == model_bytes
        assert after["loopback_bytes"] - before[url]["loopback_bytes"] == 2000 * 4096
        assert after["sim_s"] - before[url]["sim_s"] == pytest.approx(model_bytes / 50e9)
    assert metric(durl, "sglang:kv_transfer_speed_gb_s") == pytest.approx(50.0)


def test_requests_without_room_are_400(pd):
    for url in (pd.decode[0], pd.prefill[0][0]):
        status, body = post(url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert status == 400
        assert body["error"]["message"] == "Disaggregated request received without bootstrap room id"


def test_abort_request_ends_a_decode_leg_waiting_for_kv(pd):
    durl = pd.decode[0]
    body = {"text": "orphan", "rid": "leg-1", "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.prefill[0][1],
            "bootstrap_room": 999, "sampling_params": {"max_new_tokens": 4}}
    out: dict = {}
    failed = metric(durl, "sglang:num_transfer_failed_reqs_total")
    t = threading.Thread(target=lambda: out.setdefault("r", post(durl + "/generate", body)))
    t.start()
    deadline = time.monotonic() + 5
    while metric(durl, "sglang:num_decode_transfer_queue_reqs") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(durl, "sglang:num_decode_transfer_queue_reqs") == 1
    assert post(durl + "/abort_request", {"rid": "leg-1"})[0] == 200
    t.join(10)
    status, data = out["r"]
    # Ended by the abort, not by the 1.5 s waiting timeout (a 500 "Decode transfer failed" that
    # counts a failed transfer), however long the machine took to get here.
    reason = data["meta_info"]["finish_reason"]
    assert status == 200 and (reason["type"], reason["message"]) == ("abort", "Abort before KV transfer finished"), out
    assert metric(durl, "sglang:num_transfer_failed_reqs_total") == failed
    assert metric(durl, "sglang:num_decode_transfer_queue_reqs") == 0


def test_room_that_never_arrives_times_out(pd):
    durl = pd.decode[0]
    body = {"text": "lonely", "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.prefill[0][1],
            "bootstrap_room": 12345, "sampling_params": {"max_new_tokens": 4}}
    t0 = time.monotonic()
    status, out = post(durl + "/generate", body)
    assert status == 500 and out["error"]["message"].startswith("Decode transfer failed for request")
    assert 1.0 < time.monotonic() - t0 < 10
    req = urllib.request.Request(durl + "/generate", data=json.dumps(dict(body, stream=True, bootstrap_room=678)).encode())
    with urllib.request.urlopen(req, timeout=10) as r:
        lines = [ln.strip() for ln in r if ln.strip()]
    assert lines[-1] == b"data: [DONE]"
    chunk = json.loads(lines[-2][6:])
    assert chunk["meta_info"]["finish_reason"]["type"] == "abort"
    assert metric(durl, "sglang:num_transfer_failed_reqs_total") >= 2
