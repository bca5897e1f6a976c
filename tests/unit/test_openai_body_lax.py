"""The fields the gateway reads are read as vLLM reads them: pydantic's lax mode.

vLLM validates request bodies with pydantic, so the reference for each value is
pydantic itself (``TypeAdapter`` of the field's type in vLLM's request models); the
e2e test ``test_lax_values_are_answered_like_the_pod_answers_them`` checks the same
bodies against a real pod.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from gateway.errors import GatewayError
from gateway.openai_body import parse_body
from kvindex.tokenization.prompt import ChatPrompt, lax_bool

MESSAGES = [{"role": "user", "content": "hi"}]
STREAM_VALUES = [True, False, 1, 0, 1.0, 0.0, 0.5, 2, -1, "true", "TRUE", "tRuE", "yes",
                 "Y", "on", "t", "1", "false", "No", "off", "f", "0", "2", "", " yes",
                 "maybe", [], {}, [True]]  # fmt: skip
# vLLM's CompletionRequest.prompt
PROMPT_TYPE = TypeAdapter(list[int] | list[str] | str | list[list[int]])
PROMPTS = [[1, 2, 3], [1.0, 2.0], [True, 2], ["7", 2], [[1.0], [2, 3]], [1.5, 2], ["a", 2],
           [[1, 2], "a"], [1, [2]], ["1", "2"], [[]], [], 5, [None], [1e30]]  # fmt: skip


def _pydantic(adapter: TypeAdapter[Any], value: Any) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return None


@pytest.mark.parametrize("value", STREAM_VALUES, ids=repr)
def test_stream_values_are_booleans_exactly_where_pydantic_reads_them_so(value):
    assert lax_bool(value) == _pydantic(TypeAdapter(bool), value)


@pytest.mark.parametrize("value", STREAM_VALUES, ids=repr)
def test_a_chat_body_is_streamed_or_refused_as_vllm_would(value):
    raw = json.dumps({"model": "m", "messages": MESSAGES, "stream": value}).encode()
    expected = _pydantic(TypeAdapter(bool), value)
    if expected is None:
        with pytest.raises(GatewayError) as err:
            parse_body(raw, "chat")
        assert err.value.status == 400 and err.value.param == "stream"
    else:
        assert parse_body(raw, "chat").stream is expected


def test_a_null_stream_is_not_streamed():
    raw = json.dumps({"model": "m", "messages": MESSAGES, "stream": None}).encode()
    assert parse_body(raw, "chat").stream is False


@pytest.mark.parametrize("prompt", PROMPTS, ids=repr)
def test_completion_prompts_are_read_as_pydantic_reads_them(prompt):
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    expected = _pydantic(PROMPT_TYPE, prompt)
    if expected is None or expected == [] or expected == [[]]:
        with pytest.raises(GatewayError) as err:
            parse_body(raw, "completions")
        assert err.value.status == 400 and err.value.param == "prompt"
        return
    parsed = parse_body(raw, "completions")
    assert parsed.body["prompt"] == expected  # ints where vLLM reads ints
    assert [type(t) for t in _flat(parsed.body["prompt"])] == [type(t) for t in _flat(expected)]
    assert parsed.raw == raw  # the pod is sent what the client sent


def _flat(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    return [t for x in prompt for t in (x if isinstance(x, list) else [x])]


def test_a_json_body_after_a_utf8_byte_order_mark_is_read():
    raw = b"\xef\xbb\xbf" + json.dumps({"model": "m", "messages": MESSAGES}).encode()
    parsed = parse_body(raw, "chat")
    assert parsed.model == "m" and parsed.raw == raw


def test_a_byte_order_mark_alone_or_twice_is_still_not_json():
    for raw in (b"\xef\xbb\xbf", b"\xef\xbb\xbf\xef\xbb\xbf{}"):
        with pytest.raises(GatewayError) as err:
            parse_body(raw, "chat")
        assert err.value.status == 400


FLAGS = {"add_generation_prompt": True, "continue_final_message": False,
         "add_special_tokens": False}  # vLLM's defaults  # fmt: skip


@pytest.mark.parametrize("value", ["no", "false", "0", 0, "YES", "on", 1.0, True, False],
                         ids=repr)  # fmt: skip
def test_a_chat_prompts_flags_are_read_as_vllm_reads_them(value):
    """The flags change the rendered prompt, so the tokens kv-aware keys: "no" is false."""
    prompt = ChatPrompt.from_body({"messages": MESSAGES, **dict.fromkeys(FLAGS, value)})
    expected = TypeAdapter(bool).validate_python(value)
    assert [getattr(prompt, name) for name in FLAGS] == [expected] * len(FLAGS)


def test_a_flag_vllm_would_refuse_leaves_the_default():
    prompt = ChatPrompt.from_body({"messages": MESSAGES, **dict.fromkeys(FLAGS, "maybe")})
    assert [getattr(prompt, name) for name in FLAGS] == list(FLAGS.values())
