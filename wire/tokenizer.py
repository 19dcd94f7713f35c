"""Tokenizers that need no download, and the two ways SGLang turns a request into ids.

``ByteTokenizer`` is the simulator's tokenizer: one token per UTF-8 byte, so any text maps
to the same ids on every machine and decoding is exact, with the simulator's own chat
template. Real deployments point the gateway at the model's directory (or its
``tokenizer.json``), loaded offline with the ``tokenizers`` package, so that the precise
KV index hashes the ids the engine does. SGLang gets those ids two ways:

- a text prompt (``/generate`` ``text``, ``/v1/completions`` ``prompt``) is encoded with the
  tokenizer's special tokens added (Hugging Face's default: BOS for Llama-style models);
- a chat is rendered with the model's chat template (``wire.chat_template``) and the text
  encoded *without* adding special tokens, since the template wrote them.

Special tokens come from ``tokenizer.json``'s post-processor, as transformers applies it to
the tokenizers most models ship now; some tokenizer classes (sentencepiece-era Llama 2 and
Mistral) have transformers rebuild it from ``add_bos_token`` instead, which is not mirrored.
Whether the ids agree with an engine is not left to this reading: the gateway asks each
worker (``gateway.tokenizer_check``).

Encoding goes through ``encode_batch``, which releases the GIL (``encode`` holds it), so a
long prompt can be encoded on a worker thread while the gateway's event loop carries on.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from wire.chat_template import ChatTemplate, apply_chat_template
from wire.hashing import uint32_le
from wire.prefix_tokens import PrefixTokens, anchor_tokens

log = logging.getLogger("kvgate.tokenizer")

# transformers' named special tokens, which chat templates see as variables.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(slots=True)
class ChatPrompt:
    """A rendered chat: the template's text, and the final assistant text that
    ``continue_final_message`` appends after it (encoded separately, as SGLang does)."""

    text: str
    continued: str | None = None


def plain_chat(messages: Sequence[Mapping[str, Any]], continue_final_message: bool = False) -> ChatPrompt:
    """The plain template's chat (no model template): a final assistant message with
    ``continue_final_message`` is left open, its text to be appended."""
    last = messages[-1] if messages else None
    if continue_final_message and last is not None and last.get("role") == "assistant" \
            and isinstance(last.get("content"), str):
        return ChatPrompt(apply_chat_template(messages[:-1]), last["content"])
    return ChatPrompt(apply_chat_template(messages))


# Ids, and the same ids as uint32 little-endian bytes (``wire.hashing.uint32_le``) where the
# tokenizer had them packed already, so that the precise index need not pack them again.
Encoded = tuple[list[int], bytes | None]


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_packed(self, text: str, add_special_tokens: bool = True) -> Encoded: ...

    def encode_chat_packed(self, prompt: ChatPrompt) -> Encoded: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    continue_final_message: bool = False) -> ChatPrompt: ...

    def encode_chat(self, prompt: ChatPrompt) -> list[int]: ...


class ByteTokenizer:
    name = "byte"
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    continue_final_message: bool = False) -> ChatPrompt:
        return plain_chat(messages, continue_final_message)

    def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        return self.encode(prompt.text + (prompt.continued or ""))

    def encode_packed(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return self.encode(text), None

    def encode_chat_packed(self, prompt: ChatPrompt) -> Encoded:
        return self.encode_chat(prompt), None


class HFTokenizer:
    """A Hugging Face tokenizer read from local disk (never from a hub): a model directory
    (``tokenizer.json`` plus ``tokenizer_config.json`` and/or ``chat_template.jinja``) or a
    bare ``tokenizer.json``. ``chat_template`` overrides the model's template with a
    ``.jinja`` file, read as SGLang reads its ``--chat-template``. ``reuse_bytes``: budget of
    the ids kept to encode only what a prompt adds to a recent one (``wire.prefix_tokens``;
    0: off)."""

    def __init__(self, path: str, chat_template: str | None = None, reuse_bytes: int = 64 << 20) -> None:
        from tokenizers import Tokenizer as _Tok  # optional dependency: the ``hf`` extra

        given = Path(path)
        file = given / "tokenizer.json" if given.is_dir() else given
        self.name = path
        self._tok = _Tok.from_file(str(file))
        config = _read_json(file.parent / "tokenizer_config.json")
        self.special_tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k)))}
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        source = _template_source(file.parent, config, chat_template)
        self.template = ChatTemplate(source, self.special_tokens) if source else None
        if self.template is None:
            log.warning("no chat template for %s: chat requests are tokenized with kvgate's simulator template and "
                        "will not match the engine's ids (give the model directory or --chat-template)", path)
        self.reuse: PrefixTokens | None = None
        self._added_first: list[int] | None = None  # what special tokens add, where it is only a prefix
        if reuse_bytes > 0 and source and self._tok.truncation is None and self._tok.padding is None:
            added = self._tok.get_added_tokens_decoder()  # cut at the template's own special tokens
            anchors = anchor_tokens(added, [t.content for t in added.values() if t.content in source])
            self.reuse = PrefixTokens(self._body, anchors, reuse_bytes)
            self._added_first = self._special_prefix(list(anchors))
        self._added_packed = array("I", self._added_first or [])

    def _body(self, text: str) -> list[int]:
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def _special_prefix(self, samples: list[str]) -> list[int] | None:
        """The ids special tokens add before a text, if that is all they add (a BOS, as Llama's
        template processor does), so a text prompt can reuse too; None if they add anything else."""
        first = self._tok.encode("", add_special_tokens=True).ids
        for text in ["a", "Hello world.", *samples, *(f"x {t} y" for t in samples)]:
            if self._tok.encode(text, add_special_tokens=True).ids != first + self._body(text):
                return None
        return first

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_packed(text, add_special_tokens)[0]

    def encode_packed(self, text: str, add_special_tokens: bool = True) -> Encoded:
        if self.reuse is None or (add_special_tokens and self._added_first is None):
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids, None
        ids, packed = self.reuse.encode_packed(text)
        if add_special_tokens and self._added_first:
            ids = self._added_first + ids
            packed = self._added_packed + packed if packed is not None else None
        return ids, uint32_le(packed) if packed is not None else None

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None,
                    continue_final_message: bool = False) -> ChatPrompt:
        if self.template is None:
            return plain_chat(messages, continue_final_message)
        text, continued = self.template.render(messages, tools, template_kwargs, continue_final_message)
        return ChatPrompt(text, continued)

    def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        return self.encode_chat_packed(prompt)[0]

    def encode_chat_packed(self, prompt: ChatPrompt) -> Encoded:
        ids, packed = self.encode_packed(prompt.text, add_special_tokens=False)
        if prompt.continued:  # SGLang encodes the continued text on its own, BOS dropped
            more = self.encode(prompt.continued)
            more = more[1:] if more and more[0] == self.bos_token_id else more
            ids += more
            packed = packed + uint32_le(more) if packed is not None else None
        return ids, packed


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _template_source(root: Path, config: Mapping[str, Any], override: str | None) -> str | None:
    if override:  # SGLang's --chat-template file: outer newlines stripped, "\n" escapes read
        return Path(override).read_text(encoding="utf-8").strip("\n").replace("\\n", "\n")
    jinja_file = root / "chat_template.jinja"  # where transformers saves it now; it wins
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one, else the first
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default") or next(iter(named.values()), None)
    return source if isinstance(source, str) and source else None


def load_tokenizer(spec: str | None, chat_template: str | None = None, reuse_bytes: int = 64 << 20) -> Tokenizer | None:
    """``byte`` for the simulator's tokenizer, a model directory or tokenizer.json path for a
    Hugging Face one, None for none."""
    if not spec:
        return None
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec, chat_template, reuse_bytes)
