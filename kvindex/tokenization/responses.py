"""An OpenAI Responses body → the chat prompt vLLM 0.32 renders for it.

vLLM renders ``POST /v1/responses`` (non-Harmony models) as a chat conversation
(``vllm/entrypoints/openai/responses/utils.py: construct_input_messages``,
``construct_tool_dicts``; ``ResponsesRequest.build_chat_params``); this module is
that conversion:

- ``instructions`` (when non-empty) is the first system message; a string
  ``input`` is one user message;
- input items: messages with a ``role`` pass as chat messages (their
  ``input_text``/``output_text`` parts are text); an assistant message keeps the
  text of its first part; ``function_call`` and ``custom_tool_call`` items become
  assistant ``tool_calls``, ``reasoning`` items an assistant's ``reasoning``
  (first content text, else first summary text), each merged into the preceding
  assistant message while that one lacks the field;
  ``function_call_output``/``custom_tool_call_output`` become ``tool`` messages;
- a last message or reasoning item with status ``in_progress``/``incomplete`` is
  continued (``continue_final_message``) instead of answered;
- ``function`` tools (namespaced ones flattened to ``<namespace>__<name>``,
  ``custom`` ones shown as a one-string function) become chat tools; other tool
  types are never shown to the model;
- ``reasoning.effort`` is the reasoning effort.

``previous_response_id`` (history stored on one pod) and item types vLLM does not
render as chat (``item_reference``, encrypted reasoning, media) raise
``UnsupportedPrompt``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvindex.tokenization.errors import UnsupportedPrompt
from kvindex.tokenization.prompt import ChatPrompt

NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_INPUT_KEY = "input"
_CONTINUED = ("in_progress", "incomplete")


def custom_tool_parameters() -> dict[str, Any]:
    """The schema of the one-string function vLLM shows for a ``custom`` tool."""
    return {
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [CUSTOM_TOOL_INPUT_KEY],
        "additionalProperties": False,
    }


def responses_prompt(body: Mapping[str, Any]) -> ChatPrompt:
    """The chat prompt vLLM renders for a Responses body."""
    if body.get("previous_response_id") is not None or body.get("previous_input_messages"):
        raise UnsupportedPrompt("the conversation history is stored on a pod")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            message = _from_item(item, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
    else:
        raise UnsupportedPrompt("'input' is neither text nor a list of items")
    continued = _continues_final_message(items)
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    kwargs = body.get("chat_template_kwargs")
    return ChatPrompt(
        messages=messages,
        add_generation_prompt=not continued,
        continue_final_message=continued,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        tools=_tools(body.get("tools")),
        reasoning_effort=effort if isinstance(effort, str) else None,
    )


def _continues_final_message(items: Any) -> bool:
    """vLLM's ``should_continue_final_message``: a partial last message or reasoning."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], Mapping):
        return False
    last = items[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    status = last.get("status")
    if status is None and _is_output_message(last):
        status = "completed"  # vLLM fills the status of an assistant output message
    return status in _CONTINUED


def _is_output_message(item: Mapping[str, Any]) -> bool:
    """An assistant message vLLM parses as a ``ResponseOutputMessage``."""
    return (
        item.get("type") == "message"
        and item.get("role") == "assistant"
        and isinstance(item.get("content"), list)
    )


def _from_item(item: Any, previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``_construct_message_from_response_item``: a new message, or None when
    the item was merged into ``previous`` (an assistant message)."""
    if not isinstance(item, Mapping):
        raise UnsupportedPrompt("an input item that is not an object")
    assistant = previous if previous and previous.get("role") == "assistant" else None
    kind = item.get("type")
    call = _tool_call(item)
    if call is not None:
        if assistant is not None:
            assistant.setdefault("tool_calls", [])
            if assistant["tool_calls"] is None:
                assistant["tool_calls"] = []
            assistant["tool_calls"].append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        text = _reasoning_text(item)
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _assistant_text(item.get("content"))
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return dict(item)
    raise UnsupportedPrompt(f"input items of type {str(kind)[:40]!r} are not rendered as chat")


def _tool_call(item: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type")
    if kind == "function_call":
        name, namespace = item.get("name"), item.get("namespace")
        if not isinstance(name, str) or not isinstance(item.get("arguments"), str):
            raise UnsupportedPrompt("a function call without a name or arguments")
        if namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        function = {"name": name, "arguments": item["arguments"]}
    elif kind == "custom_tool_call":
        payload = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
        function = {"name": item.get("name"), "arguments": payload}
    else:
        return None
    return {"id": item.get("call_id"), "function": function, "type": "function"}


def _reasoning_text(item: Mapping[str, Any]) -> str:
    if item.get("encrypted_content"):
        raise UnsupportedPrompt("encrypted reasoning")
    content, summary = item.get("content"), item.get("summary")
    if not isinstance(summary, list):
        raise UnsupportedPrompt("a reasoning item without a summary list")
    first = content[0] if isinstance(content, list) and content else None
    if first is None and summary:
        first = summary[0]
    if first is None:
        return ""
    text = first.get("text") if isinstance(first, Mapping) else None
    if not isinstance(text, str):
        raise UnsupportedPrompt("reasoning text that is not a string")
    return text


def _assistant_text(content: Any) -> str | None:
    """The text vLLM takes from an assistant message: all of a string, else the
    first part's."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        first = content[0]
        text = first.get("text") if isinstance(first, Mapping) else None
        if text is None:
            raise UnsupportedPrompt("an assistant message whose first part has no text")
        return text
    return None


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The chat tools vLLM shows the template (None when the request has none)."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise UnsupportedPrompt("'tools' is not a list")
    functions: list[Mapping[str, Any]] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind == "function":
            functions.append(tool)
        elif kind == "namespace":
            for inner in tool.get("tools") or []:
                if isinstance(inner, Mapping) and inner.get("type") == "function":
                    name = f"{tool.get('name')}{NAMESPACE_SEPARATOR}{inner.get('name')}"
                    functions.append({**inner, "name": name})
        elif kind == "custom":
            functions.append(
                {"type": "function", "name": tool.get("name"),
                 "description": tool.get("description"), "parameters": custom_tool_parameters()}
            )  # fmt: skip
    return [
        {"type": "function", "function": {k: v for k, v in f.items() if k != "type"}}
        for f in functions
    ]
