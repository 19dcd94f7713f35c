"""The README's main command, ``kvgate up``, starts a working stack (unified and PD)."""

from __future__ import annotations

import sys

import pytest

from tests.support import FREE_PORT, Proc, request_json, serve


@pytest.mark.parametrize("extra", [(), ("--pd", "--prefill-workers", "1", "--decode-workers", "1")])
def test_kvgate_up_serves_chat_on_simulated_workers(extra):
    proc = serve([sys.executable, "-m", "gateway", "up", "--port", FREE_PORT, "--workers", "2", "--time-scale", "20",
                  *extra], "/readiness", name="up")
    try:
        url = proc.url
        models = request_json("GET", url + "/v1/models")[1]["data"]
        status, data = request_json("POST", url + "/v1/chat/completions", {
            "model": models[0]["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200 and data["usage"]["completion_tokens"] == 3
        _, workers = request_json("GET", url + "/workers")
        roles = sorted(w["role"] for w in workers["workers"])
        assert roles == (["decode", "prefill"] if extra else ["unified", "unified"])
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]  # SIGTERM: clean shutdown, workers stopped too


def test_policies_command_lists_builtins():
    proc = Proc.python("gateway", "policies", name="policies")
    assert proc.popen.wait(30) == 0
    out = proc.output()
    for name in ("round_robin", "least_load", "power_of_two", "consistent_hash"):
        assert name in out
    proc.stop()
