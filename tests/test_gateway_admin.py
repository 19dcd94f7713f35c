"""The gateway's fleet and info routes on real processes: /add_worker and /remove_worker
(sglang-router's spelling) change where requests go, /liveness answers, and /server_info,
/get_server_info, /model_info, /get_model_info are the engine's own answers."""

from __future__ import annotations

import time

from tests.support import get_text, metric_value, request_json
from tests.test_gateway_faults import chat, workers


def served(sim) -> float:
    return metric_value(get_text(sim.url + "/metrics"), "sglang:num_requests_total")


def test_info_routes_are_the_engines_answers(start_sim, start_gateway):
    sim = start_sim("--time-scale", "20")
    gw = start_gateway(sim.url)
    assert request_json("GET", gw.url + "/liveness")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        assert request_json("GET", gw.url + path) == request_json("GET", sim.url + path)
    for path in ("/server_info", "/get_server_info"):
        status, info = request_json("GET", gw.url + path)
        _, own = request_json("GET", sim.url + path)
        assert status == 200 and info["served_model_name"] == own["served_model_name"] == "sim-llama-8b"
        assert {k: v for k, v in info.items() if k != "internal_states"} == {
            k: v for k, v in own.items() if k != "internal_states"}  # internal_states: live load


def test_workers_added_and_removed_at_runtime_get_and_lose_traffic(start_sim, start_gateway):
    a = start_sim("--time-scale", "20", name="a")
    b = start_sim("--time-scale", "20", name="b")
    gw = start_gateway(a.url, args=("--policy", "round_robin"))
    status, added = request_json("POST", gw.url + "/add_worker?url=" + b.url)
    assert status == 201 and added["url"] == b.url
    assert request_json("POST", gw.url + "/add_worker?url=" + b.url)[0] == 409
    assert request_json("POST", gw.url + "/add_worker", {"url": b.url + "/x", "role": "sidecar"})[0] == 400
    deadline = time.monotonic() + 10
    while not workers(gw.url).get(b.url, {}).get("healthy"):
        assert time.monotonic() < deadline, workers(gw.url)
        time.sleep(0.05)
    before_b = served(b)
    assert all(chat(gw.url, f"both {i}")[0] == 200 for i in range(4))
    assert served(b) - before_b == 2  # round robin over a and the new b

    status, removed = request_json("POST", gw.url + "/remove_worker?url=" + a.url)
    assert status == 200 and removed["url"] == a.url and set(workers(gw.url)) == {b.url}
    assert request_json("POST", gw.url + "/remove_worker?url=" + a.url)[0] == 404
    before_a, before_b = served(a), served(b)
    assert all(chat(gw.url, f"only b {i}")[0] == 200 for i in range(4))
    assert served(a) == before_a and served(b) - before_b == 4
