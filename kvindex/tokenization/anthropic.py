"""An Anthropic Messages body → the chat prompt vLLM 0.32 renders for it.

vLLM serves ``POST /v1/messages`` by converting the request into a chat completion
(``vllm/entrypoints/anthropic/serving.py: to_chat_completion_request``) and
rendering that; this module is that conversion, for text:

- ``system`` (a string or text blocks, joined with no separator; Claude Code's
  ``x-anthropic-billing-header`` blocks dropped) becomes the first system message;
- a message's ``text`` blocks become its content (one block: a plain string),
  ``thinking`` its ``reasoning``, ``tool_use`` its ``tool_calls`` (arguments as
  ``json.dumps(input)``); a user's ``tool_result`` becomes a ``tool`` message
  placed before it (text parts joined by ``"\\n"``), an assistant's becomes the
  text ``"Tool result: <content>"``; a user message left empty is dropped;
- inline ``system`` messages stay in place, or are merged into the first system
  message when the template insists on system-first order (``AnthropicFacts``);
- ``tools`` (after ``tool_addition``/``tool_removal`` blocks) become function
  tools, their ``input_schema`` the parameters (``"type": "object"`` added when
  missing);
- ``output_config.effort`` is the reasoning effort; ``thinking.type: disabled``
  sets the effort the template answers to (``AnthropicFacts``).

Images raise ``UnsupportedPrompt`` (only the engine renders media).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvindex.tokenization.conversation import BILLING_HEADER
from kvindex.tokenization.errors import UnsupportedPrompt
from kvindex.tokenization.prompt import ChatPrompt

_PROBE_CONVERSATION = [
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
    {"role": "system", "content": "t"},
    {"role": "user", "content": "t"},
]


@dataclass(frozen=True, slots=True)
class AnthropicFacts:
    """What vLLM's Messages endpoint decides from the served chat template."""

    merge_inline_system: bool  # the template rejects a system message after the first turn
    disabled_thinking_effort: str  # the reasoning effort ``thinking.type: disabled`` maps to


def merges_inline_system(template: str | None) -> bool:
    """vLLM's probe: render ``[system, user, system, user]`` in a plain sandbox; a
    template that raises (e.g. Qwen's ``loop.first`` guard) needs system-first order."""
    if not template:
        return True
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    try:
        env.from_string(template).render(messages=_PROBE_CONVERSATION, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def messages_prompt(body: Mapping[str, Any], facts: AnthropicFacts | None) -> ChatPrompt:
    """The chat prompt vLLM renders for an Anthropic Messages body. ``facts`` may be
    None (no local template) when the body needs neither of them."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise UnsupportedPrompt("'messages' is not a list")
    inline_system = any(_role(m) == "system" for m in messages)
    thinking = body.get("thinking")
    disabled = isinstance(thinking, Mapping) and thinking.get("type") == "disabled"
    if facts is None and (inline_system or disabled):
        raise UnsupportedPrompt("the conversion depends on the pod's chat template")
    merge = facts is not None and facts.merge_inline_system
    chat: list[dict[str, Any]] = []
    _system(body, messages, chat, merge)
    for message in messages:
        _message(message, chat, merge)
    effort = None
    output_config = body.get("output_config")
    if isinstance(output_config, Mapping) and output_config.get("effort") is not None:
        effort = output_config["effort"]
    if disabled:
        assert facts is not None
        effort = facts.disabled_thinking_effort
    kwargs = body.get("chat_template_kwargs")
    return ChatPrompt(
        messages=chat,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        tools=_tools(body),
        reasoning_effort=effort if isinstance(effort, str) else None,
    )


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, Mapping) else None


def _blocks(content: Any) -> list[Mapping[str, Any]]:
    if not isinstance(content, list) or not all(isinstance(b, Mapping) for b in content):
        raise UnsupportedPrompt("content is neither text nor a list of blocks")
    return content


def _system_text(content: Any) -> str | None:
    """Text of a system message or system field, billing-header blocks dropped."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    texts = [
        b["text"]
        for b in _blocks(content)
        if b.get("type") == "text" and isinstance(b.get("text"), str) and b["text"]
        and not b["text"].startswith(BILLING_HEADER)
    ]  # fmt: skip
    return "".join(texts) if texts else None


def _system(
    body: Mapping[str, Any], messages: list[Any], chat: list[dict[str, Any]], merge: bool
) -> None:
    parts: list[str] = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else _system_text(system)
        if text:  # a string field is kept even with the header; blocks are filtered
            parts.append(text)
    if merge:
        for message in messages:
            if _role(message) == "system":
                text = _system_text(message.get("content"))
                if text:
                    parts.append(text)
    if parts:
        chat.append({"role": "system", "content": "".join(parts)})


def _message(message: Any, chat: list[dict[str, Any]], merge: bool) -> None:
    role = _role(message)
    if role not in ("user", "assistant", "system"):
        raise UnsupportedPrompt("a message role Anthropic does not have")
    content = message.get("content")
    if role == "system":
        text = None if merge else _system_text(content)
        if text:
            chat.append({"role": "system", "content": text})
        return
    out: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        out["content"] = content
    else:
        _blocks_into(out, _blocks(content), chat)
    if not (role == "user" and "content" not in out):
        chat.append(out)


def _blocks_into(
    out: dict[str, Any], blocks: list[Mapping[str, Any]], chat: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            raise UnsupportedPrompt("an image block")
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id") or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            if out["role"] == "user":
                _user_tool_result(block, chat)
            else:
                result = str(block["content"]) if block.get("content") else ""
                parts.append({"type": "text", "text": f"Tool result: {result}"})
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    if parts:
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        out["content"] = parts[0]["text"] if one_text else parts


def _user_tool_result(block: Mapping[str, Any], chat: list[dict[str, Any]]) -> None:
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    text = ""
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                raise UnsupportedPrompt("an image in a tool result")
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    chat.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if references:
        chat.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = _resolved_tools(body)
    if tools is None:
        return None
    out = []
    for tool in tools:
        schema = tool.get("input_schema") if isinstance(tool, Mapping) else None
        if not isinstance(schema, dict):
            raise UnsupportedPrompt("a tool without an input schema")
        schema = dict(schema)
        schema.setdefault("type", "object")
        function = {
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": schema,
            "strict": tool.get("strict"),
            "defer_loading": tool.get("defer_loading"),
        }
        out.append({"type": "function", "function": function})
    return out


def _resolved_tools(body: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """``tools`` as in effect at the end of the conversation (vLLM's ``_resolve_tools``)."""
    declared = body.get("tools")
    changes = [
        block
        for message in body.get("messages") or []
        if isinstance(message, Mapping) and isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, Mapping) and block.get("type") in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return declared if isinstance(declared, list) else None
    tools = {t.get("name"): t for t in declared or [] if isinstance(t, Mapping)}
    removed: set[Any] = set()
    for block in changes:
        change = block.get("tool")
        if not isinstance(change, Mapping):
            raise UnsupportedPrompt("a tool change without a tool")
        if change.get("type") == "tool_definition":
            definition = change.get("definition")
            if not isinstance(definition, Mapping):
                raise UnsupportedPrompt("a tool definition that is not an object")
            name = definition.get("name")
            tools[name] = definition
        else:
            name = change.get("name")
            if name not in tools:
                raise UnsupportedPrompt("a tool change names an undeclared tool")
            if block["type"] == "tool_addition":
                tools[name] = {**tools[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in tools.items() if name not in removed]
