"""Chat messages → the conversation vLLM 0.32 hands the chat template (text only).

Mirrors ``vllm/renderers/chat_utils.py`` (``parse_chat_messages``,
``_parse_chat_message_content``, ``_postprocess_messages``) and the developer-role
handling of ``vllm/renderers/hf.py`` for prompts without media:

- content: a string, or a list of text parts (``text``, ``input_text``,
  ``output_text`` carry ``text``; ``refusal`` and ``thinking`` their own key; a
  ``text``/``refusal`` part without it is skipped). Templates that loop over
  content get a list of ``{"type": "text", "text"}`` parts (vLLM's "openai"
  format; a plain string becomes one part); the others get the texts joined by
  ``"\\n"`` ("string" format). No content is ``""`` (or ``[]``); so is ``{}``,
  which vLLM validates as an iterable of no parts.
- each message keeps only what vLLM keeps: role, content, assistant ``tool_calls``
  and ``reasoning`` (also as ``reasoning_content``), a tool's ``tool_call_id``,
  ``name``, ``task``, and a developer message's ``tools``;
- a tool message whose parts are all text gets them joined (openai format too);
- system text parts lose Claude Code's per-request ``x-anthropic-billing-header``
  line;
- tool-call ``arguments`` are parsed from JSON: what is not a JSON object becomes
  ``{}``, as in vLLM;
- with a ``developer`` message and a template that does not name the role, every
  developer message becomes ``system`` and all system messages merge into one at
  the front (``"\\n\\n"``-joined).

Anything else (images, audio, files) raises ``UnsupportedPrompt``: only the engine
can render media.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvindex.tokenization.errors import UnsupportedPrompt

# Part type -> the key holding its text (vLLM's MM_PARSER_MAP, text entries).
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_WITHOUT_TEXT = ("text", "refusal")
# Fields of the content-part types vLLM knows; the rest of a text part is kept
# beside it in the openai format (``_collect_extra_fields``).
_KNOWN_PART_FIELDS = frozenset(
    {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil",
     "image_url", "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text",
     "thinking", "type", "uuid", "video_embeds", "video_url"}
)  # fmt: skip
BILLING_HEADER = "x-anthropic-billing-header"


def build_conversation(
    messages: Sequence[Mapping[str, Any]], openai_content: bool, knows_developer: bool
) -> list[dict[str, Any]]:
    """The messages as vLLM renders them (see the module docstring)."""
    conversation = [_message(m, openai_content) for m in messages]
    for message in conversation:
        _parse_tool_calls(message)
    if not knows_developer and any(m["role"] == "developer" for m in conversation):
        conversation = _consolidate_system(_developer_to_system(conversation))
    return conversation


def knows_developer_role(template: str) -> bool:
    """vLLM's test: the template names the role as a quoted string."""
    return '"developer"' in template or "'developer'" in template


def normalize_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Chat tools as vLLM dumps its ``ChatCompletionToolsParam``s for the template:
    ``{"type": "function", "function": {name, description, parameters, [strict],
    [defer_loading]}}``, other fields dropped, absent ones ``None`` (the optional
    two omitted when ``None``)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise UnsupportedPrompt("a tool without a function name")
        if tool.get("type", "function") != "function":
            raise UnsupportedPrompt("a tool that is not a function")
        defer = tool.get("defer_loading")
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        function_defer = function.get("defer_loading")
        if function_defer is None:
            function_defer = defer  # vLLM copies the tool's flag onto its function
        if function_defer is not None:
            dumped["defer_loading"] = function_defer
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if defer is not None:
            entry["defer_loading"] = defer
        out.append(entry)
    return out


def _message(message: Mapping[str, Any], openai_content: bool) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise UnsupportedPrompt("message without a role")
    role = message["role"]
    content = message.get("content")
    out: dict[str, Any]
    if type(content) is str and not openai_content and not content.startswith(BILLING_HEADER):
        # The usual message, and what the general path makes of it (one text part,
        # "joined" in the string format) without building and joining that list.
        out = {"role": role, "content": content}
    else:
        out = {"role": role, "content": _content(role, content, openai_content)}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = list(message["tool_calls"])
        reasoning = message.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        parts = out["content"]
        if openai_content and all(p.get("type") == "text" for p in parts):
            out["content"] = "\n".join(p["text"] for p in parts)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _content(role: str, content: Any, openai_content: bool) -> Any:
    """The message's content for the template: text parts (openai format) or their
    texts joined by newlines (string format)."""
    if content is None or (isinstance(content, Mapping) and not content):
        parts: list[Any] = []  # vLLM iterates content: an empty object is no parts
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise UnsupportedPrompt("content is neither text nor a list of parts")
    if role == "system":
        parts = _strip_billing_header(parts)
    parsed = [p for p in (_part(part, openai_content) for part in parts) if p is not None]
    return parsed if openai_content else "\n".join(parsed)


def _part(part: Any, openai_content: bool) -> Any:
    """One content part: its text (string format), a text part dict (openai format),
    None when vLLM skips it."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai_content else part
    if not isinstance(part, Mapping) or part.get("uuid") is not None:
        raise UnsupportedPrompt("a content part that is not text")
    kind = part.get("type")
    if kind == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if openai_content else name
    key = _TEXT_KEYS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise UnsupportedPrompt("a content part that is not text")
    text = part.get(key)
    if text is None and kind in _SKIP_WITHOUT_TEXT:
        return None
    if not isinstance(text, str):
        raise UnsupportedPrompt("a text part whose text is not a string")
    if not openai_content:
        return text
    extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
    return {"type": "text", "text": text, **extra}


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """Drop the first line of system text that starts with Claude Code's billing
    header (its hash changes per request and would defeat the prefix cache)."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_calls(message: dict[str, Any]) -> None:
    """Assistant tool calls with their arguments as objects (vLLM's rule for each)."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise UnsupportedPrompt("a tool call that is not a function call")
        parsed.append({**call, "function": {**function, "arguments": _arguments(function)}})
    message["tool_calls"] = parsed


def _arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    args = function.get("arguments")
    if not args:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return {}
    return args if isinstance(args, dict) else {}


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in conversation:
        if message["role"] == "developer":
            message = {**message, "role": "system"}
            message.pop("tools", None)
        out.append(message)
    return out


def _consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All system messages merged into one at the front, if any is not already there."""
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            rest.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, Mapping) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p)
            )
        if content:
            texts.append(content)
    if not merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]
