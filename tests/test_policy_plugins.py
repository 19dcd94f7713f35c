"""Third-party policies load from the ``kvgate.policies`` entry-point group or a module:Class path;
the plugin API's pair selection (``Policy.select_pair``) as plain functions."""

from __future__ import annotations

import asyncio
import os
import textwrap

import pytest

from policies.base import Choice, Hold, NoWorkerAvailable, Policy, RequestView, WorkerView, select_each, selects_pairs
from policies.loader import load_policy

from tests.conftest import MODEL
from tests.support import ROOT, get_text, metric_value, request_json

PLUGIN = textwrap.dedent('''
    from policies import Choice, Policy

    class PinLast(Policy):
        """Sends everything to the last worker, or to ``pin`` when given."""
        name = "pin_last"

        def select(self, request, workers):
            pin = self.options.get("pin")
            chosen = [w for w in workers if w.url == pin] or sorted(workers, key=lambda w: w.url)[-1:]
            return Choice(chosen[0], reason="pinned")
''')


@pytest.fixture
def plugin_path(tmp_path):
    pkg = tmp_path / "thirdparty_policy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PLUGIN)
    dist = tmp_path / "thirdparty_policy-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-policy\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kvgate.policies]\npin_last = thirdparty_policy:PinLast\n")
    return str(tmp_path)


@pytest.mark.parametrize("spec", ["pin_last", "thirdparty_policy:PinLast"])
def test_third_party_policy_routes_every_request(start_sim, start_gateway, plugin_path, spec):
    sims = [start_sim("--time-scale", "20", name=f"s{i}") for i in range(2)]
    target = sims[0].url
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), plugin_path])}
    gw = start_gateway(*(s.url for s in sims), args=("--policy", spec, "--policy-option", f"pin={target}"), env=env)
    for i in range(5):
        status, _ = request_json("POST", gw.url + "/v1/completions", {"model": MODEL, "prompt": f"p{i}", "max_tokens": 2})
        assert status == 200
    metrics = get_text(gw.url + "/metrics")
    assert metric_value(metrics, "kvgate_routed_total", worker=target) == 5
    assert metric_value(metrics, "kvgate_routed_total", worker=sims[1].url) == 0


# -- pair selection ---------------------------------------------------------------------

def _fleet() -> tuple[list[WorkerView], list[WorkerView]]:
    prefills = [WorkerView(f"http://p{i}:1", role="prefill", in_flight=n) for i, n in enumerate((4, 1, 2))]
    decodes = [WorkerView(f"http://d{i}:1", role="decode", in_flight=n) for i, n in enumerate((3, 5, 0))]
    return prefills, decodes


def test_the_default_pair_is_two_selects_of_the_same_policy():
    prefills, decodes = _fleet()
    pair = asyncio.run(load_policy("least_load").select_pair(RequestView("r", "/generate"), prefills, decodes))
    assert [c.worker.url for c in pair] == ["http://p1:1", "http://d2:1"]
    with pytest.raises(NoWorkerAvailable):
        asyncio.run(load_policy("least_load").select_pair(RequestView("r", "/generate"), prefills, []))


def test_each_leg_by_its_own_policy_a_prefill_hold_answers_and_decode_may_not_hold():
    prefills, decodes = _fleet()
    seen: list[bool] = []

    class HoldsWhenAllowed(Policy):
        def select(self, request, workers):
            seen.append(request.may_hold)
            return Hold(0.1) if request.may_hold else Choice(workers[-1])

    held = RequestView("h", "/generate", may_hold=True)
    assert isinstance(asyncio.run(select_each(HoldsWhenAllowed(), load_policy("least_load"), held, prefills,
                                              decodes)), Hold)
    p, d = asyncio.run(select_each(load_policy("least_load"), HoldsWhenAllowed(), held, prefills, decodes))
    assert (p.worker.url, d.worker.url, seen) == ("http://p1:1", "http://d2:1", [True, False])
    assert held.may_hold  # the caller's view is not changed: the decode was asked with a replacement


def test_the_gateway_asks_a_pair_of_a_joint_scorer_or_of_one_policy_serving_both():
    cost, least = load_policy("cost"), load_policy("least_load")
    assert selects_pairs(load_policy("pd_cost"), least)  # prices both legs, whatever decodes
    assert selects_pairs(cost, cost) and not selects_pairs(cost, least)
