"""Fuzzing the gateway's front door: whatever a client sends, the gateway answers with a
4xx in OpenAI's error shape (or a real answer), never a 5xx of its own.

Two generators: schemathesis, driven by the gateway's published ``/openapi.json``
(valid and deliberately invalid requests per operation), and hypothesis, posting arbitrary
JSON values, wrong types, huge numbers and unicode to each generation route.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.openapi import build_spec
from tests.conftest import MODEL, _start_gateway, _start_sim
from tests.support import Proc, request_json

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
API_ROUTES = ("/v1/embeddings", "/v1/rerank", "/v1/score", "/v1/classify", "/v1/decisions", "/encode", "/classify",
              "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
RESPONSE = "/v1/responses/{response_id}"
ERROR_SHAPED = (*GENERATION_ROUTES, *API_ROUTES, "/v1/tokenize", "/v1/detokenize", "/tokenize", "/detokenize",
                "/v1/models/{model}", RESPONSE, RESPONSE + "/cancel", RESPONSE + "/input_items")  # every error OpenAI's
FUZZ = settings(max_examples=50, deadline=10_000, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

schema = schemathesis.openapi.from_dict(build_spec())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=50)
# Worker registration would make the gateway dial whatever URL was generated: not fuzzed here
# (tests/test_gateway_security.py and test_gateway_faults.py cover it).
schema = schema.exclude(name=["POST /workers", "DELETE /workers", "POST /add_worker", "POST /remove_worker",
                              "DELETE /workers/{url}"])


@pytest.fixture(scope="module")
def gateway():
    procs: list[Proc] = []
    try:
        limits = ("--time-scale", "1000", "--max-total-tokens", "4096", "--context-length", "2048")
        sim = _start_sim(procs, *limits, "--enable-response-store")
        embed = _start_sim(procs, *limits, "--is-embedding", "--model-name", "sim-embed", name="embed")
        yield _start_gateway(procs, sim.url, embed.url,
                             args=("--request-timeout-secs", "10", "--max-payload-size", "65536"))
    finally:
        for p in procs:
            p.stop()


def assert_openai_error(status: int, raw: bytes, what: object) -> None:
    data = json.loads(raw)
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), (status, raw[:300], what)
    err = data["error"]
    assert isinstance(err.get("message"), str) and isinstance(err.get("type"), str), (status, raw[:300], what)
    assert "code" in err and "param" in err, (status, raw[:300], what)


def test_openapi_document_is_served(gateway):
    status, doc = request_json("GET", gateway.url + "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/generate", "/workers", *API_ROUTES, RESPONSE,
            "/v1/models/{model}"} <= set(doc["paths"])
    assert doc["components"]["schemas"]["ChatCompletionRequest"]["required"] == ["model", "messages"]


def test_openapi_document_lists_every_route_the_gateway_serves():
    served = {(route.method, route.resource.canonical) for route in build_app(GatewayConfig()).router.routes()
              if route.method != "HEAD"}
    paths = build_spec()["paths"]
    listed = {(method.upper(), path) for path, ops in paths.items() for method in ops}
    assert served == listed, (served - listed, listed - served)


@schema.parametrize()
@FUZZ
def test_schemathesis_no_server_errors(case, gateway):
    response = case.call(base_url=gateway.url, timeout=15)
    assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:300])
    if response.status_code >= 400 and case.path in ERROR_SHAPED:
        assert_openai_error(response.status_code, response.content, case.as_curl_command())


def post_raw(url: str, body: bytes) -> tuple[int, bytes, str]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(["model", "messages", "prompt", "text", "input_ids", "max_tokens", "stream", "n",
                               "sampling_params", "rid", "logprobs", "user", "max_completion_tokens", "stop",
                               "input", "query", "documents", "items", "label_token_ids", "previous_response_id",
                               "top_logprobs", "dimensions", "background", "max_output_tokens"])
near_valid = st.fixed_dictionaries(
    {"model": st.just(MODEL) | json_values},
    optional={"messages": st.lists(st.fixed_dictionaries({"role": json_values, "content": json_values}), max_size=3)
                          | json_values,
              "prompt": json_values, "text": json_values, "input_ids": json_values,
              "max_tokens": st.integers(min_value=-(2**70), max_value=2**70) | json_values,
              "stream": json_values, "n": st.integers(min_value=-5, max_value=10**6),
              "input": json_values, "query": json_values, "documents": json_values, "items": json_values,
              "previous_response_id": json_values, "top_logprobs": json_values,
              "sampling_params": st.dictionaries(field_names | st.text(max_size=8), json_values, max_size=3)},
) | st.dictionaries(field_names, json_values, max_size=6)
bodies = (
    near_valid.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.text(max_size=200).map(str.encode)
    | st.binary(max_size=200)
)


@pytest.mark.parametrize("route", GENERATION_ROUTES + API_ROUTES)
def test_random_bodies_never_5xx_and_errors_are_openai_shaped(gateway, route):
    @settings(FUZZ, max_examples=100)
    @given(body=bodies)
    def check(body: bytes) -> None:
        status, raw, ctype = post_raw(gateway.url + route, body)
        assert status < 500, (status, raw[:300], body[:300])
        if status >= 400:
            assert ctype.startswith("application/json"), (status, ctype, raw[:300])
            assert_openai_error(status, raw, body[:300])

    check()
    assert request_json("GET", gateway.url + "/readiness")[0] == 200  # still serving
