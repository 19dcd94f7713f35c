"""Per-key rate limits, admin/data key separation, key files, and keys kept out of logs."""

from __future__ import annotations

import time
from pathlib import Path
import urllib.error
import urllib.request

from tests.conftest import MODEL
from tests.support import request_json

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def call(method: str, url: str, key: str | None = None, body: object | None = None) -> tuple[int, object, dict]:
    """Like request_json, plus the response headers."""
    import json

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, raw, hdrs = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), dict(e.headers)
    try:
        return status, json.loads(raw) if raw else None, hdrs
    except ValueError:
        return status, raw.decode(errors="replace"), hdrs


def assert_openai_error(data: object, type_: str, code: str) -> None:
    assert isinstance(data, dict) and set(data) == {"error"}, data
    err = data["error"]
    assert err["type"] == type_ and err["code"] == code and isinstance(err["message"], str), err


def test_rate_limit_is_per_api_key_with_retry_after(start_sim, start_gateway):
    sim = start_sim("--time-scale", "50")
    gw = start_gateway(sim.url, args=("--api-key", "key-a", "--api-key", "key-b",
                                      "--rate-limit-rps", "0.5", "--rate-limit-burst", "3"))
    url = gw.url + "/v1/chat/completions"
    a = [call("POST", url, "key-a", CHAT) for _ in range(6)]
    assert [s for s, _, _ in a[:3]] == [200, 200, 200], a
    limited = [r for r in a[3:] if r[0] == 429]
    assert len(limited) >= 2, a  # one token refills every 2 s: two would take the six calls 4 s
    for status, data, headers in limited:
        assert_openai_error(data, "rate_limit_error", "rate_limit_exceeded")
        assert int(headers["Retry-After"]) >= 1
    # another key has its own bucket; a wrong key is refused by auth, not counted
    assert call("POST", url, "key-b", CHAT)[0] == 200
    assert call("POST", url, "nope", CHAT)[0] == 401
    time.sleep(int(limited[-1][2]["Retry-After"]))
    assert call("POST", url, "key-a", CHAT)[0] == 200
    # health probes are never limited
    assert all(call("GET", gw.url + "/health")[0] == 200 for _ in range(5))


def test_rate_limit_by_client_address_without_auth(start_sim, start_gateway):
    sim = start_sim("--time-scale", "50")
    gw = start_gateway(sim.url, args=("--rate-limit-rps", "0.1", "--rate-limit-burst", "1"))
    started = time.monotonic()
    assert call("GET", gw.url + "/v1/models")[0] == 200
    status, data, headers = call("GET", gw.url + "/v1/models")
    between = time.monotonic() - started  # at least what the gateway saw between the two
    # The next token is 10 s after the first call (whole seconds, rounded up).
    assert status == 429 and 10 - between <= int(headers["Retry-After"]) <= 10, (headers, between)
    assert_openai_error(data, "rate_limit_error", "rate_limit_exceeded")


def test_admin_key_separation_and_key_file(start_sim, start_gateway, tmp_path):
    a = start_sim("--time-scale", "50", name="a")
    b = start_sim("--time-scale", "50", name="b")
    key_file = tmp_path / "keys"
    key_file.write_text("\nfile-key-1\n  file-key-2  \n\n")
    gw = start_gateway(a.url, args=("--api-key-file", str(key_file), "--admin-api-key", "admin-key"))
    chat = gw.url + "/v1/chat/completions"
    assert call("POST", chat, "file-key-1", CHAT)[0] == 200
    assert call("POST", chat, "file-key-2", CHAT)[0] == 200
    status, data, headers = call("POST", chat, None, CHAT)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert_openai_error(data, "authentication_error", "invalid_api_key")
    assert call("POST", chat, "file-key-", CHAT)[0] == 401  # a prefix is not a key
    assert call("POST", chat, "admin-key", CHAT)[0] == 401  # the admin key is for admin routes only
    # a valid data key cannot manage workers; the admin key can
    status, data, _ = call("POST", gw.url + "/workers", "file-key-1", {"url": b.url})
    assert status == 403
    assert_openai_error(data, "permission_error", "admin_key_required")
    assert call("GET", gw.url + "/workers", "file-key-1")[0] == 403
    assert call("POST", gw.url + "/workers", "wrong", {"url": b.url})[0] == 401
    status, data, _ = call("POST", gw.url + "/workers", "admin-key", {"url": b.url})
    assert status == 201 and data["url"] == b.url
    status, data, _ = call("GET", gw.url + "/workers", "admin-key")
    assert {w["url"] for w in data["workers"]} == {a.url, b.url}
    assert call("DELETE", gw.url + f"/workers?url={b.url}", "file-key-2")[0] == 403
    assert call("DELETE", gw.url + f"/workers?url={b.url}", "admin-key")[0] == 200
    assert call("GET", gw.url + "/metrics")[0] == 200  # scrapes and probes stay open


def test_keys_never_reach_the_logs(start_sim, start_gateway):
    sim = start_sim("--time-scale", "50")
    secrets = {"data": "sk-data-5f1e9c", "admin": "sk-admin-7a2d4b", "worker": "sk-worker-3c8e1f",
               "wrong": "sk-wrong-9b6a0d", "added": "sk-added-worker-1d4f7e"}
    failing = start_sim("--time-scale", "50", "--fault-fail-rate", "1.0", name="failing")
    gw = start_gateway(sim.url, args=("--api-key", secrets["data"], "--admin-api-key", secrets["admin"],
                                      "--worker-api-key", secrets["worker"], "--log-level", "debug",
                                      "--max-retries", "1", "--policy", "round_robin"))  # reaches the failing worker
    chat = gw.url + "/v1/chat/completions"
    assert call("POST", chat, secrets["data"], CHAT)[0] == 200
    assert call("POST", chat, secrets["data"], {**CHAT, "stream": True})[0] == 200
    assert call("POST", chat, secrets["wrong"], CHAT)[0] == 401
    assert call("POST", gw.url + "/workers", secrets["data"], {"url": failing.url})[0] == 403
    status, data, _ = call("POST", gw.url + "/workers", secrets["admin"],
                           {"url": failing.url, "api_key": secrets["added"]})
    assert status == 201 and secrets["added"] not in str(data)
    status, data, _ = call("GET", gw.url + "/workers", secrets["admin"])
    assert status == 200 and not any(s in str(data) for s in secrets.values())
    for i in range(4):  # the failing worker's errors are logged with its URL, not its key; retries succeed
        assert call("POST", chat, secrets["data"], {**CHAT, "user": f"u{i}"})[0] == 200
    call("POST", gw.url + "/flush_cache", secrets["admin"])
    status, metrics_text = request_json("GET", gw.url + "/metrics")
    assert not any(s in str(metrics_text) for s in secrets.values())
    time.sleep(1.2)  # two health rounds carry the worker keys upstream
    assert gw.stop() == 0
    log = Path(gw.log.name).read_text(errors="replace")
    assert "DEBUG" in log and f"upstream {failing.url} failed" in log, log[-2000:]
    leaked = [name for name, s in secrets.items() if s in log]
    assert not leaked, f"keys in the gateway log: {leaked}"
