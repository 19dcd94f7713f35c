"""Cost-model sanity: monotone in work, cached prefixes cheap but not free."""

from __future__ import annotations

import pytest

from simulator.cost_model import CostModel
from simulator.profiles import PROFILES


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_monotone(name):
    cm = CostModel(PROFILES[name])
    xs = [1, 64, 512, 2048, 8192, 32768]
    pre = [cm.prefill_time(n) for n in xs]
    assert pre == sorted(pre) and pre[-1] > pre[0]
    cached = [cm.prefill_time(512, c) for c in xs]
    assert cached == sorted(cached)
    dec_b = [cm.decode_step_time(b, 1000 * b) for b in (1, 8, 64, 256)]
    assert dec_b == sorted(dec_b)
    dec_c = [cm.decode_step_time(32, c) for c in (0, 10_000, 100_000, 400_000)]
    assert dec_c == sorted(dec_c) and dec_c[-1] > dec_c[0]
    assert cm.prefill_time(512, 0, host_load_tokens=4096) > cm.prefill_time(512, 0)


def test_cache_hit_is_much_cheaper_than_recompute():
    cm = CostModel(PROFILES["llama3-8b-h100"])
    full = cm.prefill_time(8000)
    hit = cm.prefill_time(500, 7500)
    assert hit < full / 4


def test_llama8b_magnitudes():
    """Roofline numbers land where published H100 measurements are (order of magnitude)."""
    cm = CostModel(PROFILES["llama3-8b-h100"])
    assert 0.005 < cm.decode_step_time(1, 1000) < 0.012  # ~7 ms ITL at batch 1
    assert 0.1 < cm.prefill_time(8192) < 0.5  # ~0.25 s for 8k tokens
