"""Chat templates: how a list of messages becomes the prompt text an engine tokenizes.

The precise KV index only matches when the gateway's token ids are exactly the engine's,
so a chat request has to be rendered the way SGLang renders it:

- ``apply_chat_template``: the simulator's own template, kept deliberately simple and
  stable (a role header line, then the content, per message, then the assistant header).
  Message order is preserved, so a conversation's earlier turns are a true token prefix of
  its later turns, exactly like real chat templates.
- ``ChatTemplate``: a model's Jinja template (``tokenizer_config.json``, ``chat_template.jinja``
  or SGLang's ``--chat-template`` file), rendered in the sandbox Hugging Face transformers
  uses (5.19, the version SGLang 0.5.23 pins: ``trim_blocks``, ``lstrip_blocks``, loop
  controls, its ``tojson``, ``raise_exception`` and ``strftime_now``), with the special tokens
  as variables, after the message clean-up SGLang's ``serving_chat`` does first
  (``normalize_messages``). SGLang then encodes the text *without* adding special tokens:
  the template already wrote them.

Tool definitions reach the template as SGLang 0.5.23's request model serializes them
(``sglang_tools``): the function's fields in the client's order, the unsent ones after them
as null (``strict`` and ``defer_loading`` left out when unset), and a template that fails on
that shape gets the bare functions instead.

What is not mirrored (rendering differs, the index predicts fewer hits, and hit
verification says so): multimodal parts, other SGLang versions' tool serialization, and the
custom encoders of a few model families (DeepSeek V3.2/V4).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

_MEDIA_WORDS = ("image", "audio", "video", "vision")
_TEXT_PARTS = ("text", "input_text")
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")  # pydantic's order


def content_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts carry tokens here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return str(content)


def apply_chat_template(messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    parts = [f"<|{m.get('role', 'user')}|>\n{content_text(m.get('content'))}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def normalize_messages(messages: Sequence[Mapping[str, Any]], content_format: str = "string",
                       continue_final_message: bool = False) -> tuple[list[dict[str, Any]], str | None]:
    """The messages as SGLang hands them to a Jinja template, and the final assistant text
    to append after rendering (``continue_final_message``), else None.

    Keys whose value is null are dropped; null content is ``""``; a list of parts becomes
    its text parts joined by spaces for templates that expect a string (``"string"``), or
    stays a list of text parts (media reduced to a ``{"type": ...}`` placeholder) for
    templates that loop over it (``"openai"``); a tool message's text parts are flattened
    either way; an assistant tool call's JSON ``arguments`` become an object; and a final
    assistant message is either cut off to be continued or turned into a user message.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        msg = {k: v for k, v in message.items() if v is not None}
        msg.setdefault("content", "")
        content = msg["content"]
        if isinstance(content, list):
            if content_format == "openai":
                msg["content"] = [q for q in map(_openai_part, content) if q is not None]
            else:
                msg["content"] = " ".join(p["text"] for p in content
                                          if isinstance(p, Mapping) and p.get("type") in _TEXT_PARTS)
        if msg.get("role") == "tool" and isinstance(msg["content"], list) and all(
                isinstance(p, str) or isinstance(p, Mapping) and p.get("type") == "text" for p in msg["content"]):
            msg["content"] = " ".join(p if isinstance(p, str) else p.get("text", "") for p in msg["content"])
        if msg.get("role") == "assistant" and isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_with_parsed_arguments(call) for call in msg["tool_calls"]]
        out.append(msg)
    prefix = None
    if out and out[-1].get("role") == "assistant" and isinstance(out[-1]["content"], str):
        if continue_final_message:
            prefix = out.pop()["content"]
        else:
            out[-1] = {"role": "user", "content": out[-1]["content"]}
    return out, prefix


def _openai_part(part: Any) -> dict[str, Any] | None:
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        return {"type": "text", "text": part.get("text")}
    if kind in ("image_url", "input_image"):
        return {"type": "image"}
    if kind in ("video_url", "audio_url"):
        return {"type": kind[:-4]}
    return None


def _with_parsed_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def template_kwargs(reasoning_effort: Any = None, chat_template_kwargs: Any = None) -> dict[str, Any]:
    """What SGLang passes a chat template beyond the messages: ``reasoning_effort`` when
    given, then the request's ``chat_template_kwargs`` (``enable_thinking`` and the like)."""
    kwargs: dict[str, Any] = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
    return {**kwargs, **(chat_template_kwargs if isinstance(chat_template_kwargs, Mapping) else {})}


def sglang_tools(tools: Any, tool_choice: Any = None) -> list[dict[str, Any]] | None:
    """The ``tools`` a chat template sees: none for ``tool_choice`` "none", only the named
    function for a named choice, each as SGLang's ``Tool.model_dump()`` writes it."""
    if not tools or tool_choice == "none" or not isinstance(tools, list):
        return None
    if not all(isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) for t in tools):
        return list(tools)  # not a shape SGLang accepts: the engine will say so
    if isinstance(tool_choice, Mapping):
        named = tool_choice.get("function")
        name = named.get("name") if isinstance(named, Mapping) else None
        tools = [t for t in tools if t["function"].get("name") == name]
    out = []
    for tool in tools:
        defer = tool.get("defer_loading")
        sent = tool["function"]
        fn = {k: sent.get(k) for k in _FUNCTION_FIELDS}
        if defer is not None and fn["defer_loading"] is None:
            fn["defer_loading"] = defer
        for unset in ("strict", "defer_loading"):
            if fn[unset] is None:
                del fn[unset]
        order = [k for k in sent if k in fn] + [k for k in fn if k not in sent]
        out.append({"type": tool.get("type", "function"), "function": {k: fn[k] for k in order},
                    "defer_loading": defer})
    return out or None


class ChatTemplate:
    """A model's Jinja chat template, rendered as transformers renders it for SGLang."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)
        self.content_format = detect_content_format(source)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None = None,
               template_kwargs: Mapping[str, Any] | None = None,
               continue_final_message: bool = False) -> tuple[str, str | None]:
        """The prompt text, and the assistant text to append after it (or None)."""
        chat, prefix = normalize_messages(messages, self.content_format, continue_final_message)
        kwargs = {**self.special_tokens, **(template_kwargs or {})}
        kwargs.setdefault("add_generation_prompt", True)
        try:
            text = self._template.render(messages=chat, tools=tools, documents=None, **kwargs)
        except Exception:
            if not tools:
                raise
            # as SGLang retries: some templates (Mistral's) want the functions without the wrapper
            bare = [t["function"] if isinstance(t, Mapping) and "function" in t else t for t in tools]
            text = self._template.render(messages=chat, tools=bare, documents=None, **kwargs)
        return text, prefix


def detect_content_format(source: str) -> str:
    """``"openai"`` for templates that loop over a message's content parts (or mention
    media), else ``"string"``: SGLang's rule, which decides how list content is passed."""
    if any(word in source for word in _MEDIA_WORDS):
        return "openai"
    import jinja2.nodes

    try:
        tree = _environment().parse(source)
    except Exception:  # SGLang treats a template it cannot parse as a string template
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, name, "content") for name in ("message", "msg", "m")):
            return "openai"
    return "string"


def _reads(node: Any, name: str, key: str) -> bool:
    """``node`` is ``name[key]`` or ``name.key``, maybe sliced, filtered or tested."""
    import jinja2.nodes as n

    if isinstance(node, (n.Filter, n.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, name, key)
    if isinstance(node, n.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    if isinstance(node, n.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _is_name(node: Any, name: str) -> bool:
    import jinja2.nodes as n

    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


_ENV = None


def _environment():
    """One sandbox for every template, configured as transformers configures its own."""
    global _ENV
    if _ENV is None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # unlike Jinja's own, no HTML escaping
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        class Generation(jinja2.ext.Extension):
            """``{% generation %}`` marks assistant text for training masks; it renders as is."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV
