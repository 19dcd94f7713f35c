"""Typed policy options: parsed once, refused clearly when unknown or malformed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.app import GatewayState
from gateway.config import GatewayConfig, WorkerSpec
from policies.loader import load_policy, options_for
from tests.support import ROOT, child_env
from wire.options import OptionError, describe


def test_cli_strings_become_typed_values():
    cost = load_policy("cost", work_weight="6", memory="off", seed="7", max_tree_size="auto",
                       kv_endpoints='{"http://127.0.0.1:1": "tcp://127.0.0.1:2"}')
    assert cost.opts.work_weight == 6.0 and cost.opts.memory is False and cost.opts.seed == 7
    assert cost.opts.max_tree_size == "auto" and cost.budget.auto
    assert load_policy("cache_aware", max_tree_size="4096").index.max_units == 4096
    assert load_policy("cost").opts.work_weight == "auto" and load_policy("cost", work_weight="AUTO").pricer.weights.full == 3.0


def test_yaml_reads_a_bare_off_as_false_and_engine_load_still_means_off():
    assert load_policy("cost", engine_load=False).opts.engine_load == "off"


@pytest.mark.parametrize("options, says", [
    ({"work_wieght": "3"}, "did you mean 'work_weight'"),
    ({"memory": "maybe"}, "memory='maybe': expected true/false"),
    ({"engine_load": "sometimes"}, "expected one of drain, max, off"),
    ({"index": "exact"}, "expected one of auto, precise, approx"),
    ({"max_index_blocks": "2.5"}, "expected an integer"),
    ({"work_weight": "-1"}, "expected a number >= 0 or 'auto'"),
    ({"kv_endpoints": "[1, 2]"}, "kv_endpoints"),
])
def test_an_unknown_or_malformed_option_names_itself(options, says):
    with pytest.raises(OptionError, match=r"^cost: ") as err:
        load_policy("cost", **options)
    assert says in str(err.value)


def test_a_shared_pool_flag_of_false_is_false():
    """A string "false" once read as true (bool("false")): the pool then counted for every worker."""
    policy = load_policy("kv_events", shared_pool="false")
    assert policy.index.precise.shared_pool is False


def test_policies_that_take_no_options_refuse_any():
    with pytest.raises(OptionError, match="round_robin: unknown option 'seed'"):
        load_policy("round_robin", seed=1)


def test_pd_options_go_to_the_policy_that_declares_them():
    load = options_for({"work_weight": 3, "virtual_nodes": 8}, ["consistent_hash", "cost"])
    assert load("cost", work_weight=3, virtual_nodes=8).opts.work_weight == 3.0
    assert load("consistent_hash", work_weight=3, virtual_nodes=8).virtual_nodes == 8
    with pytest.raises(OptionError, match="none of these policies takes it"):
        options_for({"virtual_nodez": 8}, ["consistent_hash", "cost"])


def test_the_gateway_applies_shared_pd_options_per_policy():
    cfg = GatewayConfig(policy="round_robin", prefill_policy="cost", pd_disaggregation=True,
                        policy_options={"work_weight": "2"},
                        workers=[WorkerSpec(url="http://127.0.0.1:9", role="prefill"),
                                 WorkerSpec(url="http://127.0.0.1:10", role="decode")])
    state = GatewayState(cfg)
    assert state.policies["prefill"].opts.work_weight == 2.0


def test_every_builtin_documents_every_option():
    for name in ("cost", "pd_cost", "kv_events", "cache_aware", "consistent_hash", "random"):
        rows = describe(type(load_policy(name)).Options)
        assert rows and all(doc for _, _, doc in rows), name


def test_kvgate_policies_prints_a_policys_options_and_serve_refuses_a_typo():
    shown = subprocess.run([sys.executable, "-m", "gateway", "policies", "pd_cost"], cwd=ROOT, env=child_env(),
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    first = shown.stdout.splitlines()[0].split()
    assert first[:2] == ["kv_bytes_per_token", "131072.0"]  # its own options first, then cost's
    refused = subprocess.run([sys.executable, "-m", "gateway", "serve", "--worker-urls", "http://127.0.0.1:9",
                              "--port", "0", "--policy", "cost", "--policy-option", "hold_wait=1"],
                             cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "cost: unknown option 'hold_wait' (did you mean 'hold_wait_s'?)" in refused.stderr
    assert "Traceback" not in refused.stderr
