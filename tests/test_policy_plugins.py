"""Third-party policies load from the ``kvgate.policies`` entry-point group or a module:Class path."""

from __future__ import annotations

import os
import textwrap

import pytest

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
