"""Version knobs: older SGLang wire behaviour on request (--sglang-version)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.sim_support import sim_worker


def post(url: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_sglang_0_5_5_wire():
    with sim_worker("--time-scale", "50", "--sglang-version", "0.5.5") as (url, _):
        # output_ids are deltas while streaming in <= 0.5.5
        status, raw = post(url + "/generate", {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 40}})
        chunks = [json.loads(ln[6:]) for ln in raw.split(b"\n") if ln.startswith(b"data: {")]
        assert sum(len(c["output_ids"]) for c in chunks) == 40 and len(chunks) > 1
        assert len(chunks[-1]["output_ids"]) < 40
        # unknown sampling keys are ignored before 0.5.23
        assert post(url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1, "zzz": 1}})[0] == 200
        loads = json.loads(urllib.request.urlopen(url + "/get_load", timeout=5).read())
        assert set(loads[0]) >= {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "/v1/loads", timeout=5)


def test_hicache_host_tier_hits():
    args = ("--time-scale", "50", "--profile", "tiny-test", "--enable-hierarchical-cache", "--hicache-ratio", "4")
    with sim_worker(*args) as (url, _):
        prompts = [chr(65 + i) * 1500 for i in range(4)]
        for p in prompts:  # 4 x 1500 tokens through a 4096-token device pool
            assert post(url + "/generate", {"text": p, "sampling_params": {"max_new_tokens": 1}})[0] == 200
        status, raw = post(url + "/generate", {"text": prompts[0], "sampling_params": {"max_new_tokens": 1}})
        details = json.loads(raw)["meta_info"]["cached_tokens_details"]
        assert details["host"] > 0 and json.loads(raw)["meta_info"]["cached_tokens"] == details["host"] + details["device"]
        metrics = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        line = next(ln for ln in metrics.splitlines() if ln.startswith("sglang:hicache_host_used_tokens{"))
        assert float(line.rsplit(" ", 1)[1]) > 0
