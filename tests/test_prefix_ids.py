"""Reading the id lists clients send with a recent list's prefix (``wire.prefix_ids``), and
``gateway.request.read_body``, which cuts a body's list out to do so: whatever the texts,
they must give exactly what msgspec gives decoding them whole, and the reuse must happen."""

from __future__ import annotations

import asyncio
import json
import random
from array import array

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import GatewayError
from gateway.request import COMPLETIONS, GENERATE, build_view, parse_body, read_body
from wire.hashing import uint32_le
from wire.prefix_ids import RecentIds

_whole = msgspec.json.Decoder(list[int])
SEPARATORS = [(",", ","), (", ", ","), (" ,\n", " ,"), (",\t", ", ")]


def _text(ids: list[int], sep: str = ",", pad: str = "") -> bytes:
    return ("[" + pad + sep.join(map(str, ids)) + pad + "]").encode()


def _whole_answer(text: bytes) -> tuple[list[int], bytes] | None:
    try:
        ids = _whole.decode(text)
        return ids, uint32_le(ids)
    except (msgspec.DecodeError, OverflowError):
        return None


def _answer(recent: RecentIds, text: bytes) -> tuple[list[int], bytes] | None:
    got = recent.decode(text)
    if got is not None:
        assert isinstance(got, array) and got.typecode == "I"
    return None if got is None else (got.tolist(), uint32_le(got))


# A rollout: each list extends one before it (or a sibling's, or repeats one), written with
# any of JSON's spacings, and now and then broken where the new part starts.
edits = st.lists(st.tuples(
    st.integers(0, 1000),  # which earlier list to extend (mod how many there are)
    st.lists(st.integers(0, 2**32 + 5) | st.integers(-3, -1), max_size=40),  # what the turn adds
    st.sampled_from(SEPARATORS),
    # after the earlier list: nothing odd, junk, a list closed early, or its last digit changed
    st.sampled_from(["", "", "", "x", ",", "1", "12", "0", ".5", "e3", " 7", ",]", " ,]", "1]", "~"]),
    st.integers(0, 3),  # cut the earlier list short by this many ids first
), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**16), turns=edits)
def test_every_list_reads_as_msgspec_reads_it_whole(seed, turns):
    rng = random.Random(seed)
    recent = RecentIds(min_bytes=64, max_bytes=1 << 16, per_key=4)
    first = [rng.randrange(150_000) for _ in range(rng.randrange(20, 400))]
    texts = [_text(first)]
    assert _answer(recent, texts[0]) == _whole_answer(texts[0])
    for pick, more, (sep, after_prev), junk, cut in turns:
        prev = texts[pick % len(texts)]
        if cut:  # a list that stops short of one sent before, written anew
            ids = _whole.decode(prev)
            prev = _text(ids[: max(1, len(ids) - cut)], sep)
        head = prev[:-1]
        if junk == "~":
            head = head[:-1] + (b"7" if head[-1:] != b"7" else b"3")
            junk = ""
        if junk.endswith("]"):
            text = head + junk.encode()
        elif junk:
            text = head + junk.encode() + (after_prev + after_prev.join(map(str, more))).encode() + b"]"
        else:
            text = head + b"".join((after_prev + str(t)).encode() for t in more) + b"]"
        assert _answer(recent, text) == _whole_answer(text), text[-80:]
        if _whole_answer(text) is not None:
            texts.append(text)
    assert recent.bytes <= recent.max_bytes


def test_a_next_turn_decodes_only_what_it_adds():
    recent = RecentIds()
    rng = random.Random(1)
    first = [rng.randrange(150_000) for _ in range(2400)]
    second = first + [rng.randrange(150_000) for _ in range(200)]
    for sep in (",", ", "):
        assert _answer(recent, _text(first, sep)) == _whole_answer(_text(first, sep))
        assert _answer(recent, _text(second, sep)) == _whole_answer(_text(second, sep))
    assert recent.hits == 2 and recent.reused_ids == 2 * 2400
    assert recent.misses == 2 and recent.decoded_ids == 2 * 2400 + 2 * 200
    # a GRPO group: the same list again keeps one entry and reuses all of it
    entries = len(recent._lru)
    assert _answer(recent, _text(second)) == _whole_answer(_text(second))
    assert len(recent._lru) == entries and recent.reused_ids == 2 * 2400 + 2600
    # the same list but its last id: a list of its own
    other = second[:-1] + [second[-1] + 1]
    assert _answer(recent, _text(other)) == _whole_answer(_text(other))
    assert len(recent._lru) == entries + 1
    entries += 1
    # an id that only starts like the last one is no prefix
    longer_last = _text(first)[:-1] + b"7," + b"1]"
    assert _answer(recent, longer_last) == _whole_answer(longer_last)
    assert recent.hits == 4  # not reused: the entry for ``first`` ends inside that id


def test_the_budget_bounds_the_entries_and_the_oldest_leave_first():
    rng = random.Random(2)
    convs = [[rng.randrange(150_000) for _ in range(1000)] for _ in range(6)]
    one = RecentIds()
    one.decode(_text(convs[0]))
    recent = RecentIds(max_bytes=3 * one.bytes + 100)
    for ids in convs:
        recent.decode(_text(ids))
    assert recent.bytes <= recent.max_bytes and len(recent._lru) == 3
    hits = recent.hits
    recent.decode(_text(convs[0] + [5]))  # forgotten
    recent.decode(_text(convs[-1] + [5]))  # kept
    assert recent.hits == hits + 1


def _bodies(rng: random.Random, route: str = GENERATE) -> list[bytes]:
    """Bodies around one id list and its next turn; for completions the list is ``prompt``
    (and ``input_ids`` stands for some other field)."""
    base = [rng.randrange(150_000) for _ in range(300)]
    more = base + [rng.randrange(150_000) for _ in range(50)]
    sp = {"max_new_tokens": 8}
    out = [
        json.dumps({"input_ids": base, "sampling_params": sp}).encode(),
        json.dumps({"input_ids": more, "sampling_params": sp, "stream": True}).encode(),
        json.dumps({"input_ids": more}, separators=(",", ":")).encode(),
        json.dumps({"sampling_params": {"input_ids": base}, "input_ids": more}).encode(),  # nested first
        json.dumps({"sampling_params": {"input_ids": base}}).encode(),  # nested only: no prompt
        json.dumps({"input_ids": base, "input_ids ": more}).encode(),
        b'{"input_ids": ' + _text(base)[:-1] + b',]}',  # a dangling comma
        b'{"input_ids": ' + _text(more) + b', "input_ids": [1, 2]}',  # a duplicate key: the last wins
        b'{"input_ids": [1, 2], "input_ids": ' + _text(more) + b'}',
        b'{"input_ids": ' + _text(more) + b', "text": "hi"}',  # both prompts
        b'{"input_ids": ' + _text(more) + b', "n": 500}',
        b'{"input_ids": ' + _text(more) + b'',  # cut off
        b'{"input_ids": ' + _text(more) + b'} trailing',
        b'{"text": "\\"input_ids\\": ' + _text(more) + b'"}',  # the key's text inside a string
        b'{"input_ids": [' + _text(base) + b',' + _text(more) + b']}',  # a batch
        json.dumps({"input_ids": more + [2**32]}).encode(),  # no uint32
        json.dumps({"input_ids": more + [-1]}).encode(),
        json.dumps({"input_ids": [float(t) for t in more]}).encode(),
        json.dumps({"rid": "input_ids", "input_ids": more}).encode(),
        json.dumps({"model": "m", "prompt": more, "max_tokens": 4}).encode(),
        json.dumps({"model": "m", "prompt": "input_ids", "input_ids": more}).encode(),
        json.dumps({"model": "m", "input_ids": more, "max_tokens": 4}).encode(),
    ]
    if route == COMPLETIONS:  # the two keys trade places
        ids, prompt = b'"input_ids"', b'"prompt"'
        out = [b.replace(ids, b"\0").replace(prompt, ids).replace(b"\0", prompt) for b in out]
    return out


def _outcome(read) -> tuple:
    """The answer, an array of ids read as the list it stands for."""
    try:
        body = read()
    except GatewayError as exc:
        return ("error", exc.status, exc.param, str(exc))
    return ("ok", {k: v.tolist() if isinstance(v, array) else v for k, v in msgspec.structs.asdict(body).items()})


@pytest.mark.parametrize("route", [GENERATE, COMPLETIONS])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.permutations(range(len(_bodies(random.Random(0))))), seed=st.integers(0, 3))
def test_read_body_answers_as_parse_body_whatever_came_before(route, order, seed):
    bodies = _bodies(random.Random(seed), route)
    recent = RecentIds(min_bytes=256)
    for i in order:
        raw = bodies[i]
        packed: list[bytes | None] = []

        def read() -> object:
            body, p = read_body(raw, route, recent)
            packed.append(p)
            return body

        got, want = _outcome(read), _outcome(lambda: parse_body(raw, route))
        assert got == want, raw[-120:]
        if packed and packed[0] is not None:  # the ids handed over packed are the body's
            field = "input_ids" if route == GENERATE else "prompt"
            assert packed[0] == uint32_le(want[1][field])
    assert recent.hits > 0  # the fast path was taken, not only declined


def test_read_body_hands_over_packed_ids_only_for_lists_it_read():
    recent = RecentIds(min_bytes=256)
    ids = list(range(1000, 1400))
    body, packed = read_body(json.dumps({"input_ids": ids}).encode(), GENERATE, recent)
    assert body.input_ids == array("I", ids) and packed == array("I", ids).tobytes()
    body, packed = read_body(json.dumps({"text": "hello"}).encode(), GENERATE, recent)
    assert body.text == "hello" and packed is None
    body, packed = read_body(json.dumps({"input_ids": ids}).encode(), GENERATE, None)
    assert body.input_ids == ids and packed is None


def test_a_view_takes_the_ids_read_as_its_token_ids():
    """The array stands for the ids wherever the view takes them (a completion's prompt too,
    which would otherwise read as text)."""
    recent = RecentIds(min_bytes=256)
    ids = list(range(1000, 1400))
    for route, field in ((GENERATE, "input_ids"), (COMPLETIONS, "prompt")):
        body, packed = read_body(json.dumps({"model": "m", field: ids}).encode(), route, recent)
        view = asyncio.run(build_view(body, route, {}, "r", None, packed_ids=packed))
        assert list(view.token_ids) == ids and view.text is None
        assert view.packed() is packed and view.prompt_tokens_estimate == len(ids)
