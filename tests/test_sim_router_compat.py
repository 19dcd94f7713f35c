"""sglang-router 0.3.2 (the real Rust router) drives simulated workers, unified and PD."""

from __future__ import annotations

import json
import sys
import urllib.request

import openai

from tests.requires import need

need("sglang_router", "pip extra 'test'")

from simulator.cluster import SimCluster  # noqa: E402
from tests.support import FREE_PORT, Proc, serve  # noqa: E402


def _router(*args: str) -> tuple[str, Proc]:
    p = serve([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", FREE_PORT,
               "--prometheus-port", FREE_PORT, *args], "/health", name="sglang-router")
    return p.url, p


def test_router_cache_aware_over_simulated_workers():
    with SimCluster(workers=2, engine_args=["--time-scale", "20"]) as c:
        url, router = _router("--worker-urls", *c.urls, "--policy", "cache_aware")
        try:
            cl = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            msgs = [{"role": "user", "content": "S" * 800}]
            cl.chat.completions.create(model="sim-llama-8b", messages=msgs, max_tokens=8)
            again = cl.chat.completions.create(model="sim-llama-8b", messages=msgs, max_tokens=8)
            assert again.usage.prompt_tokens_details.cached_tokens >= 768  # cache-aware sent it back
            chunks = list(cl.completions.create(model="sim-llama-8b", prompt="abc", max_tokens=5, stream=True))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finally:
            router.stop()


def test_router_pd_over_simulated_prefill_and_decode():
    with SimCluster(workers=0, prefill=1, decode=1, engine_args=["--time-scale", "20"], startup_timeout=40) as c:
        (purl, bport), durl = c.prefill[0], c.decode[0]
        url, router = _router("--pd-disaggregation", "--prefill", purl, str(bport), "--decode", durl)
        try:
            req = urllib.request.Request(url + "/generate", data=json.dumps(
                {"text": "hello" * 300, "sampling_params": {"max_new_tokens": 6}}).encode(),
                headers={"Content-Type": "application/json"})
            out = json.loads(urllib.request.urlopen(req, timeout=30).read())
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
            cl = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            chunks = list(cl.chat.completions.create(model="sim-llama-8b", messages=[{"role": "user", "content": "hey"}],
                                                     max_tokens=5, stream=True))
            assert len("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)) == 5
        finally:
            router.stop()
