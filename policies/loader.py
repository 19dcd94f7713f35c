"""Find a policy class by entry-point name or ``module:Class`` path."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policies.base import Policy
from wire.options import OptionError, option_names

GROUP = "kvgate.policies"

# Built-ins resolve without packaging metadata, so a source checkout works uninstalled.
BUILTIN = {
    "round_robin": "policies.round_robin:RoundRobin",
    "random": "policies.random_choice:RandomChoice",
    "least_load": "policies.least_load:LeastLoad",
    "power_of_two": "policies.power_of_two:PowerOfTwo",
    "consistent_hash": "policies.consistent_hash:ConsistentHash",
    "cache_aware": "policies.cache_aware:CacheAware",
    "kv_events": "policies.kv_events:KvEvents",
    "cost": "policies.cost:Cost",
    "pd_cost": "policies.pd_cost:PDCost",
}


def _import_path(path: str) -> type[Policy]:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"policy path {path!r} must look like 'module:Class'")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def available_policies() -> dict[str, str]:
    found = dict(BUILTIN)
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def load_policy_class(spec: str) -> type[Policy]:
    if ":" in spec:
        cls = _import_path(spec)
    else:
        eps = {ep.name: ep for ep in entry_points(group=GROUP)}
        if spec in BUILTIN:
            cls = _import_path(BUILTIN[spec])
        elif spec in eps:
            cls = eps[spec].load()
        else:
            names = ", ".join(sorted(available_policies()))
            raise ValueError(f"unknown policy {spec!r}; available: {names}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"{spec!r} is not a kvgate Policy subclass")
    return cls


def load_policy(spec: str, **options: Any) -> Policy:
    return load_policy_class(spec)(**options)


def options_for(options: Mapping[str, Any], specs: Sequence[str]) -> Callable[..., Policy]:
    """A ``load_policy`` for one set of options shared by the policies ``specs``: each
    receives the options its ``Options`` declares (all of them if it declares none), and an
    option that none of them declares is an ``OptionError`` naming them all."""
    classes = [load_policy_class(spec) for spec in specs]
    declared = [option_names(cls.Options) if cls.Options is not None else None for cls in classes]
    for name in options:
        if all(names is not None and name not in names for names in declared):
            raise OptionError(f"{' / '.join(specs)}: unknown option {name!r}; none of these policies takes it")

    def load(spec: str, **given: Any) -> Policy:
        cls = load_policy_class(spec)
        names = option_names(cls.Options) if cls.Options is not None else None
        return cls(**{k: v for k, v in given.items() if names is None or k in names})

    return load
