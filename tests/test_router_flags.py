"""A launch command written for sglang-router runs as ``kvgate serve``: every flag sglang-router
0.3.2 has is known (its own name, a second name of kvgate's, a policy option, accepted with a
warning, or refused with what to use instead), and the common ones do what they did there."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from gateway.cli import build_parser, config_from_args
from gateway.router_flags import IGNORED, TUNING, UNSUPPORTED
from tests.conftest import MODEL
from tests.requires import need
from tests.support import FREE_PORT, Proc, metric_value, request_json, serve


def _kvgate_flags() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    return set(serve._option_string_actions)


def test_every_flag_of_sglang_router_is_known():
    need("sglang_router", "pip extra 'test'")
    text = subprocess.run([sys.executable, "-m", "sglang_router.launch_router", "--help"], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    theirs = set(re.findall(r"^\s+(--[a-z0-9][a-z0-9-]*)", text, re.M)) - {"--help"}
    assert len(theirs) > 90, sorted(theirs)  # the help was read, not an error message
    assert not theirs - _kvgate_flags(), sorted(theirs - _kvgate_flags())


def config(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", "--worker-urls", "http://127.0.0.1:1", *argv]))


def test_renamed_flags_set_kvgates_own_fields():
    cfg = config("--shutdown-grace-period-secs", "5", "--retry-max-retries", "4", "--cb-timeout-duration-secs", "3",
                 "--log-level", "warn", "--model-path", "byte", "--ca-cert-paths", "ca.pem")
    assert (cfg.shutdown_grace_secs, cfg.max_retries, cfg.cb_timeout_secs) == (5.0, 4, 3.0)
    assert (cfg.log_level, cfg.tokenizer, cfg.worker_ca_file) == ("warning", "byte", "ca.pem")
    off = config("--disable-retries", "--disable-circuit-breaker")
    assert off.max_retries == 0 and off.cb_failure_threshold >= 1 << 30


def test_tuning_flags_reach_the_policy_that_declares_them(caplog):
    cfg = config("--policy", "cache_aware", "--cache-threshold", "0.5", "--balance-abs-threshold", "32",
                 "--balance-rel-threshold", "1.2", "--eviction-interval-secs", "30", "--max-tree-size", "1000")
    assert cfg.policy_options == {"cache_threshold": 0.5, "balance_abs_threshold": 32.0, "balance_rel_threshold": 1.2,
                                  "eviction_interval_s": 30.0, "max_tree_size": 1000}
    assert set(cfg.policy_options) == {name for name, _ in TUNING.values()}
    # an explicit policy option wins; a policy without the option keeps its own way, and says so
    assert config("--policy", "cache_aware", "--policy-option", "cache_threshold=0.7",
                  "--cache-threshold", "0.5").policy_options == {"cache_threshold": 0.7}
    assert config("--cache-threshold", "0.5", "--retry-jitter-factor", "0.1").policy_options == {}
    assert "--cache-threshold ignored: policy cost has no option cache_threshold" in caplog.text
    assert "--retry-jitter-factor ignored" in caplog.text


@pytest.mark.parametrize("flag", ["--history-backend", "--jwt-issuer", "--cors-allowed-origins", "--dp-aware"])
def test_a_feature_kvgate_lacks_stops_the_start_with_what_to_use(flag):
    assert flag in UNSUPPORTED and flag not in IGNORED
    with pytest.raises(SystemExit) as stop:
        config(flag, "x") if flag != "--dp-aware" else config(flag)
    assert f"{flag}: {UNSUPPORTED[flag]}" in str(stop.value)


def test_a_sglang_router_command_line_serves(start_sim, start_gateway):
    """As the bench starts sglang-router, plus the flags a deployment tunes: the gateway comes up,
    cache_aware runs with the thresholds given, and a repeated prompt goes back to its worker."""
    a, b = start_sim("--time-scale", "20", name="a"), start_sim("--time-scale", "20", name="b")
    gw = start_gateway(a.url, b.url, args=("--policy", "cache_aware", "--cache-threshold", "0.5",
                                           "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.5",
                                           "--eviction-interval-secs", "60", "--shutdown-grace-period-secs", "5",
                                           "--retry-max-retries", "3", "--cb-timeout-duration-secs", "10",
                                           "--request-timeout-secs", "60",
                                           "--worker-startup-timeout-secs", "30"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "S" * 800}], "max_tokens": 4}
    assert request_json("POST", gw.url + "/v1/chat/completions", body)[0] == 200
    status, again = request_json("POST", gw.url + "/v1/chat/completions", body)
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 768
    assert gw.stop() == 0
    out = gw.output()
    assert "policy=cache_aware balance_abs_threshold=32.0 balance_rel_threshold=1.5 cache_threshold=0.5 " \
           "eviction_interval_s=60.0," in out, out[-3000:]
    assert "--worker-startup-timeout-secs ignored" in out


def test_a_refused_flag_stops_the_start_before_listening():
    proc = Proc.python("gateway", "serve", "--host", "127.0.0.1", "--port", "0", "--worker-urls", "http://127.0.0.1:1",
                       "--jwt-issuer", "https://issuer.example", name="gateway")
    try:
        code = proc.popen.wait(30)
    finally:
        proc.stop()
    assert code != 0 and "--jwt-issuer: give --api-key / --admin-api-key" in proc.output()
    assert "listening" not in proc.output()


def test_metrics_on_a_port_of_their_own(start_sim):
    """``--prometheus-port``: the same figures as the main port's /metrics, nothing else there, and
    the main port's rule for who may read them (``--protect-metrics``: an admin key)."""
    sim = start_sim("--time-scale", "20")
    gw = serve([sys.executable, "-m", "gateway", "serve", "--host", "127.0.0.1", "--port", FREE_PORT,
                "--prometheus-port", FREE_PORT, "--worker-urls", sim.url, "--admin-api-key", "adm",
                "--protect-metrics"], "/health", name="gateway")
    try:
        scrape = f"http://127.0.0.1:{gw.ports[1]}"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert request_json("POST", gw.url + "/v1/chat/completions", body)[0] == 200
        assert request_json("GET", scrape + "/metrics")[0] == 401
        status, text = request_json("GET", scrape + "/metrics", headers={"Authorization": "Bearer adm"})
        assert status == 200
        assert metric_value(str(text), "kvgate_requests_total", route="/v1/chat/completions", status="200") == 1
        assert request_json("GET", scrape + "/v1/models")[0] == 404
        assert request_json("GET", scrape + "/health")[0] == 404
        assert gw.stop() == 0
    finally:
        gw.stop()


def test_request_id_headers_and_health_check_endpoint(start_sim, start_gateway):
    """``--request-id-headers``: the first of them a client sends names its request, upstream and in
    the answer; ``--health-check-endpoint``: the path workers are probed on (a wrong one keeps
    every worker out)."""
    sim = start_sim("--time-scale", "20")
    gw = start_gateway(sim.url, args=("--request-id-headers", "X-Trace-ID", "X-Request-ID",
                                      "--health-check-endpoint", "/health_generate"))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = urllib.request.Request(gw.url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Trace-ID": "trace-7",
                                          "X-Request-ID": "second"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200 and resp.headers["X-Request-ID"] == "trace-7"
    wrong = start_gateway(sim.url, args=("--health-check-endpoint", "/nope"), ready=False)
    time.sleep(1.0)  # two health rounds at 0.5 s: probed on /health the worker would be in by now
    assert request_json("GET", wrong.url + "/readiness")[0] == 503
    with pytest.raises(SystemExit, match="must be a path"):
        config("--health-check-endpoint", "health")


def test_log_dir_keeps_the_log_in_a_file(start_sim, start_gateway, tmp_path):
    sim = start_sim("--time-scale", "20")
    gw = start_gateway(sim.url, args=("--log-dir", str(tmp_path / "logs")))
    assert gw.stop() == 0
    text = (tmp_path / "logs" / "kvgate.log").read_text()
    assert "kvgate listening on" in text and "shut down" in text
