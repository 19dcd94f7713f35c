"""Stored Responses (``--enable-response-store``) and the objects of SGLang's Responses API.

A stored response keeps what ``previous_response_id`` continues from: the conversation's
input items and the response's output, in order (SGLang's ``msg_store``), and the input
items of this request alone (OpenAI's ``input_items``). SGLang's store is unbounded; this
one drops the least recently used past ``--response-store-size``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]  # the Responses object, as retrieve answers it
    history: list[dict[str, Any]]  # the conversation up to and including this response's output
    inputs: list[dict[str, Any]]  # this request's input items, with ids
    task: asyncio.Task | None = field(default=None, repr=False)  # a background request still running


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def pop(self, response_id: str) -> Stored | None:
        return self._items.pop(response_id, None)


def input_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """A request's ``input`` as input items with ids (a string is one user message)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    out = []
    for item in value:
        item = dict(item)
        item.setdefault("type", "message")
        if isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        item.setdefault("id", f"msg_{uuid.uuid4().hex}")
        item.setdefault("status", "completed")
        out.append(item)
    return out


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conversation items as chat messages (items without a role, such as tool calls, are left out)."""
    messages = []
    for item in items:
        role = item.get("role")
        if not isinstance(role, str):
            continue
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        messages.append({"role": "system" if role == "developer" else role,
                         "content": content if isinstance(content, str) else ""})
    return messages


def output_message(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": status,
            "phase": "final_answer", "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def status_of(finish: dict[str, Any] | None) -> str:
    """SGLang's: a length stop is ``incomplete``, an abort ``failed``, anything else ``completed``."""
    kind = finish.get("type") if isinstance(finish, dict) else None
    return "incomplete" if kind == "length" else "failed" if kind in ("abort", "error") else "completed"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(rid: str, body: dict[str, Any], model: str, status: str, output: list[dict[str, Any]],
                    used: dict[str, Any] | None, created: int | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """SGLang's ``ResponsesResponse`` for request ``body``."""
    text_only = bool(output) and all(o.get("type") == "message" for o in output)
    reasoning = body.get("reasoning")
    return {
        "id": rid, "object": "response", "created_at": created or int(time.time()), "model": model,
        "output": output, "status": status, "usage": used,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [], "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": reasoning.get("effort") if isinstance(reasoning, dict) else None, "summary": None},
        "store": body.get("store", True), "temperature": body.get("temperature"),
        "text": body.get("text") or ({"format": {"type": "text"}} if text_only else None),
        "top_p": body.get("top_p"), "truncation": body.get("truncation", "disabled"), "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }
