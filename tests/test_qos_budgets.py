"""Tenants file parsing (``gateway.tenants``) and per-tenant budgets (``gateway.budgets``),
on a clock the test moves."""

from __future__ import annotations

import pytest

from gateway.budgets import Budgets, duration
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.tenants import parse_tenants


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


SPEC = {
    "classes": {"interactive": {"priority": 10, "ttft_slo_secs": 2, "hold": False}, "standard": {},
                "batch": {"priority": -5}},
    "default_class": "standard",
    "tenants": {
        "alpha": {"keys": ["sk-a1", "sk-a2"], "weight": 2, "class": "interactive",
                  "requests_per_minute": 3, "tokens_per_minute": 600},
        "beta": {"keys": ["sk-b"]},
    },
}


def test_the_file_gives_classes_tenants_and_defaults():
    spec = parse_tenants(SPEC)
    assert [c.name for c in spec.classes] == ["interactive", "standard", "batch"]
    assert spec.classes[0].ttft_slo_secs == 2.0 and spec.classes[2].priority == -5
    assert not spec.classes[0].hold and spec.classes[1].hold
    alpha, beta, default = spec.tenants["alpha"], spec.tenants["beta"], spec.tenants["default"]
    assert alpha.weight == 2.0 and alpha.classes == ["interactive", "standard", "batch"]
    assert beta.default_class == "standard" and beta.classes == ["standard", "batch"]  # its class and lower
    assert default.keys == [] and default.default_class == "standard"
    assert sorted(spec.keys) == ["sk-a1", "sk-a2", "sk-b"] and spec.budgets
    assert "sk-a1" not in repr(spec)  # keys never reach a log through a repr


@pytest.mark.parametrize("change, message", [
    ({"tenants": {"a": {"class": "gold"}}}, "class 'gold' is not one of"),
    ({"tenants": {"a": {"weight": 0}}}, "weight must be a positive number"),
    ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "more than one tenant"),
    ({"tenants": {"a b": {}}}, "letters, digits"),
    ({"tenants": {"a": {"class": "batch", "classes": ["standard"]}}}, "must be among its classes"),
    ({"tenants": {"a": {"rpm": 3}}}, "unknown keys in tenant a: rpm"),
    ({"default_class": "gold"}, "default_class 'gold'"),
    ({"classes": {"x": {"priority": "high"}}}, "priority must be an integer"),
    ({"classes": {"x": {"hold": "no"}}}, "hold must be true or false"),
])
def test_a_bad_file_is_refused_with_the_reason(change, message):
    with pytest.raises(ValueError, match=message):
        parse_tenants({**SPEC, **change})


def test_tenant_keys_are_client_keys(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  a: {keys: [sk-tenant]}\n")
    cfg = GatewayConfig(api_keys=["sk-plain"], tenants_file=str(path))
    assert cfg.api_keys == ["sk-plain", "sk-tenant"] and cfg.qos is not None
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  a: {keys: [sk-secret-value\n")
    with pytest.raises(ValueError) as err:
        GatewayConfig(tenants_file=str(bad))
    assert "sk-secret" not in str(err.value) and "line" in str(err.value)


def test_flags_and_yaml_name_the_tenants_file(tmp_path):
    from gateway.cli import build_parser, config_from_args

    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  a: {keys: [sk-a]}\n")
    args = build_parser().parse_args(["serve", "--tenants-file", str(path), "--tenant-header", "X-Tenant"])
    cfg = config_from_args(args)
    assert cfg.tenant_header == "X-Tenant" and cfg.qos is not None and "sk-a" in cfg.api_keys
    config = tmp_path / "kvgate.yaml"
    config.write_text(f"tenants_file: {path}\n")
    assert config_from_args(build_parser().parse_args(["serve", "--config", str(config)])).qos is not None
    config.write_text("qos: {}\n")  # read from the file only
    with pytest.raises(ValueError, match="unknown config keys: qos"):
        config_from_args(build_parser().parse_args(["serve", "--config", str(config)]))
    with pytest.raises(ValueError, match="give --tenants-file"):
        GatewayConfig(tenant_header="X-Tenant")


def test_requests_budget_answers_429_with_openai_headers_and_refills():
    clock = Clock()
    budgets = Budgets(parse_tenants(SPEC), clock)
    for left in (2, 1, 0):
        budgets.take("alpha")
        assert budgets.headers("alpha")["x-ratelimit-remaining-requests"] == str(left)
    with pytest.raises(GatewayError) as err:
        budgets.take("alpha")
    exc = err.value
    assert exc.status == 429 and exc.code == "requests_budget_exceeded"
    assert exc.headers["x-ratelimit-limit-requests"] == "3" and exc.headers["x-ratelimit-remaining-requests"] == "0"
    assert exc.headers["x-ratelimit-reset-requests"] == "1m0s" and exc.headers["Retry-After"] == "20"
    assert exc.headers["x-ratelimit-limit-tokens"] == "600"
    clock.now += 19.0
    with pytest.raises(GatewayError):
        budgets.take("alpha")
    clock.now += 1.0  # one request's worth refilled: 60 s / 3
    budgets.take("alpha")
    budgets.take("beta")  # no budget: never refused
    assert budgets.headers("beta") == {}


def test_tokens_are_spent_when_reported_and_a_debt_is_paid_before_the_next_request():
    clock = Clock()
    budgets = Budgets(parse_tenants(SPEC), clock)
    budgets.take("alpha")
    budgets.use("alpha", 900)  # more than the whole budget: 300 in debt
    assert budgets.headers("alpha")["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(GatewayError) as err:
        budgets.take("alpha")
    assert err.value.code == "tokens_budget_exceeded" and err.value.headers["Retry-After"] == "31"
    clock.now += 31.0  # 10 tokens/s: the debt is paid
    budgets.take("alpha")


def test_peers_spends_count_here():
    clock = Clock()
    spec = parse_tenants(SPEC)
    here, there = Budgets(spec, clock), Budgets(spec, clock)
    heard: list[tuple[str, int, int]] = []
    there.on_used = lambda *spend: heard.append(spend)
    there.take("alpha")
    there.take("alpha")
    there.use("alpha", 50)
    for spend in heard:
        here.charge(*spend)
    assert heard == [("alpha", 1, 0), ("alpha", 1, 0), ("alpha", 0, 50)]
    assert here.headers("alpha")["x-ratelimit-remaining-requests"] == "1"
    assert here.headers("alpha")["x-ratelimit-remaining-tokens"] == "550"


def test_reset_durations_are_spelled_as_openai_does():
    assert [duration(s) for s in (0.02, 1.0, 1.5, 59.4, 360.0)] == ["20ms", "1s", "1.5s", "59.4s", "6m0s"]
