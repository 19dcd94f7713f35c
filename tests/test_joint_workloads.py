"""The joint matrix's seeded workloads: same seed, same requests; prompts that share a
document or a conversation share a real token prefix; arrivals fill the span asked for."""

from __future__ import annotations

import pytest

from bench.joint_workloads import conversations, decode_heavy, shared_documents
from bench.trace import BLOCK, DEFAULT_TRACE, conversation_keys, expand


@pytest.mark.parametrize("make", [shared_documents, decode_heavy])
def test_generators_are_seeded_and_fill_the_span(make):
    a, b, other = make(60, 30.0, seed=1), make(60, 30.0, seed=1), make(60, 30.0, seed=2)
    assert a == b and a != other
    assert len(a) == 60 and a[0].timestamp == 0 and a[-1].timestamp == pytest.approx(30_000)
    assert all(x.timestamp <= y.timestamp for x, y in zip(a, a[1:]))
    for r in a:
        assert len(r.hash_ids) * BLOCK >= r.input_length > (len(r.hash_ids) - 1) * BLOCK
        assert len(expand(r)) == r.input_length


def test_shared_documents_share_whole_document_prefixes():
    recs = shared_documents(200, 60.0, seed=0, documents=5)
    by_doc: dict[int, list] = {}
    for r in recs:
        by_doc.setdefault(r.hash_ids[0], []).append(r)
    assert len(by_doc) <= 5 and max(len(v) for v in by_doc.values()) > 1
    for same in by_doc.values():
        doc_blocks = min(len(r.hash_ids) for r in same) - 1
        first = expand(same[0])[: doc_blocks * BLOCK]
        assert all(expand(r).startswith(first) for r in same)
        assert len({r.hash_ids[-1] for r in same}) == len(same)  # every question is new


@pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="the Mooncake conversation trace is not beside the checkout")
def test_conversations_keep_every_turn_of_the_sampled_conversations():
    recs = conversations(DEFAULT_TRACE, 80, 20.0, seed=3, max_output=64)
    assert recs == conversations(DEFAULT_TRACE, 80, 20.0, seed=3, max_output=64)
    assert len(recs) == 80 and recs[-1].timestamp == pytest.approx(20_000)
    assert max(r.output_length for r in recs) <= 64
    keys = [k for k in conversation_keys(recs) if k]
    assert len(keys) - len(set(keys)) >= 30  # most records are returning turns
