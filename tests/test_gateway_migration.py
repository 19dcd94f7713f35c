"""Mid-stream migration: a stream whose worker fails after the first byte is finished on
another worker, and the client's answer is the one an uninterrupted worker gives."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal

import pytest

from tests.conftest import MODEL, _start_gateway, _start_sim
from tests.requires import need
from tests.support import FREE_PORT, get_text, metric_value, request_json, wait_until
from tests.test_gateway_faults import _stream

PROMPT = [(i * 7) % 90 + 32 for i in range(40)]


def events_of(raw: list[bytes]) -> tuple[list[dict], int]:
    """The JSON events of a stream, and how many [DONE] it had (it must end with one)."""
    assert raw and raw[-1] == b"data: [DONE]", raw[-3:]
    return [json.loads(e.removeprefix(b"data: ")) for e in raw if e != b"data: [DONE]"], raw.count(b"data: [DONE]")


def stream(url: str, route: str, body: dict) -> tuple[list[dict], int]:
    return events_of(asyncio.run(_stream(url + route, {**body, "stream": True})))


def migrations(gw_url: str, **labels: str) -> float:
    return metric_value(get_text(gw_url + "/metrics"), "kvgate_migrations_total", **labels)


def unified(start_sim, start_gateway, fault: str, *gateway_args: str, after: int = 6):
    """A worker that fails mid-stream listed first (round robin sends it the first request), a healthy one."""
    victim = start_sim("--time-scale", "20", "--fault-mid-stream", fault, "--fault-mid-stream-after", str(after),
                       name="victim")
    healthy = start_sim("--time-scale", "20", name="healthy")
    gw = start_gateway(victim.url, healthy.url, args=("--policy", "round_robin", *gateway_args))
    return victim, healthy, gw


GENERATE = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "sampling_seed": 7}}


@pytest.mark.parametrize("fault,cause", [("crash", None), ("error", "error_event")])
def test_generate_stream_is_finished_elsewhere_as_one_answer(start_sim, start_gateway, fault, cause):
    victim, healthy, gw = unified(start_sim, start_gateway, fault)
    status, whole = request_json("POST", healthy.url + "/generate", GENERATE)
    assert status == 200
    events, done = stream(gw.url, "/generate", GENERATE)
    assert done == 1 and not any("error" in e for e in events), events[-2:]
    last = events[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert [e["text"] for e in events] == [whole["text"][:len(e["text"])] for e in events]  # it only grows
    meta = last["meta_info"]
    assert meta["completion_tokens"] == 40 and meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    assert len({e["meta_info"]["id"] for e in events}) == 1  # one answer, one id
    assert migrations(gw.url, **({"cause": cause} if cause else {})) == 1
    if fault == "crash":
        assert victim.popen.wait(10) == 17  # it really died mid-stream


def test_chat_and_completion_streams_continue_with_the_same_text_and_usage(start_sim, start_gateway):
    _, healthy, gw = unified(start_sim, start_gateway, "error")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 30,
            "seed": 11, "stream_options": {"include_usage": True}}
    status, whole = request_json("POST", healthy.url + "/v1/chat/completions", chat)
    assert status == 200
    events, done = stream(gw.url, "/v1/chat/completions", chat)
    assert done == 1 and not any("error" in e for e in events)
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert [c["delta"].get("role") for e in events for c in e["choices"] if c["delta"].get("role")] == ["assistant"]
    assert len({e["id"] for e in events}) == 1
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 30 and usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 30
    # round robin gave the continuation the next turn: the next request goes to the faulty worker
    completion = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 25, "seed": 3}
    _, whole = request_json("POST", healthy.url + "/v1/completions", completion)
    events, done = stream(gw.url, "/v1/completions", completion)
    assert done == 1 and not any("error" in e for e in events)
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["choices"][0]["text"]
    assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None for e in events for c in e["choices"])
    assert migrations(gw.url, cause="error_event") == 2


def test_hang_mid_stream_times_out_and_continues(start_sim, start_gateway):
    victim, healthy, gw = unified(start_sim, start_gateway, "hang", "--request-timeout-secs", "1.5")
    _, whole = request_json("POST", healthy.url + "/generate", GENERATE)
    events, done = stream(gw.url, "/generate", GENERATE)
    assert done == 1 and events[-1]["output_ids"] == whole["output_ids"]
    assert migrations(gw.url, cause="timeout") == 1
    victim.kill()  # its hung handler never ends


def test_a_worker_removed_mid_stream_hands_its_streams_over(start_sim, start_gateway):
    """Removing a worker (as health loss does) cuts its streams at once: they continue elsewhere."""
    slow = start_sim("--time-scale", "1", name="slow")
    healthy = start_sim("--time-scale", "20", name="healthy")
    gw = start_gateway(slow.url, healthy.url, args=("--policy", "round_robin"))
    body = {**GENERATE, "sampling_params": {"max_new_tokens": 300, "sampling_seed": 9}}
    _, whole = request_json("POST", healthy.url + "/generate", body)

    def remove(n: int) -> None:
        if n == 3:
            assert request_json("POST", gw.url + "/remove_worker?url=" + slow.url)[0] == 200

    raw = asyncio.run(_stream(gw.url + "/generate", {**body, "stream": True}, on_chunk=remove))
    events, done = events_of(raw)
    assert done == 1 and events[-1]["output_ids"] == whole["output_ids"]
    assert migrations(gw.url, cause="removed") == 1


def test_migration_limit_zero_ends_with_the_error_event(start_sim, start_gateway):
    _, _, gw = unified(start_sim, start_gateway, "crash", "--migration-limit", "0")
    events, done = stream(gw.url, "/generate", GENERATE)
    assert done == 1 and events[-1]["error"]["type"] == "upstream_error"
    assert "mid-stream" in events[-1]["error"]["message"]
    assert len(events[-2]["output_ids"]) >= 6  # what came before is intact
    assert migrations(gw.url) == 0


def test_limit_is_kept_when_every_worker_fails(start_sim, start_gateway):
    sims = [start_sim("--time-scale", "20", "--fault-mid-stream", "error", "--fault-mid-stream-after", "4",
                      name=f"sick{i}") for i in range(2)]
    gw = start_gateway(*(s.url for s in sims), args=("--migration-limit", "3"))
    events, done = stream(gw.url, "/generate", {**GENERATE, "sampling_params": {"max_new_tokens": 100}})
    assert done == 1
    error = events[-1]["error"]
    assert "migration limit (3) reached" in error["message"], error
    assert sum("error" in e for e in events) == 1  # the engines' error events were withheld
    assert 16 <= len(events[-2]["output_ids"]) < 100  # at least 4 tokens from each of 4 workers, not all
    assert len({e["meta_info"]["id"] for e in events[:-1]}) == 1
    m = get_text(gw.url + "/metrics")
    assert metric_value(m, "kvgate_migrations_total") == 3
    assert metric_value(m, "kvgate_migrations_failed_total") == 1


def test_non_streamed_request_is_retried_whole(start_sim, start_gateway):
    victim = start_sim("--time-scale", "1", name="victim")
    healthy = start_sim("--time-scale", "20", name="healthy")
    gw = start_gateway(victim.url, healthy.url, args=("--policy", "round_robin"))
    body = {**GENERATE, "sampling_params": {"max_new_tokens": 400, "sampling_seed": 5}}
    _, whole = request_json("POST", healthy.url + "/generate", body)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(request_json, "POST", gw.url + "/generate", body)
        wait_until(lambda: metric_value(get_text(victim.url + "/metrics"), "sglang:num_running_reqs") == 1,
                   "the request running on the victim")
        victim.kill(signal.SIGKILL)
        status, data = answer.result(60)
    assert status == 200 and data["output_ids"] == whole["output_ids"]
    assert metric_value(get_text(gw.url + "/metrics"), "kvgate_retries_total") == 1
    assert migrations(gw.url) == 0


def test_pd_decode_death_mid_stream_repairs_and_continues():
    need("mooncake.engine", "the Mooncake transfer engine, pip extra 'mooncake'")
    procs: list = []
    try:
        prefill = _start_sim(procs, "--time-scale", "20", "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", FREE_PORT, name="prefill")
        decodes = [_start_sim(procs, "--time-scale", "20", "--disaggregation-mode", "decode",
                              "--disaggregation-waiting-timeout", "30", *fault, name=f"decode{i}")
                   for i, fault in enumerate((("--fault-mid-stream", "crash", "--fault-mid-stream-after", "6"), ()))]
        unified_ref = _start_sim(procs, "--time-scale", "20", name="reference")
        gw = _start_gateway(procs, args=("--pd-disaggregation", "--prefill", prefill.url, str(prefill.ports[0]),
                                         "--decode", decodes[0].url, "--decode", decodes[1].url,
                                         "--decode-policy", "round_robin"))
        _, whole = request_json("POST", unified_ref.url + "/generate", GENERATE)
        events, done = stream(gw.url, "/generate", GENERATE)
        assert done == 1 and not any("error" in e for e in events)
        assert events[-1]["output_ids"] == whole["output_ids"] and events[-1]["text"] == whole["text"]
        assert events[-1]["meta_info"]["completion_tokens"] == 40
        assert decodes[0].popen.wait(10) == 17
        assert migrations(gw.url, cause="reset") + migrations(gw.url, cause="eof") == 1
    finally:
        for p in procs:
            p.stop()


def test_record_cuts_at_events_withholds_an_error_event_and_folds_long_streams():
    """The record on a stream's way: only whole events go out, an engine's error event is
    withheld, and a stream longer than FOLD_BYTES is read as it goes with the same transcript."""
    from gateway.stream_record import FOLD_BYTES, Record

    n = FOLD_BYTES // 150 * 2
    events = b"".join(b'data: {"id":"c1","created":5,"choices":[{"index":0,"text":"%s","token_ids":[%d],'
                      b'"prompt_token_ids":%s}]}\n\n' % (b"ab"[i % 2:i % 2 + 1], i, b"[1,2]" if i == 0 else b"null")
                      for i in range(n))
    stream = events + b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    record, sent, broke = Record("/v1/completions", True, lambda url, up: lambda: None), [], False
    for at in range(0, len(stream), 997):
        out, broke = record.take(stream[at:at + 997])
        sent.append(out)
        if broke:
            break
    assert broke and not record.done
    client = b"".join(sent)
    assert client.count(b"\n\n") == n and b"error" not in client and b'"token_ids":[' not in client
    assert client.count(b'"token_ids":null') == n and client.count(b'"prompt_token_ids":null') == n
    t = record.transcript()
    assert t.text == "ab" * (n // 2) and t.ids == list(range(n)) and t.prompt_ids == [1, 2]
    assert t.tokens == n and t.id == "c1" and t.created == 5


def test_continuation_goes_where_the_policy_finds_its_prefix(start_sim, start_gateway):
    """The continuation is chosen by the policy on the prompt plus the output so far: with the
    worker that held the most of it gone, cost picks the one that holds a part (its KV events
    say so), not the cold one, and that engine reports the hit."""
    from tests.support import policy_stats

    page = 64
    prompt = [(i * 13) % 200 + 30 for i in range(6 * page)]
    args = ("--time-scale", "20", "--page-size", str(page), "--kv-events-port", FREE_PORT)
    holder = start_sim(*args, "--fault-mid-stream", "crash", "--fault-mid-stream-after", "6", name="holder")
    part = start_sim(*args, name="part")
    cold = start_sim(*args, name="cold")
    gw = start_gateway(holder.url, part.url, cold.url, args=("--policy", "cost", "--tokenizer", "byte"))
    for worker, ids in ((holder, prompt), (part, prompt[:4 * page])):
        assert request_json("POST", worker.url + "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": 1}})[0] == 200
    wait_until(lambda: policy_stats(gw.url).get("index_blocks", 0) >= 6, "the gateway's index hears the warm-ups")
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 40, "sampling_seed": 2}}
    part_cached = metric_value(get_text(part.url + "/metrics"), "sglang:cached_tokens_total")
    events, done = stream(gw.url, "/generate", body)
    assert done == 1 and holder.popen.wait(10) == 17 and migrations(gw.url) == 1
    routed = get_text(gw.url + "/metrics")
    assert metric_value(routed, "kvgate_routed_total", worker=part.url) == 1
    assert metric_value(routed, "kvgate_routed_total", worker=cold.url) == 0
    assert metric_value(get_text(part.url + "/metrics"), "sglang:cached_tokens_total") - part_cached >= 4 * page
    _, whole = request_json("POST", cold.url + "/generate", body)  # last: it leaves the prompt cached there
    assert events[-1]["output_ids"] == whole["output_ids"]
