"""The tenants file: who the gateway's clients are, and what each may ask for.

A YAML mapping, read once at start-up (and again on a group's SIGHUP reload) into a
``QosSpec`` that every QoS part reads (docs/qos.md)::

    classes:                      # most urgent first
      interactive: {priority: 10, ttft_slo_secs: 2, hold: false}   # hold: see ClassSpec
      standard: {priority: 0}
      batch: {priority: -10}
    default_class: standard       # default: the first class
    engine_priority: false        # splice each class's priority into bodies that name none
    default_output_tokens: 256    # expected output of a request that names no max_tokens
    budget_window_secs: 60        # the *_per_minute budgets are per this window
    tenants:
      alpha:
        keys: [sk-alpha-1]        # client API keys that name this tenant
        weight: 2                 # share of the slots under contention, within a class
        class: interactive        # its requests' class unless they ask for another
        classes: [interactive, standard, batch]   # default: its class and every lower one
        requests_per_minute: 600
        tokens_per_minute: 200000 # prompt + completion tokens, as the engines report them
      default: {weight: 1}        # everyone else (added with defaults when not named)

Tenant and class names become metric labels, so only names from this file ever do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TOP = {"classes", "default_class", "engine_priority", "default_output_tokens", "budget_window_secs", "tenants"}
_TENANT = {"keys", "weight", "class", "classes", "requests_per_minute", "tokens_per_minute"}
_CLASS = {"priority", "ttft_slo_secs", "hold"}


@dataclass(slots=True)
class ClassSpec:
    name: str
    priority: int = 0  # SGLang's request priority (larger runs first, its default order)
    ttft_slo_secs: float | None = None  # refuse at once what the fleet is predicted to start later than this
    # held at the gateway while no worker can start it (late binding); false: sent at once, for a
    # class engines that schedule by priority run first, where a running step is all it waits for
    hold: bool = True


@dataclass(slots=True)
class TenantSpec:
    name: str
    keys: list[str] = field(default_factory=list, repr=False)  # never in a repr, a log or a metric
    weight: float = 1.0
    default_class: str = ""
    classes: list[str] = field(default_factory=list)
    requests_per_minute: float | None = None  # per budget window; None: unlimited
    tokens_per_minute: float | None = None


@dataclass(slots=True)
class QosSpec:
    classes: list[ClassSpec]  # most urgent first: a class's index is its rank
    tenants: dict[str, TenantSpec]
    engine_priority: bool = False
    default_output_tokens: int = 256
    budget_window_secs: float = 60.0

    def rank(self, name: str) -> int:
        for i, c in enumerate(self.classes):
            if c.name == name:
                return i
        raise KeyError(name)

    @property
    def keys(self) -> list[str]:
        return [k for t in self.tenants.values() for k in t.keys]

    @property
    def budgets(self) -> bool:
        return any(t.requests_per_minute is not None or t.tokens_per_minute is not None
                   for t in self.tenants.values())


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"tenants file: {what} must be a mapping")
    return value


def _unknown(data: dict[str, Any], known: set[str], what: str) -> None:
    extra = set(data) - known
    if extra:
        raise ValueError(f"tenants file: unknown keys in {what}: {', '.join(sorted(map(str, extra)))}")


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"tenants file: {what} {value!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return value


def _limit(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"tenants file: {what} must be a positive number")
    return float(value)


def _classes(data: dict[str, Any]) -> list[ClassSpec]:
    raw = _mapping(data.get("classes"), "classes") or {"standard": {}}
    out = []
    for name, opts in raw.items():
        opts = _mapping(opts, f"class {name}")
        _unknown(opts, _CLASS, f"class {name}")
        prio = opts.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise ValueError(f"tenants file: class {name}: priority must be an integer")
        hold = opts.get("hold", True)
        if not isinstance(hold, bool):
            raise ValueError(f"tenants file: class {name}: hold must be true or false")
        out.append(ClassSpec(_name(name, "class"), prio,
                             _limit(opts.get("ttft_slo_secs"), f"class {name} ttft_slo_secs"), hold))
    return out


def _tenant(name: str, opts: dict[str, Any], classes: list[str], default_class: str) -> TenantSpec:
    _unknown(opts, _TENANT, f"tenant {name}")
    keys = opts.get("keys") or []
    if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"tenants file: tenant {name}: keys must be a list of strings")
    weight = _limit(opts.get("weight", 1.0), f"tenant {name} weight")
    own = opts.get("class", default_class)
    if own not in classes:
        raise ValueError(f"tenants file: tenant {name}: class {own!r} is not one of {classes}")
    allowed = opts.get("classes") or classes[classes.index(own):]
    for c in allowed:
        if c not in classes:
            raise ValueError(f"tenants file: tenant {name}: class {c!r} is not one of {classes}")
    if own not in allowed:
        raise ValueError(f"tenants file: tenant {name}: its class {own!r} must be among its classes")
    return TenantSpec(_name(name, "tenant"), list(keys), weight or 1.0, own, list(allowed),
                      _limit(opts.get("requests_per_minute"), f"tenant {name} requests_per_minute"),
                      _limit(opts.get("tokens_per_minute"), f"tenant {name} tokens_per_minute"))


def parse_tenants(data: Any) -> QosSpec:
    data = _mapping(data, "the file")
    _unknown(data, _TOP, "the file")
    classes = _classes(data)
    names = [c.name for c in classes]
    default_class = data.get("default_class", names[0])
    if default_class not in names:
        raise ValueError(f"tenants file: default_class {default_class!r} is not one of {names}")
    tenants: dict[str, TenantSpec] = {}
    for name, opts in _mapping(data.get("tenants"), "tenants").items():
        tenants[str(name)] = _tenant(str(name), _mapping(opts, f"tenant {name}"), names, default_class)
    tenants.setdefault(DEFAULT_TENANT, TenantSpec(DEFAULT_TENANT, default_class=default_class,
                                                  classes=names[names.index(default_class):]))
    seen: set[str] = set()
    for t in tenants.values():
        for k in t.keys:
            if k in seen:
                raise ValueError(f"tenants file: a key is given to more than one tenant (one is {t.name})")
            seen.add(k)
    out_tokens = data.get("default_output_tokens", 256)
    if isinstance(out_tokens, bool) or not isinstance(out_tokens, int) or out_tokens < 0:
        raise ValueError("tenants file: default_output_tokens must be a non-negative integer")
    window = _limit(data.get("budget_window_secs", 60.0), "budget_window_secs") or 60.0
    return QosSpec(classes, tenants, bool(data.get("engine_priority", False)), out_tokens, window)


def load_tenants(path: str | Path) -> QosSpec:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"tenants file {path}: {exc}") from None
    except yaml.YAMLError as exc:  # its message quotes the line, which may hold a key: only where
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"tenants file {path}: not valid YAML{where}") from None
    return parse_tenants(data)
