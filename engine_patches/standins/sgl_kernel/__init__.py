"""Import-only stand-in for ``sgl_kernel`` (see ../_standin.py): every name raises when called,
and no ``torch.ops.sgl_kernel`` op is registered, so SGLang's CPU engine keeps its torch path."""

from _standin import refusing_getattr, stand_in

__version__ = "0.0.0+kvgate.standin"
__getattr__ = refusing_getattr(__name__)
stand_in(__name__, refusing=True)
