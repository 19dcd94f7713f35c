"""The chat template the simulator applies, and the gateway mirrors for precise routing.

Kept deliberately simple and stable: a role header line, then the content, per message,
then the assistant header. Message order is preserved, so a conversation's earlier turns
are a true token prefix of its later turns, exactly like real chat templates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


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
