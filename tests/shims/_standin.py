"""Import-only stand-ins for GPU-side packages SGLang imports at module top level.

SGLang's Python modules ``import triton`` (1 GB of GPU compiler, nothing to run here) and,
through its multimodal configs, ``torchvision`` (whose PyPI build is compiled against a
CUDA torch and fails to register its ops on the CPU torch). Tests put ``tests/shims`` on
``sys.path`` only when the real package is absent; then ``import triton.language as tl``,
``@triton.jit`` and ``torchvision.transforms`` resolve to inert objects. Anything that
really *runs* one of them returns a stand-in object and fails loudly further on, which is
what a CPU test that strays onto a GPU path should do.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class Anything:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)  # so `class X(torchvision.Something):` still defines a class


def jit(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


class _AnyClass(type):
    """Metaclass: class attributes (InterpolationMode.NEAREST ...) are stand-ins too."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()


_classes: dict[str, type] = {}


def module_getattr(name: str):
    if name.startswith("__"):  # __file__, __wrapped__ ... must look absent to inspect
        raise AttributeError(name)
    if name[:1].isupper():
        # Class-like names (JITFunction, Config, ...) are real, empty classes so that
        # torch's own isinstance checks against them keep working.
        return _classes.setdefault(name, _AnyClass(name, (), {}))
    return Anything()


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__getattr__ = module_getattr
        mod.__path__ = []  # a package, so deeper submodules resolve as well
        mod.jit = jit
        return mod

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str):
        self.prefix = root + "."

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


def stand_in(root: str) -> None:
    """Make every ``root.*`` submodule import as a stand-in."""
    sys.meta_path.append(_Finder(root))
