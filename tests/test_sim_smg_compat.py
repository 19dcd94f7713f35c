"""SMG 1.13 (sglang-router's successor, the real Rust gateway) drives simulated workers.

SMG reads each worker's load from ``/v1/loads`` and falls back to ``/metrics`` (which carries
no token capacity) when the record does not parse as SGLang's, so ``max_total_num_tokens`` on
its ``/get_loads`` tells which one it read.
"""

from __future__ import annotations

import json
import urllib.request

from bench.services import smg_python, start_smg
from simulator.cluster import SimCluster
from tests.requires import missing
from tests.support import request_json

if smg_python() is None:
    missing("smg is not installed (scripts/setup.sh --bench or --test installs it in .venv-smg)")


def test_smg_reads_v1_loads_and_routes_cache_aware(tmp_path):
    with SimCluster(workers=2, engine_args=["--time-scale", "20"]) as c:
        svc = start_smg(c.urls, "cache_aware", {}, tmp_path / "smg.log")  # waits until it polled both
        try:
            status, loads = request_json("GET", svc.url + "/get_loads")
            assert status == 200
            by_worker = {x["worker"]: x for x in loads["loads"]}
            assert set(by_worker) == set(c.urls)
            for url in c.urls:
                info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=5).read())
                assert by_worker[url]["max_total_num_tokens"] == info["max_total_num_tokens"]
            body = {"text": "S" * 2000, "sampling_params": {"max_new_tokens": 4}}
            first = request_json("POST", svc.url + "/generate", body)[1]
            again = request_json("POST", svc.url + "/generate", body)[1]
            assert first["meta_info"]["cached_tokens"] == 0
            assert again["meta_info"]["cached_tokens"] >= 1920  # cache-aware sent it back to the warm worker
        finally:
            svc.stop()


def test_smg_pd_over_simulated_prefill_and_decode(tmp_path):
    with SimCluster(workers=0, prefill=1, decode=1, engine_args=["--time-scale", "20"], startup_timeout=40) as c:
        (purl, bport), durl = c.prefill[0], c.decode[0]
        svc = start_smg([], "cache_aware", {}, tmp_path / "smg.log",
                        pd=["--pd-disaggregation", "--prefill", purl, str(bport), "--decode", durl])
        try:
            status, out = request_json("POST", svc.url + "/generate",
                                       {"text": "hello" * 300, "sampling_params": {"max_new_tokens": 6}})
            assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        finally:
            svc.stop()
