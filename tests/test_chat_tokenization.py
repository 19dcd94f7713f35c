"""The gateway's token ids for a request are the engine's: text prompts with the model's
special tokens added, chats through the model's Jinja template without them. Checked
against the libraries SGLang itself calls (transformers' ``apply_chat_template`` and
SGLang's own message clean-up functions), then end to end: a gateway and simulated
engines that tokenize with a real BPE tokenizer must agree on every cached token."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulator.tiny_tokenizer import BOS, TEMPLATES, build
from tests.requires import need
from tests.sim_support import sim_worker
from tests.support import (FREE_PORT, assert_predicted_exactly, converse, get_text, metric_value, policy_stats, serve,
                           request_json)
from wire.chat_template import detect_content_format, normalize_messages, sglang_tools
from wire.tokenizer import HFTokenizer, load_tokenizer

need("tokenizers", "pip extra 'test'")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build(root / name, name) for name in TEMPLATES}


def _reference(path: Path):
    transformers = need("transformers", "pip extra 'test'")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


_text = st.lists(st.sampled_from(list("ab xyz,.!?\n\t{}\"'é€12") + ["the ", "tool ", "<|eot_id|>"]),
                 max_size=20).map("".join)
_part = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, _text),
                  st.just({"type": "image_url", "image_url": {"url": "http://x/y.png"}}))
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]),
     "content": st.one_of(_text, st.none(), st.lists(_part, min_size=1, max_size=3))},
    optional={"name": st.sampled_from(["fn", None])})
_tools = st.one_of(st.none(), st.just([{"type": "function", "function": {
    "name": "clock", "description": "the time", "parameters": {"type": "object", "properties": {}}}}]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_message, min_size=1, max_size=5), tools=_tools,
       thinking=st.sampled_from([None, True, False]), template=st.sampled_from(sorted(TEMPLATES)))
def test_chat_ids_are_what_transformers_renders_and_encodes(models, messages, tools, thinking, template):
    ours = HFTokenizer(str(models[template]))
    reference = _reference(models[template])
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    prompt = ours.render_chat(messages, tools, kwargs)
    chat, _ = normalize_messages(messages, ours.template.content_format)
    expected = reference.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    assert prompt.text == expected
    assert ours.encode_chat(prompt) == _ids(reference.apply_chat_template(
        chat, tools=tools, tokenize=True, add_generation_prompt=True, **kwargs))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_text)
def test_text_prompts_get_the_special_tokens_transformers_adds(models, text):
    ours = HFTokenizer(str(models["llama3"]))
    assert ours.encode(text) == _ids(_reference(models["llama3"]).encode(text))
    assert ours.encode(text)[0] == ours.bos_token_id  # a Llama-style BOS, as SGLang's encode adds it


def test_a_chat_starts_with_the_templates_bos_only(models):
    ours = HFTokenizer(str(models["llama3"]))
    ids = ours.encode_chat(ours.render_chat([{"role": "user", "content": "hi"}]))
    assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1


def test_continued_assistant_text_is_appended_without_bos(models):
    ours = HFTokenizer(str(models["llama3"]))
    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
    prompt = ours.render_chat(messages, continue_final_message=True)
    assert prompt.continued == "one two" and "one two" not in prompt.text
    assert ours.encode_chat(prompt) == ours.encode(prompt.text, add_special_tokens=False) + \
        ours.encode("one two", add_special_tokens=False)
    # without the flag SGLang turns the final assistant message into a user message
    assert "<|start_header_id|>user<|end_header_id|>\n\none two" in ours.render_chat(messages).text


def test_message_clean_up_matches_sglangs(models):
    from tests.sglang_cpu import require

    utils = require("sglang.srt.parser.jinja_template_utils")
    for name, source in TEMPLATES.items():
        assert detect_content_format(source) == utils.detect_jinja_template_content_format(source), name
    samples = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}},
                                     {"type": "text", "text": "b"}], "name": None},
        {"role": "system", "content": "plain", "name": "x"},
        {"role": "user", "content": [{"type": "input_text", "text": "c"}, {"type": "video_url",
                                                                         "video_url": {"url": "v"}}]},
    ]
    for fmt in ("string", "openai"):
        for msg in samples:
            theirs = utils.process_content_for_template_format(dict(msg), fmt, [], [], [], [])
            ours, _ = normalize_messages([msg], fmt)
            assert ours == [theirs], (fmt, msg)
    # a tool result's text parts (serving_chat's normalize_tool_content, which needs more of
    # sglang than imports here): one string, joined by spaces, in either format
    tool = {"role": "tool", "content": [{"type": "text", "text": "42"}, {"type": "text", "text": "!"}]}
    assert normalize_messages([tool], "openai")[0] == normalize_messages([tool], "string")[0] == \
        [{"role": "tool", "content": "42 !"}]


def test_a_bare_tokenizer_json_falls_back_to_the_simulator_template(models, tmp_path):
    bare = tmp_path / "tokenizer.json"
    bare.write_bytes((models["llama3"] / "tokenizer.json").read_bytes())
    tok = load_tokenizer(str(bare))
    assert tok.render_chat([{"role": "user", "content": "hi"}]).text == "<|user|>\nhi\n<|assistant|>\n"
    override = tmp_path / "t.jinja"
    override.write_text("\n{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]\\n{% endfor %}end\n")
    tok = load_tokenizer(str(models["llama3"]), str(override))  # read as SGLang reads --chat-template
    assert tok.render_chat([{"role": "user", "content": "hi"}]).text == BOS + "[hi]\nend"


def test_long_prompts_are_encoded_on_the_pool_with_the_same_ids(models):
    from gateway.encoding import PromptEncoder

    tok = HFTokenizer(str(models["chatml"]))
    encoder = PromptEncoder(tok, inline_chars=100)
    short, long = "the word " * 5, "the word " * 500
    try:
        got = asyncio.run(_both(encoder, short, long))
    finally:
        encoder.close()
    assert got == [tok.encode(short), tok.encode(long)] and encoder.offloaded == 1


async def _both(encoder, short: str, long: str) -> list[list[int]]:
    return [(await encoder.text(short))[0], (await encoder.text(long))[0]]


@pytest.mark.parametrize("policy", ["kv_events", "cost"])
def test_gateway_and_engines_with_a_bpe_model_agree_on_every_cached_token(models, policy):
    """``kvgate up --tokenizer DIR``: the simulated engines tokenize with the same model
    directory, BOS on text prompts and the chat template's own tokens on chats; the
    precise index's predictions must equal the cached tokens the engines report."""
    proc = serve([sys.executable, "-m", "gateway.cli", "up", "--workers", "3", "--port", FREE_PORT, "--kv-events",
                  "--policy", policy, "--tokenizer", str(models["chatml"]), "--tokenize-inline-chars", "1000"],
                 "/v1/models", name="kvgate-up")
    base = proc.url
    try:
        model = json.loads(get_text(base + "/v1/models"))["data"][0]["id"]
        cached = converse(base, model, conversations=2, turns=3, system_words=60, as_parts=True,
                          chat_template_kwargs={"enable_thinking": False})
        for n in range(3):  # text prompts: BOS first, then a shared document
            status, out = request_json("POST", base + "/v1/completions", {
                "model": model, "max_tokens": 4, "prompt": "shared document " * 80 + f"ask {n}"})
            assert status == 200, out
            cached.append((n, out["usage"]["prompt_tokens_details"]["cached_tokens"]))
        stats = policy_stats(base)
        metrics = get_text(base + "/metrics")
    finally:
        proc.stop()
    assert_predicted_exactly(cached, stats)
    off_loop = metric_value(metrics, "kvgate_prompts_tokenized_off_loop")
    assert 0 < off_loop < len(cached)  # the long prompts went to the pool, the short ones did not
    # later turns and the shared document were encoded past the prefix they share, and every
    # reuse checked against the whole encoding agreed (the first ones all are)
    tokenizer = {s: metric_value(metrics, "kvgate_tokenizer_stat", stat=f"tokenize_prefix_{s}")
                 for s in ("reuses_total", "verified_total", "enabled", "reused_tokens_total")}
    assert tokenizer["enabled"] == 1 and tokenizer["reuses_total"] >= 3 and tokenizer["verified_total"] >= 3, tokenizer


def test_the_simulator_answers_tokenize_as_it_tokenizes_requests(models):
    ours = HFTokenizer(str(models["chatml"]))
    messages = [{"role": "user", "content": "hello there"}]
    with sim_worker("--tokenizer", str(models["chatml"])) as (url, _):
        status, out = request_json("POST", url + "/v1/tokenize", {"prompt": "the word"})
        assert status == 200 and out["tokens"] == ours.encode("the word") and out["count"] == len(out["tokens"])
        status, out = request_json("POST", url + "/tokenize", {"prompt": ["a", "b"], "add_special_tokens": False})
        assert out["tokens"] == [ours.encode("a", False), ours.encode("b", False)] and out["count"] == [1, 1]
        status, out = request_json("POST", url + "/v1/tokenize", {"messages": messages,
                                                                  "chat_template_kwargs": {"enable_thinking": False}})
        chat = ours.encode_chat(ours.render_chat(messages, template_kwargs={"enable_thinking": False}))
        assert status == 200 and out["tokens"] == chat
        status, out = request_json("POST", url + "/v1/detokenize", {"tokens": chat})
        assert status == 200 and out["text"] == ours.decode(chat)
        # and a chat completion is prefilled from exactly those ids
        status, out = request_json("POST", url + "/v1/chat/completions", {
            "model": "m", "messages": messages, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(chat)
        for bad in ({}, {"prompt": "a", "messages": messages}, {"prompt": 5}, {"messages": []}):
            status, out = request_json("POST", url + "/v1/tokenize", bad)
            assert status == 400 and out["object"] == "error", bad


def _tokenizer_match(base: str) -> dict | None:
    """The worker's check result once the gateway has it (the check runs beside startup)."""
    for _ in range(100):  # bounded: ~5 s
        status, out = request_json("GET", base + "/workers")
        if out["workers"][0]["tokenizer_match"] is not None:
            break
        time.sleep(0.05)
    return out["workers"][0]["tokenizer_match"]


@pytest.mark.parametrize("gateway_tokenizer, same", [("model", True), ("byte", False)])
def test_the_gateway_asks_each_worker_whether_it_tokenizes_the_same(models, gateway_tokenizer, same):
    """A gateway given the wrong tokenizer learns it when the worker joins, not from the
    hit statistics after traffic: ``/workers`` and a metric say so per worker and form."""
    with sim_worker("--tokenizer", str(models["chatml"])) as (url, _):  # its template renders tools
        tok = str(models["chatml"]) if gateway_tokenizer == "model" else "byte"
        gw = serve([sys.executable, "-m", "gateway", "serve", "--port", FREE_PORT, "--policy", "kv_events",
                    "--tokenizer", tok, "--worker-urls", url], "/readiness", name="gateway", timeout=30)
        try:
            base = gw.url
            assert _tokenizer_match(base) == {"text": same, "chat": same, "tools": same}
            metrics = get_text(base + "/metrics")
            for kind in ("text", "chat", "tools"):
                assert metric_value(metrics, "kvgate_worker_tokenizer_match", worker=url, kind=kind) == float(same)
            assert ("tokenizes a text prompt differently" in gw.output()) is not same
            # clients get the engine's own answer through the gateway, errors in OpenAI's shape
            assert request_json("POST", base + "/v1/tokenize", {"prompt": "the word"}) == \
                request_json("POST", url + "/v1/tokenize", {"prompt": "the word"})
            status, out = request_json("POST", base + "/tokenize", {"prompt": 5})
            assert status == 400 and isinstance(out["error"]["message"], str)
        finally:
            gw.stop()


_fn_key = st.sampled_from(["name", "description", "parameters", "strict", "defer_loading"])


@settings(max_examples=80, deadline=None)
@given(keys=st.lists(_fn_key, unique=True).map(lambda ks: ks if "name" in ks else ["name", *ks]),
       values=st.fixed_dictionaries({"description": st.sampled_from([None, "does it"]),
                                     "parameters": st.sampled_from([None, {"type": "object"}]),
                                     "strict": st.sampled_from([None, True, False]),
                                     "defer_loading": st.sampled_from([None, True])}),
       outer_defer=st.sampled_from([None, False, True]), with_type=st.booleans())
def test_tools_reach_the_template_as_sglang_serializes_them(keys, values, outer_defer, with_type):
    from tests.sglang_cpu import require

    protocol = require("sglang.srt.entrypoints.openai.protocol")
    fn = {k: ("clock" if k == "name" else values[k]) for k in keys}
    tool: dict = {"function": fn}
    if with_type:
        tool = {"type": "function", **tool}
    if outer_defer is not None:
        tool["defer_loading"] = outer_defer
    theirs = protocol.Tool.model_validate(tool).model_dump()
    ours = sglang_tools([tool])
    assert ours == [theirs] and list(ours[0]["function"]) == list(theirs["function"])  # order is rendered too
    named = {"type": "function", "function": {"name": "other"}}
    assert sglang_tools([tool], "none") is None and sglang_tools([tool], named) is None
    assert sglang_tools([tool], {"type": "function", "function": {"name": "clock"}}) == [theirs]
    assert sglang_tools([tool], {"function": "clock"}) is None  # malformed: no tool named, none passed


def test_a_worker_without_tokenize_is_not_judged(models):
    """An engine that predates ``/v1/tokenize`` (here the bench's stub backend) cannot be
    asked: the check records nothing, exports nothing and warns of nothing."""
    stub = serve([sys.executable, "-m", "bench.stub_backend", "--port", FREE_PORT], "/health", name="stub", timeout=30)
    gw = None
    try:
        gw = serve([sys.executable, "-m", "gateway", "serve", "--port", FREE_PORT, "--policy", "kv_events", "--tokenizer",
                    str(models["llama3"]), "--worker-urls", stub.url], "/readiness", name="gateway", timeout=30)
        base = gw.url
        assert _tokenizer_match(base) == {}
        assert "kvgate_worker_tokenizer_match{" not in get_text(base + "/metrics")
        assert "differently" not in gw.output()
    finally:
        for proc in (gw, stub):
            if proc is not None:
                proc.stop()

