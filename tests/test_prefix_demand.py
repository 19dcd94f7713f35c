"""policies.prefix_demand: requests counted per held prefix, decayed over a window."""

from __future__ import annotations

import math

import pytest

from index.prefix import IndexMatch, Tiers
from policies.base import RequestView
from policies.prefix_demand import PrefixDemand

DOC = list(range(1000, 5096))  # 4096 tokens every question cites


def ask(rid: str, ids: list[int], salt: str | None = None) -> RequestView:
    return RequestView(rid, "/generate", token_ids=ids, cache_salt=salt)


def held(depth: int, everyone: int = 0) -> IndexMatch:
    return IndexMatch(depth + 500, "tokens", {"http://w0": Tiers(depth), "http://w1": Tiers(depth // 2)},
                      Tiers(everyone))


def test_questions_on_one_document_share_a_key_and_a_conversation_turn_does_not():
    one = PrefixDemand.key(ask("a", DOC + [1, 2, 3]), held(4096))
    # a question that happens to start alike matches a few tokens deeper: the same prefix
    assert PrefixDemand.key(ask("b", DOC + [7, 8, 9]), held(4100)) == one is not None
    assert PrefixDemand.key(ask("c", DOC + [1, 2, 3]), held(4096 + 512)) != one  # a longer history
    assert PrefixDemand.key(ask("d", DOC + [1], salt="tenant-b"), held(4096)) != one  # another tenant's
    other = list(range(9000, 13096))  # another document of the same length
    assert PrefixDemand.key(ask("e", other + [1]), held(4096)) != one


def test_no_key_where_nothing_is_held_beyond_what_every_worker_reuses():
    assert PrefixDemand.key(ask("a", DOC), IndexMatch(4096, "tokens")) is None
    assert PrefixDemand.key(ask("b", DOC), held(4096, everyone=4096)) is None
    assert PrefixDemand.key(ask("c", DOC), held(40)) is None  # shorter than the grain
    text = RequestView("t", "/generate", text="doc " * 500 + "why?")
    assert PrefixDemand.key(text, IndexMatch(2004, "chars", {"http://w0": Tiers(2000)})) is not None


def test_counts_decay_over_the_window_and_old_keys_are_dropped():
    demand = PrefixDemand(window_s=2.0, max_keys=2)
    demand.add("doc", 10.0)
    demand.add("doc", 10.0)
    assert demand.count("doc", 10.0) == 2.0
    assert demand.count("doc", 12.0) == pytest.approx(2.0 * math.exp(-1.0))
    demand.add("doc", 12.0)
    assert demand.count("doc", 12.0) == pytest.approx(2.0 * math.exp(-1.0) + 1.0)
    demand.add("a", 12.0)
    demand.add("b", 12.0)  # a third key: the least recently counted one goes
    assert len(demand) == 2 and demand.count("doc", 12.0) == 0.0
    off = PrefixDemand(window_s=0.0)
    off.add("doc", 1.0)
    assert off.count("doc", 1.0) == 0.0 and len(off) == 0
