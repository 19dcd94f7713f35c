"""What crosses the wire: the gateway forwards request bodies byte for byte.

The upstream here is a recording HTTP server on 127.0.0.1 (in a thread of the test), not
an engine: the property under test is the bytes themselves, which an engine would parse
and discard.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import pytest
from aiohttp import web



class Recorder:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.port = 0  # bound by the site; the real port is read back once it listens
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _record(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.read())
        self.headers.append(dict(request.headers))
        return web.json_response({"text": "ok", "meta_info": {"id": "x", "prompt_tokens": 3, "completion_tokens": 1,
                                                              "cached_tokens": 0}})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "rec-model", "object": "model"}]})

    async def _ok(self, _: web.Request) -> web.Response:
        return web.json_response({})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        for p in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(p, self._record)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/server_info", self._ok)
        runner = self._runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> "Recorder":
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.mark.parametrize("route,body", [
    ("/generate", b'{"text":"hi","sampling_params":{"max_new_tokens":4,"zz_future_knob":[1,2.50,{"a":null}]},'
                  b'"rid":"r-1","bootstrap_room":12345678901234567,"custom_labels":{"t":"x"},"lora_path":"a"}'),
    ("/v1/chat/completions", b'{ "model" : "rec-model", "messages":[{"role":"user","content":"h\\u00e9 \xf0\x9f\x99\x82"}],'
                             b'  "top_k": 20, "regex": "[a-z]+", "separate_reasoning": true, "x":1e400 }'),
    ("/v1/completions", b'{"model":"rec-model","prompt":[1,2,3],"min_p":0.05,"ebnf":"root ::= \\"a\\"","unknown":{}}'),
])
def test_body_reaches_the_engine_byte_for_byte(start_gateway, route, body):
    with Recorder() as rec:
        gw = start_gateway(rec.url)
        status, _, headers = post(gw.url + route, body, {"X-Request-ID": "trace-abc"})
        assert status == 200
        assert rec.bodies[-1] == body  # whitespace, key order, number spelling, unknown fields: all kept
        assert rec.headers[-1]["X-Request-ID"] == "trace-abc"
        assert headers["X-Request-ID"] == "trace-abc"


def test_request_id_is_generated_when_absent_and_worker_key_replaces_client_key(start_gateway):
    with Recorder() as rec:
        gw = start_gateway(rec.url, args=("--api-key", "client-secret", "--worker-api-key", "worker-secret"))
        status, _, headers = post(gw.url + "/generate", b'{"text":"a"}', {"Authorization": "Bearer client-secret"})
        assert status == 200
        assert len(headers["X-Request-ID"]) == 32
        assert rec.headers[-1]["X-Request-ID"] == headers["X-Request-ID"]
        assert rec.headers[-1]["Authorization"] == "Bearer worker-secret"
        status, body, _ = post(gw.url + "/generate", b'{"text":"a"}', {"Authorization": "Bearer wrong"})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert len(rec.bodies) == 1
