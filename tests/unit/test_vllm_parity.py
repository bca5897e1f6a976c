"""Bodies a vLLM 0.32 pod answers that the gateway once refused, and the reverse.

Each case was found by sending the same raw body to a pod and through the gateway
(``tests/e2e/test_vllm_parity.py`` keeps doing so). The reference for each value is
vLLM's own reading: pydantic in lax mode (``TypeAdapter``), Python's ``json`` module
(what Starlette parses a body with) and the checks in vLLM's request models.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from gateway.errors import GatewayError
from gateway.openai_body import Kind, _lax_int, parse_body
from kvindex.tokenization.conversation import build_conversation
from kvindex.tokenization.prompt import ChatPrompt, lax_bool

M = "m"
USER = [{"role": "user", "content": "hi"}]
BODIES: dict[Kind, dict[str, Any]] = {
    "chat": {"model": M, "messages": USER},
    "completions": {"model": M, "prompt": "hi"},
    "responses": {"model": M, "input": "hi"},
    "messages": {"model": M, "max_tokens": 2, "messages": USER},
    "messages_count": {"model": M, "messages": USER},
    "tokenize": {"model": M, "prompt": "hi"},
    "detokenize": {"model": M, "tokens": [1, 2]},
    "embeddings": {"model": M, "input": "hi"},
}


def _raw(kind: Kind, **fields: Any) -> bytes:
    return json.dumps({**BODIES[kind], **fields}).encode()


def _refused(raw: bytes, kind: Kind, content_type: str = "application/json") -> GatewayError:
    with pytest.raises(GatewayError) as err:
        parse_body(raw, kind, content_type)
    assert err.value.status == 400
    return err.value


# -- the body's JSON: Python's json module, as Starlette reads it --------------------------


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b'"\\ud800"'])
def test_json_that_python_reads_and_msgspec_does_not_is_read(literal):
    raw = _raw("chat")[:-1] + b', "temperature": ' + literal + b"}"
    parsed = parse_body(raw, "chat")
    assert parsed.model == M and parsed.raw == raw  # forwarded as it came


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_body_in_utf16_or_utf32_is_read_and_forwarded_as_utf8(encoding):
    text = json.dumps({**BODIES["chat"], "user": "é😀"}, ensure_ascii=False)
    parsed = parse_body(text.encode(encoding), "chat")
    assert parsed.body["messages"] == USER
    assert parsed.raw == text.encode()  # what the gateway splices into must be UTF-8


@pytest.mark.parametrize("raw", [b'{"model": "m"} x', b'{"model": "m"}\x00', b'{"a": "\xff"}',
                                 b'{"a": ' + b"9" * 5000 + b"}"])  # fmt: skip
def test_json_that_neither_reads_is_still_refused(raw):
    _refused(raw, "chat")


# -- the media type: vLLM's validate_json_request ----------------------------------------


NOT_JSON = ["text/plain", "application/x-www-form-urlencoded", "application/vnd.api+json", "",
            "application/json "]  # fmt: skip


@pytest.mark.parametrize("content_type", NOT_JSON)
def test_a_json_api_refuses_any_media_type_but_application_json(content_type):
    err = _refused(_raw("chat"), "chat", content_type)
    assert err.param == "content-type"


@pytest.mark.parametrize("content_type", ["APPLICATION/JSON", "application/json; charset=utf-8"])
def test_application_json_in_any_case_and_with_parameters_is_json(content_type):
    assert parse_body(_raw("completions"), "completions", content_type).model == M


# -- model: optional in vLLM's own APIs, required in Anthropic's --------------------------


@pytest.mark.parametrize("kind", ["chat", "completions", "responses", "tokenize", "detokenize",
                                  "embeddings"])  # fmt: skip
@pytest.mark.parametrize("model", [None, "", "absent"])
def test_vllm_apis_take_a_missing_null_or_empty_model_as_the_served_one(kind, model):
    body = {k: v for k, v in BODIES[kind].items() if k != "model"}
    if model != "absent":
        body["model"] = model
    assert parse_body(json.dumps(body).encode(), kind).model is None  # the proxy resolves it


@pytest.mark.parametrize("kind", ["messages", "messages_count"])
@pytest.mark.parametrize("model", [None, ""])
def test_anthropic_apis_require_a_model(kind, model):
    assert _refused(_raw(kind, model=model), kind).param == "model"


@pytest.mark.parametrize("kind", list(BODIES))
def test_a_model_that_is_not_a_string_is_refused_everywhere(kind):
    assert _refused(_raw(kind, model=["m"]), kind).param == "model"


# -- stream and stream_options: read only where vLLM's request has them -------------------


@pytest.mark.parametrize("kind", ["messages_count", "tokenize", "detokenize", "embeddings"])
@pytest.mark.parametrize("field", [{"stream": "x"}, {"stream": 2}, {"stream_options": "x"}])
def test_apis_without_stream_ignore_stream_fields(kind, field):
    assert parse_body(_raw(kind, **field), kind).stream is False


@pytest.mark.parametrize("kind", ["responses", "messages"])
def test_apis_without_stream_options_ignore_it(kind):
    assert parse_body(_raw(kind, stream_options="x"), kind).stream is False


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_options_is_still_an_object_where_vllm_has_it(kind):
    assert _refused(_raw(kind, stream_options="x", stream=True), kind).param == "stream_options"


@pytest.mark.parametrize("kind", ["chat", "completions", "responses", "messages"])
def test_stream_is_still_a_boolean_where_vllm_has_it(kind):
    assert _refused(_raw(kind, stream="x"), kind).param == "stream"


# -- chat content: vLLM validates it as an iterable of parts -----------------------------


def test_empty_object_content_is_no_content():
    parsed = parse_body(_raw("chat", messages=[{"role": "user", "content": {}}, *USER]), "chat")
    assert parsed.approx_prompt_chars() == 2
    for openai_content in (True, False):
        conversation = build_conversation(parsed.body["messages"], openai_content, True)
        empty = build_conversation([{"role": "user", "content": []}], openai_content, True)
        assert conversation[0] == empty[0]


def test_an_object_with_parts_as_keys_is_still_refused():
    content = {"type": "text", "text": "hi"}  # iterated, its keys are not parts
    assert _refused(_raw("chat", messages=[{"role": "user", "content": content}]), "chat")


# -- /tokenize: a chat tokenization only when its messages are valid ----------------------


@pytest.mark.parametrize("messages", [None, [], "x", [None], [{"role": "user", "content": 1}]])
def test_tokenize_with_a_prompt_ignores_messages_vllm_cannot_read(messages):
    parsed = parse_body(_raw("tokenize", messages=messages), "tokenize")
    assert parsed.messages is None and parsed.approx_prompt_chars() == 2


@pytest.mark.parametrize("prompt", ["absent", 1, None])
def test_tokenize_without_a_string_prompt_refuses_bad_messages(prompt):
    body = {"model": M, "messages": "x"} | ({} if prompt == "absent" else {"prompt": prompt})
    assert _refused(json.dumps(body).encode(), "tokenize").param == "messages"


def test_tokenize_with_both_is_a_chat_tokenization():
    assert parse_body(_raw("tokenize", messages=USER), "tokenize").messages == USER


# -- completions: token ids as strings, prompt embeddings --------------------------------

INT_TEXTS = [" 1", "1 ", "\t1\n", "\xa01", "\u30001", "\x1c1", "+1", "-1", "1_0", "1__0", "_1",
             "1_", "2.0", "2.00", "2.", ".0", "2.5", "1e2", "1_000.0", "0x1", "٣", "１", "+",
             "-", "", "+-1", "99999999999999999999"]  # fmt: skip


@pytest.mark.parametrize("text", INT_TEXTS, ids=repr)
def test_integer_strings_are_read_as_pydantic_reads_them(text):
    try:
        expected = TypeAdapter(int).validate_python(text)
    except ValidationError:
        expected = None
    assert _lax_int(text) == expected


@pytest.mark.parametrize("prompt", [[" 1", 2], ["+1", 2], ["1_0", 2], [1, "2.0"], [[" 3", 4]]])
def test_token_ids_written_as_integer_strings_are_token_ids(prompt):
    parsed = parse_body(_raw("completions", prompt=prompt), "completions")
    assert parsed.body["prompt"] in ([1, 2], [10, 2], [[3, 4]])


@pytest.mark.parametrize("prompt", [None, "absent", ""])
def test_prompt_embeddings_stand_for_a_missing_prompt(prompt):
    body = {"model": M, "prompt_embeds": "AAAA"} | (
        {} if prompt == "absent" else {"prompt": prompt}
    )
    parsed = parse_body(json.dumps(body).encode(), "completions")
    assert parsed.approx_prompt_chars() == 0


@pytest.mark.parametrize("embeds", [None, []])
def test_no_prompt_and_no_prompt_embeddings_is_still_refused(embeds):
    body = {"model": M, "prompt": None, "prompt_embeds": embeds}
    assert _refused(json.dumps(body).encode(), "completions").param == "prompt"


# -- booleans, token ids and the byte order mark, as pydantic reads them ----------------

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
    raw = json.dumps({"model": "m", "messages": USER, "stream": value}).encode()
    expected = _pydantic(TypeAdapter(bool), value)
    if expected is None:
        with pytest.raises(GatewayError) as err:
            parse_body(raw, "chat")
        assert err.value.status == 400 and err.value.param == "stream"
    else:
        assert parse_body(raw, "chat").stream is expected


def test_a_null_stream_is_not_streamed():
    raw = json.dumps({"model": "m", "messages": USER, "stream": None}).encode()
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
    raw = b"\xef\xbb\xbf" + json.dumps({"model": "m", "messages": USER}).encode()
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
    prompt = ChatPrompt.from_body({"messages": USER, **dict.fromkeys(FLAGS, value)})
    expected = TypeAdapter(bool).validate_python(value)
    assert [getattr(prompt, name) for name in FLAGS] == [expected] * len(FLAGS)


def test_a_flag_vllm_would_refuse_leaves_the_default():
    prompt = ChatPrompt.from_body({"messages": USER, **dict.fromkeys(FLAGS, "maybe")})
    assert [getattr(prompt, name) for name in FLAGS] == list(FLAGS.values())
