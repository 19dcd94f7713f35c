"""Typed options, parsed once: the policies' and their indexes'.

A policy (or an index a policy builds) declares its options as a dataclass (``Policy.Options``) whose fields carry their
defaults and, in ``metadata``, a one-line ``doc`` and optionally ``choices`` or a ``parse``
function. The gateway hands the policy what the CLI (``--policy-option key=value``, always
strings) or the YAML file (typed values) said; ``parse_options`` turns that into one instance,
coercing each value by its field's default type, and refuses an unknown or malformed option
with an error naming the policy, the option and what it accepts. ``kvgate policies NAME``
prints ``describe``'s rows.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any


class OptionError(ValueError):
    """An unknown option, or a value its option cannot take."""


def opt(default: Any, doc: str, *, choices: tuple[str, ...] | None = None,
        parse: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field for an option: its default, a one-line doc, and optionally the
    strings it accepts (``choices``) or how a raw value becomes its value (``parse``)."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "parse": parse})


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def on_off(value: Any) -> bool:
    """A flag as the CLI or YAML gives it: a bool, 0/1, or true/false, yes/no, on/off."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected true/false (or yes/no, on/off, 1/0)")


def whole(value: Any) -> int:
    """An integer, also from "4096", "1e6" or 4096.0; not from 2.5."""
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, int):
        return value
    number = float(value)
    if not number.is_integer():
        raise ValueError("expected an integer")
    return int(number)


def optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``parse``, or None for None, "" and "none"."""

    def read(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        return parse(value)

    return read


def json_object(value: Any) -> Any:
    """A mapping, or a JSON object in a string (as ``--policy-option key='{...}'`` gives it)."""
    if value is None or isinstance(value, Mapping):
        return value
    loaded = json.loads(str(value))
    if not isinstance(loaded, dict):
        raise ValueError("expected a JSON object")
    return loaded


def _coerce(f: Field, value: Any) -> Any:
    meta = f.metadata
    parse = meta.get("parse")
    default = f.default
    if parse is not None:
        value = parse(value)
    elif isinstance(default, bool):
        value = on_off(value)
    elif isinstance(default, int):
        value = whole(value)
    elif isinstance(default, float):
        if isinstance(value, bool):
            raise ValueError("expected a number")
        value = float(value)
    elif isinstance(default, str):
        value = str(value)
    choices = meta.get("choices")
    if choices and isinstance(value, str) and value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}")
    return value


def parse_options(cls: type, raw: Mapping[str, Any], owner: str) -> Any:
    """``cls`` (an options dataclass) from ``raw``; ``OptionError`` naming ``owner`` for an
    option ``cls`` does not have or a value it cannot take."""
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for name, value in raw.items():
        f = known.get(name)
        if f is None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            listed = ", ".join(sorted(known)) or "none"
            raise OptionError(f"{owner}: unknown option {name!r}{hint}; its options are: {listed}")
        try:
            values[name] = _coerce(f, value)
        except (TypeError, ValueError) as exc:
            raise OptionError(f"{owner}: option {name}={value!r}: {exc}") from None
    return cls(**values)


def option_names(cls: type | None) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls)) if cls is not None and is_dataclass(cls) else frozenset()


def describe(cls: type | None) -> list[tuple[str, str, str]]:
    """(name, default, doc) per option, in declaration order."""
    if cls is None or not is_dataclass(cls):
        return []
    rows = []
    order = {}  # the class's own options first, then each base's, as the MRO reads
    for klass in cls.__mro__:
        for name in getattr(klass, "__annotations__", {}):
            order.setdefault(name, len(order))
    for f in sorted(fields(cls), key=lambda f: order.get(f.name, len(order))):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f.name, repr(default) if isinstance(default, str) else str(default), f.metadata.get("doc", "")))
    return rows


@dataclass(frozen=True)
class NoOptions:
    """For a policy that takes none: any option given is an error."""
