"""Import-only stand-ins for GPU packages SGLang imports at module top level.

On a CPU machine three packages cannot be installed: ``sgl_kernel`` (every PyPI wheel is
CUDA-only), ``triton`` (1 GB of GPU compiler whose driver finds no GPU here) and
``torchvision`` (PyPI's build is compiled against a CUDA torch and fails to register its ops
on the CPU torch). SGLang's CPU engine on a machine without AMX runs pure torch and calls
none of them, but its modules import them. This folder goes on ``sys.path`` (after
site-packages, so a real package always wins) only where the real one is absent.

The contract, which is what keeps a result honest:
- importing works: every ``pkg.sub.module`` resolves, ``@triton.jit``,
  ``@triton.autotune(configs=[triton.Config(...)])`` and ``tl.constexpr`` annotations
  evaluate, and ``class X(torchvision.Something)`` defines a class;
- nothing computes: ``sgl_kernel``'s names raise when called, and it registers no
  ``torch.ops.sgl_kernel.*`` (SGLang's AMX check stays false, so its pure-torch path runs);
  ``triton.runtime.driver.active`` raises as real triton does without a GPU, so SGLang's
  device probes answer "cpu".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable


class Inert:
    """Any attribute, call, index or decorator use: another Inert (or the decorated function)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return Inert()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert()

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)  # so `class X(torchvision.Something):` still defines a class


class Refusing:
    """A name of a GPU kernel library: importable, and raises the moment anything runs it."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._qualname} is an import-only stand-in (kvgate engine_patches/standins): "
                           "this CPU engine reached a GPU kernel")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Refusing(f"{self._qualname}.{name}")

    def __bool__(self):
        return False


def jit(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


class _AnyClass(type):
    """Metaclass: class attributes (InterpolationMode.NEAREST, tl.constexpr ...) are stand-ins too."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert()


def _any_init(self, *args, **kwargs):
    pass


_classes: dict[str, type] = {}


def inert_getattr(name: str):
    if name.startswith("__"):  # __file__, __wrapped__ ... must look absent to inspect
        raise AttributeError(name)
    if name[:1].isupper():
        # Class-like names (JITFunction, Config, ...) are real, empty classes taking any
        # arguments, so `triton.Config({...}, num_warps=4)` and isinstance checks both work.
        return _classes.setdefault(name, _AnyClass(name, (), {"__init__": _any_init}))
    return Inert()


def refusing_getattr(module: str) -> Callable[[str], object]:
    def getattr_(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Refusing(f"{module}.{name}")
    return getattr_


class _Loader(importlib.abc.Loader):
    def __init__(self, getattr_for: Callable[[str], Callable[[str], object]]):
        self.getattr_for = getattr_for

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__getattr__ = self.getattr_for(spec.name)
        mod.__path__ = []  # a package, so deeper submodules resolve as well
        mod.jit = jit
        return mod

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str, getattr_for: Callable[[str], Callable[[str], object]]):
        self.prefix, self.getattr_for = root + ".", getattr_for

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix) and fullname not in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, _Loader(self.getattr_for), is_package=True)
        return None


def stand_in(root: str, *, refusing: bool = False) -> None:
    """Make every ``root.*`` submodule import as a stand-in (inert, or refusing to run)."""
    sys.meta_path.append(_Finder(root, refusing_getattr if refusing else (lambda _name: inert_getattr)))
