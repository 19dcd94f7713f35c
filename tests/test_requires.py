"""tests.requires: a missing optional dependency skips locally and fails in CI; a broken one always fails."""

from __future__ import annotations

import sys

import pytest

from tests.requires import need


def outcome(module: str) -> BaseException:
    """What ``need`` raised (a skip or a failure is a BaseException pytest would act on)."""
    try:
        need(module)
    except BaseException as exc:  # noqa: BLE001 - the point is to look at it, not to let it act
        return exc
    raise AssertionError(f"need({module!r}) returned")


def test_a_missing_module_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    for module in ("kvgate_absent_dep", "kvgate_absent_dep.engine"):  # the parent package absent too
        exc = outcome(module)
        assert type(exc) is pytest.skip.Exception and "kvgate_absent_dep" in str(exc)


def test_a_missing_module_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    exc = outcome("kvgate_absent_dep.engine")
    assert type(exc) is pytest.fail.Exception and "CI must have every test dependency" in str(exc)


def test_an_installed_module_that_does_not_import_fails(monkeypatch, tmp_path):
    monkeypatch.delenv("CI", raising=False)
    pkg = tmp_path / "kvgate_broken_dep"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libibverbs.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("kvgate_broken_dep", "kvgate_broken_dep.engine"):
        exc = outcome(module)
        assert type(exc) is ImportError and "libibverbs" in str(exc)
        sys.modules.pop("kvgate_broken_dep", None)
