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



# A Responses stream as SGLang frames it (no [DONE]), written in pieces that cut its first
# event, the one naming the response, in the middle (tests/test_response_owners.py reads
# it cut at every size).
STREAM = (b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_wire","object":'
          b'"response","status":"in_progress"},"sequence_number":0}\n\n'
          b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"h\\u00e9",'
          b'"sequence_number":1}\n\n'
          b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_wire"},'
          b'"sequence_number":2}\n\n')
STREAM_CUTS = (7, 60, 61, 200)


class Recorder:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.follow_ups: list[tuple[str, str, bytes]] = []  # method, path and query, body
        self.cookie = ""  # a Set-Cookie header on every recorded answer (a worker behind a sticky balancer)
        self.port = 0  # bound by the site; the real port is read back once it listens
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _record(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.read())
        self.headers.append(dict(request.headers))
        return web.json_response({"text": "ok", "meta_info": {"id": "x", "prompt_tokens": 3, "completion_tokens": 1,
                                                              "cached_tokens": 0}},
                                 headers={"Set-Cookie": self.cookie} if self.cookie else None)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if not json.loads(body).get("stream"):
            return web.json_response({"id": "resp_json", "object": "response", "status": "completed"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for start, end in zip((0, *STREAM_CUTS), (*STREAM_CUTS, len(STREAM))):
            await resp.write(STREAM[start:end])  # one write each (the gateway may still read several at once)
        await resp.write_eof()
        return resp

    async def _follow_up(self, request: web.Request) -> web.Response:
        self.follow_ups.append((request.method, request.path_qs, await request.read()))
        self.headers.append(dict(request.headers))
        return web.json_response({"id": request.match_info["rid"], "object": "response", "status": "completed"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "rec-model", "object": "model"}]})

    async def _ok(self, _: web.Request) -> web.Response:
        return web.json_response({})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        for p in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/rerank",
                  "/v1/score", "/v1/classify", "/v1/decisions", "/encode", "/classify", "/v1/messages",
                  "/v1/messages/count_tokens", "/parse_function_call", "/separate_reasoning"):
            app.router.add_post(p, self._record)
        app.router.add_post("/v1/responses", self._responses)
        for method, p in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
            app.router.add_route(method, "/v1/responses/{rid}" + p, self._follow_up)
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
    ("/v1/embeddings", b'{"model":"rec-model", "input":["a","\xc3\xa9"],"dimensions":8,"lora_path":null,"z":1.50}'),
    ("/v1/rerank", b'{"query":"q","documents":["a","b"],"top_n":1,"instruct":"rank"}'),
    ("/v1/score", b'{"query":[1,2],"items":[[3],[4,5]],"label_token_ids":[7,8],"apply_softmax":true}'),
    ("/v1/classify", b'{"model":"rec-model","input":"x","rid":"c-1"}'),
    ("/v1/decisions", b'{"model":"rec-model","question":"yes?","future":[1e400]}'),
    ("/encode", b'{"text":"a","rid":"e-1","dimensions":4}'),
    ("/classify", b'{"input_ids":[[1,2],[3]]}'),
    ("/v1/responses", b'{"model":"rec-model","input":[{"role":"user","content":"hi"}],"store":true,"zz":{}}'),
    ("/v1/messages", b'{"model":"rec-model","max_tokens":8,"system":[{"type":"text","text":"s"}],'
                     b'"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}'),
    ("/v1/messages/count_tokens", b'{"model":"rec-model","messages":[{"role":"user","content":"hi"}]}'),
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


def test_a_cookie_one_answer_sets_never_rides_on_another_clients_request(start_gateway):
    """The upstream session is shared by every client: a cookie a worker (or a balancer in
    front of it) sets for one request must not be stored and sent with the next."""
    with Recorder() as rec:
        rec.cookie = "session=alice-secret; Path=/"
        gw = start_gateway(rec.url.replace("127.0.0.1", "localhost"))  # (a cookie jar keeps none for IPs)
        body = b'{"model":"rec-model","messages":[{"role":"user","content":"hi"}]}'
        for _ in range(3):
            assert post(gw.url + "/v1/chat/completions", body)[0] == 200
        assert len(rec.headers) == 3
        assert all("Cookie" not in h for h in rec.headers), rec.headers


def test_parsers_are_any_workers_and_get_the_body_as_sent(start_gateway):
    with Recorder() as rec:
        gw = start_gateway(rec.url)
        for route, body in (("/parse_function_call", b'{"text":"<tool>x</tool>","tool_call_parser":"llama3"}'),
                            ("/separate_reasoning", b'{"text":"<think>a</think>b", "reasoning_parser":"qwen3"}')):
            assert post(gw.url + route, body)[0] == 200 and rec.bodies[-1] == body


def get(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_responses_stream_passes_byte_for_byte_and_its_follow_ups_reach_its_worker(start_gateway):
    with Recorder() as rec, Recorder() as other:
        gw = start_gateway(rec.url, args=("--worker-api-key", "worker-secret"))
        status, body, headers = post(gw.url + "/v1/responses", b'{"model":"rec-model","input":"hi","stream":true}')
        assert status == 200 and body == STREAM and headers["Content-Type"].startswith("text/event-stream")
        # a second worker joins: were the id not learned, follow-ups would have nowhere to go
        assert get(gw.url + "/workers", "POST", json.dumps({"url": other.url}).encode())[0] == 201
        calls = [("GET", "/v1/responses/resp_wire?include[]=x", None),
                 ("POST", "/v1/responses/resp_wire/cancel", b'{"why":"done"}'),
                 ("GET", "/v1/responses/resp_wire/input_items?order=asc&limit=2", None),
                 ("DELETE", "/v1/responses/resp_wire", None)]
        for method, path, sent in calls:
            status, answer = get(gw.url + path, method, sent)
            assert status == 200 and json.loads(answer)["id"] == "resp_wire", (method, path, answer)
        assert [(m, p) for m, p, _ in rec.follow_ups] == [(m, p) for m, p, _ in calls]
        assert rec.follow_ups[1][2] == b'{"why":"done"}' and other.follow_ups == []
        assert all(h["Authorization"] == "Bearer worker-secret" for h in rec.headers)
        status, _, _ = post(gw.url + "/v1/responses", b'{"model":"rec-model","input":"json"}')
        assert status == 200 and get(gw.url + "/v1/responses/resp_json")[0] == 200
        assert rec.follow_ups[-1][:2] == ("GET", "/v1/responses/resp_json")
