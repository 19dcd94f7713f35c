"""Tokenizers that need no download.

``ByteTokenizer`` is the simulator's tokenizer: one token per UTF-8 byte, so any text maps
to the same ids on every machine and decoding is exact. Real deployments point the gateway
at the model's ``tokenizer.json`` (loaded offline with the ``tokenizers`` package) so that
the precise KV index hashes the same ids the engine does.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read from local disk (never from a hub)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok  # optional dependency

        self.name = path
        self._tok = _Tok.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str | None) -> Tokenizer | None:
    """``byte`` for the simulator's tokenizer, a path for a tokenizer.json, None for none."""
    if not spec:
        return None
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
