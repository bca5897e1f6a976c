"""Parse just enough of a request body to route it; forward the rest untouched.

The gateway never re-serializes the body: the exact bytes the client sent go
upstream, so vLLM extras (``cache_salt``, ``vllm_xargs``, ``stream_options`` ...)
pass through whatever they are. Bodies are JSON (OpenAI's APIs, Responses,
Anthropic Messages) except the audio endpoints' multipart forms, of which only the
``model`` and ``stream`` fields are read.

What is read is read as vLLM reads it. vLLM validates requests with pydantic in lax
mode, so a client that works against a pod may send what a strict schema would refuse:
``"stream": 1`` or ``"yes"``, token ids as ``1.0``, a UTF-8 byte order mark before
the JSON (vLLM 0.32 answers all of these). The gateway accepts the same values, and
refuses with 400 what vLLM refuses (``"stream": 2``, token id ``1.5``). Only fields
the request's own vLLM model has are checked: vLLM ignores the others (``stream`` on
``/tokenize``), so the gateway does too. ``tests/e2e/test_vllm_parity.py`` sends such
bodies, from every API, to a pod and through the gateway.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from gateway.errors import GatewayError
from gateway.multipart import FormError, form_fields
from kvindex.keyer import is_token_id
from kvindex.tokenization.prompt import lax_bool

Kind = Literal[
    "chat",
    "completions",
    "responses",
    "messages",  # Anthropic Messages
    "messages_count",  # Anthropic's /v1/messages/count_tokens
    "embeddings",
    "tokenize",
    "detokenize",
    "pooling",
    "classify",
    "score",
    "rerank",
    "audio",  # multipart forms: transcriptions, translations
]
# Anthropic's models require ``model``; vLLM's own APIs take a missing, null or empty
# one as the model the pod serves (``_is_model_supported``), as the gateway does when
# its pods serve one model (``Proxy._resolve_model``).
_MODEL_REQUIRED = frozenset({"messages", "messages_count"})
# The APIs whose vLLM request has a ``stream`` field; the others never read one.
_STREAMED = frozenset({"chat", "completions", "responses", "messages"})
# ... and a ``stream_options`` field (an object; vLLM also refuses one without stream).
_STREAM_OPTIONS = frozenset({"chat", "completions"})
_FORM_FIELDS = frozenset({"model", "stream"})
JSON = "application/json"

_json = msgspec.json.Decoder()
_BOM = b"\xef\xbb\xbf"


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    model: str | None
    stream: bool
    body: dict[str, Any]
    raw: bytes
    content_type: str = JSON  # what the pod is sent the raw body as

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """The conversation as chat-like messages (role, name, content): a chat body's
        own; Anthropic's system field and messages; Responses instructions and input
        items. For estimating size and prefix hashing, not for rendering."""
        body = self.body
        if self.kind in ("chat", "tokenize"):
            return body.get("messages")
        if self.kind in ("messages", "messages_count"):
            system = body.get("system")
            head = [{"role": "system", "content": system}] if system else []
            return head + body["messages"]
        if self.kind == "responses":
            return _responses_messages(body)
        return None

    @property
    def prompt(self) -> Any:
        return self.body.get("prompt")

    def approx_prompt_chars(self) -> int:
        """Cheap size estimate for load accounting before real tokenization exists.

        Only reads shapes ``parse_body`` has validated (text parts carry strings)."""
        if self.messages is not None:
            total = 0
            for m in self.messages:
                c = m.get("content")
                if isinstance(c, str):
                    total += len(c)
                elif isinstance(c, list):
                    for p in c:
                        text = p.get("text") if isinstance(p, dict) else None
                        total += len(text) if isinstance(text, str) else 0
            return total
        p = self.prompt
        if isinstance(p, str):
            return len(p)
        if isinstance(p, list):  # only completions' prompt is validated: anything else may be
            return sum(_approx_item_chars(x) for x in p)
        return 0


def _approx_item_chars(item: Any) -> int:
    """Characters of a prompt list item: text, a token id (~4), or a list of ids."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, list):
        return 4 * len(item)
    return 4 if isinstance(item, int) else 0


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    out = [{"role": "system", "content": instructions}] if instructions else []
    items = body["input"]
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items:
        if "role" in item:
            out.append(item)
        else:  # a tool call, its output, reasoning: keyed by type, its payload as content
            payload = item.get("content", item.get("output", item.get("arguments")))
            out.append({"role": item.get("type"), "name": item.get("name"), "content": payload})
    return out


def parse_body(raw: bytes, kind: Kind, content_type: str = JSON) -> ParsedRequest:
    if kind == "audio":
        return _parse_form(raw, content_type)
    if content_type.lower().split(";", 1)[0] != JSON:
        # vLLM's ``validate_json_request``: any other media type is a 400, even one
        # whose body is JSON (the pod would answer 200 to the gateway's request, which
        # always says application/json).
        raise _bad("Unsupported Media Type: only 'application/json' is allowed", "content-type")
    if not raw.strip():
        raise _bad("request body is empty; expected a JSON object")
    body, raw = _decode(raw)
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    model = _model(body.get("model"), kind)
    stream = _stream(body, kind)
    if kind == "chat":
        _check_messages(body.get("messages"))
    elif kind == "tokenize" and "messages" in body:
        _check_tokenize_messages(body)
    elif kind == "completions":
        _check_prompt(body)
    elif kind == "responses":
        _check_responses_input(body.get("input"))
    elif kind in ("messages", "messages_count"):
        _check_anthropic(body)
    so = body.get("stream_options")
    if kind in _STREAM_OPTIONS and so is not None and not isinstance(so, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    return ParsedRequest(kind=kind, model=model, stream=stream, body=body, raw=raw)


def _decode(raw: bytes) -> tuple[Any, bytes]:
    """The body's JSON value, and the bytes the pod is sent (``raw``, or the same JSON
    text in UTF-8 when the client sent UTF-16 or UTF-32).

    msgspec reads almost every body. What it refuses goes to ``json.loads``, which is
    what vLLM parses bodies with (Starlette's ``Request.json``): it also reads
    ``NaN`` and ``Infinity``, numbers beyond a float's range (as infinities), escaped
    lone surrogates, and bodies in UTF-16 or UTF-32 (told apart by their first bytes).
    A body neither reads is refused with msgspec's reason, as vLLM refuses it."""
    try:
        return _json.decode(raw[3:] if raw.startswith(_BOM) else raw), raw
    except msgspec.DecodeError as exc:
        reason = str(exc)
    except RecursionError:  # msgspec's decoder recurses per nesting level
        raise _bad("request body is nested too deeply") from None
    try:
        body = json.loads(raw)
    except ValueError:  # malformed JSON, or bytes that are not text in its encoding
        raise _bad(f"request body is not valid JSON: {reason}") from None
    except RecursionError:
        raise _bad("request body is nested too deeply") from None
    encoding = json.detect_encoding(raw)
    if encoding not in ("utf-8", "utf-8-sig"):
        # What the gateway splices into a body (a tenant's cache_salt) is UTF-8.
        raw = raw.decode(encoding).encode("utf-8", "surrogatepass")
    return body, raw


def _model(model: Any, kind: Kind) -> str | None:
    """The requested model; None where vLLM takes the served one (absent, null, "")."""
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if not model and kind in _MODEL_REQUIRED:
        raise _bad("'model' is required", "model")
    return model or None


def _stream(body: dict[str, Any], kind: Kind) -> bool:
    if kind not in _STREAMED:
        return False  # vLLM's request has no such field, and ignores it
    stream = body.get("stream", False)
    stream = False if stream is None else lax_bool(stream)
    if stream is None:
        raise _bad("'stream' must be a boolean", "stream")
    return stream


def _parse_form(raw: bytes, content_type: str) -> ParsedRequest:
    if not content_type.lower().startswith("multipart/form-data"):
        raise _bad("audio requests are multipart/form-data")
    try:
        fields = form_fields(raw, content_type, _FORM_FIELDS)
    except FormError as exc:
        raise _bad(f"request body is not a valid form: {exc}") from None
    model = fields.get("model") or None
    stream = lax_bool(fields.get("stream", "false").strip()) or False
    return ParsedRequest("audio", model, stream, dict(fields), raw, content_type)


def _check_responses_input(items: Any) -> None:
    if isinstance(items, str):
        return
    if not isinstance(items, list):
        raise _bad("'input' must be a string or an array of items", "input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}] must be an object", "input")


def _check_anthropic(body: dict[str, Any]) -> None:
    """Anthropic's ``messages`` (objects with a role and string or block content) and
    ``system`` (a string or blocks); blocks are objects with a string ``type``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        _check_blocks(m.get("content"), f"messages[{i}].content", "messages")
    system = body.get("system")
    if system is not None:
        _check_blocks(system, "system", "system")


def _check_blocks(content: Any, where: str, param: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of blocks", param)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}[{j}] must be an object with a string 'type'", param)


def _check_tokenize_messages(body: dict[str, Any]) -> None:
    """``/tokenize`` is a chat tokenization when its ``messages`` are valid; otherwise
    vLLM reads a body with a string ``prompt`` as a completion's, its ``messages``
    ignored. So does the gateway: such ``messages`` are dropped from what routing reads
    (the pod is sent the client's bytes)."""
    try:
        _check_messages(body.get("messages"))
    except GatewayError:
        if not isinstance(body.get("prompt"), str):
            raise
        del body["messages"]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        # vLLM validates content as an iterable of parts: an empty object is no parts.
        if content is None or isinstance(content, str) or content == {}:
            continue
        if not isinstance(content, list):
            raise _bad(f"messages[{i}].content must be a string or an array", "messages")
        for j, part in enumerate(content):
            _check_part(part, f"messages[{i}].content[{j}]")


def _check_part(part: Any, where: str) -> None:
    """A content part is an object with a string ``type``; a text part's ``text`` is a
    string (OpenAI's schema; vLLM answers 400 to anything else too)."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise _bad(f"{where} must be an object with a string 'type'", "messages")
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise _bad(f"{where}.text must be a string", "messages")


# A string pydantic reads as an integer, once stripped of Unicode white space (Rust's
# ``str::trim``, which unlike Python's ``str.strip`` keeps \x1c-\x1f): ASCII digits with
# a sign, single underscores between digits, and a fraction of zeros ("+1_000.0").
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
    "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def _lax_int(value: Any) -> int | None:
    """``value`` as pydantic's lax mode reads an integer: an int, a bool, a float without
    a fraction, a string of an integer (``_INT_TEXT``); None for anything else."""
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        text = value.strip(_WHITE_SPACE)
        if _INT_TEXT.fullmatch(text):
            return int(text.partition(".")[0])
    return None


def _token_ids(items: list[Any]) -> list[int] | None:
    """``items`` as a list of token ids, read like vLLM's ``list[int]``: None if one of
    them is not an integer (a list of strings is text prompts, not ids)."""
    if all(type(x) is int for x in items):
        return items  # the common case, as it is
    if all(isinstance(x, str) for x in items):
        return None
    ids = [_lax_int(x) for x in items]
    return None if None in ids else ids  # type: ignore[return-value]


def _prompt_ids(prompt: Any) -> list[int] | list[list[int]] | None:
    """Token ids, or a batch of lists of them, as vLLM reads them; None otherwise."""
    if not isinstance(prompt, list) or not prompt:
        return None
    ids = _token_ids(prompt)
    if ids is not None:
        return ids
    batch = [_token_ids(x) if isinstance(x, list) and x else None for x in prompt]
    return None if None in batch else batch  # type: ignore[return-value]


def _check_prompt(body: dict[str, Any]) -> None:
    """A completion's prompt: a string, strings, token ids or lists of token ids. Ids
    that vLLM reads as integers (``1.0``, ``"1"`` beside numbers) are kept in ``body``
    as ints, for the tokenizer and the keyer (the pod is sent the client's bytes)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return
    if prompt is None and body.get("prompt_embeds") not in (None, []):
        return  # vLLM's check: a prompt or prompt embeddings (routed by load alone)
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        return
    ids = _prompt_ids(prompt)
    if ids is None:
        raise _bad(
            "'prompt' must be a string, an array of strings, or an array of token ids", "prompt"
        )
    body["prompt"] = ids
    flat = ids if type(ids[0]) is int else [t for x in ids for t in x]  # type: ignore[union-attr]
    if not all(map(is_token_id, flat)):
        raise _bad("token ids in 'prompt' must be integers in [0, 2^32)", "prompt")
