"""Responses and Anthropic Messages bodies render to vLLM 0.32's own token ids.

vLLM's code runs in its own venv (``~/.cache/kvgate/vllm-venv``) on the tiny model,
offline: ``OnlineRenderer.render_responses`` for Responses bodies and
``AnthropicServingMessages.to_chat_completion_request`` + ``render_chat`` for
Messages bodies, with vLLM's own probes of the template (system-first order, the
effort ``thinking.type: disabled`` maps to). Three templates: the tiny model's
ChatML (string content), ``rich.jinja`` (content parts, tools, tool calls,
reasoning, efforts) and ``system_first.jinja`` (rejects a late system message).
Skipped where that venv or the model's weights are missing.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization import (
    ChatPrompt,
    LocalTokenizer,
    Tokenization,
    messages_prompt,
    responses_prompt,
)

VLLM_PYTHON = Path(
    os.environ.get("KVGATE_VLLM_PYTHON", Path.home() / ".cache/kvgate/vllm-venv/bin/python")
)
TEMPLATES = Path(__file__).parents[1] / "data" / "chat-templates"

VLLM_SIDE = """
import asyncio, json, sys
from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as A
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.renderers.registry import renderer_from_config
path, template, cases = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3])
mc = ModelConfig(model=path, tokenizer=path, max_model_len=4096)
renderer = renderer_from_config(VllmConfig(model_config=mc))
online = OnlineRenderer(mc, renderer, request_logger=None, chat_template=template,
                        chat_template_content_format="auto")
class Probe:  # what AnthropicServingMessages' effort probe reads from itself
    model_config = mc
    online_renderer = online
    _render_probe_prompt = A._render_probe_prompt
    _extract_prompt_components = lambda self, e: A._extract_prompt_components(self, e)
async def main():
    merge = A._should_merge_inline_system(online)
    effort = await A._probe_disabled_thinking_effort(Probe())
    ids = []
    for api, body in cases:
        if api == "responses":
            ids.append((await online.render_responses(ResponsesRequest(**body)))
                       .engine_input["prompt_token_ids"])
            continue
        if api == "messages":
            req = A.to_chat_completion_request(AnthropicMessagesRequest(**body),
                merge_inline_system=merge, disabled_thinking_effort=effort)
        else:
            req = ChatCompletionRequest(**body)
        ids.append((await online.render_chat(req))[1][0]["prompt_token_ids"])
    print(json.dumps({"merge": merge, "effort": effort, "ids": ids}))
asyncio.run(main())
"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
RESPONSES = [
    {"input": "hello there"},
    {"input": "hello there", "instructions": "be brief"},
    {"input": [{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "a"},
                            {"type": "input_text", "text": "b"}]}]},
    {"input": [{"role": "developer", "content": "rules"}, {"role": "user", "content": "go"}],
     "instructions": "sys"},
    {"input": [{"role": "system", "content": "s1"}, {"role": "user", "content": "u"},
               {"role": "developer", "content": "d"}]},
    {"input": [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
               {"role": "user", "content": "thanks"}],
     "tools": [{"type": "function", "name": "get_weather", "description": "Weather",
                "parameters": WEATHER}]},
    {"input": [{"role": "user", "content": "q"},
               {"type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": "thinking hard"}]},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "answer"}]},
               {"type": "function_call", "call_id": "c9", "name": "f", "arguments": "not json"},
               {"role": "user", "content": "more"}]},
    {"input": [{"role": "user", "content": "write"},
               {"type": "message", "role": "assistant", "status": "incomplete",
                "content": [{"type": "output_text", "text": "Once upon"}]}]},
    {"input": [{"role": "user", "content": "write"},
               {"role": "assistant", "content": "Once", "status": "in_progress"}]},
    {"input": "hi", "reasoning": {"effort": "high"}},
    {"input": "hi", "reasoning": {"effort": "none"},
     "chat_template_kwargs": {"enable_thinking": True}},
    {"input": "hi", "tools": [{"type": "web_search_preview"}]},
    {"input": "hi",
     "tools": [{"type": "namespace", "name": "ns", "description": "d",
                "tools": [{"type": "function", "name": "g", "parameters": WEATHER,
                           "strict": True}]},
               {"type": "custom", "name": "grep", "description": "search"}]},
    {"input": [{"role": "user", "content": "x"},
               {"type": "custom_tool_call", "call_id": "k1", "name": "grep", "input": "foo"},
               {"type": "custom_tool_call_output", "call_id": "k1", "output": "bar"}],
     "tools": [{"type": "custom", "name": "grep"}]},
    {"input": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nreal system"},
               {"role": "user", "content": "u"}]},
]  # fmt: skip
MESSAGES = [
    {"system": "be brief", "messages": [{"role": "user", "content": "hello"}]},
    {"system": [{"type": "text", "text": "part one. "},
                {"type": "text", "text": "x-anthropic-billing-header: abc"},
                {"type": "text", "text": "part two"}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}]},
    {"messages": [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "hmm", "signature": "s"},
                      {"type": "text", "text": "let me check"},
                      {"type": "tool_use", "id": "tu1", "name": "get_weather",
                       "input": {"city": "Paris", "n": 1.5}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "tu1",
                       "content": [{"type": "text", "text": "sunny"},
                                   {"type": "text", "text": "warm"}]},
                      {"type": "text", "text": "and tomorrow?"}]}],
     "tools": [{"name": "get_weather", "description": "Weather",
                "input_schema": {"properties": {"city": {"type": "string"}}}}],
     "tool_choice": {"type": "none"}},
    {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "inline rule"},
                  {"role": "user", "content": "b"}]},
    {"messages": [{"role": "user", "content": "a"},
                  {"role": "assistant", "content": [
                      {"type": "tool_result", "tool_use_id": "z",
                       "content": [{"type": "text", "text": "r"}]}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "z", "content": "only result"}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}},
    {"messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "medium"}},
    {"messages": [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                  {"role": "user", "content": "again"}]},
    {"messages": [{"role": "user", "content": "hi"}],
     "tools": [{"name": "a", "input_schema": {"type": "object"}},
               {"name": "b", "input_schema": {"type": "object"}, "strict": True}],
     "tool_choice": {"type": "none"}},
]  # fmt: skip
CHAT = [
    {"messages": [{"role": "user", "content": "hi"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER},
                "extra": 1}],
     "tool_choice": "none"},
    {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"},
    {"messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": None, "reasoning": "r",
                   "tool_calls": [{"id": "i", "type": "function",
                                   "function": {"name": "f", "arguments": "[1]"}}]},
                  {"role": "tool", "tool_call_id": "i",
                   "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]},
]  # fmt: skip


def _cases() -> list[list]:
    return (
        [["responses", {"model": "m", **b}] for b in RESPONSES]
        + [["messages", {"model": "m", "max_tokens": 5, **b}] for b in MESSAGES]
        + [["chat", {"model": "m", **b}] for b in CHAT]
    )


def _vllm_render(model_dir: Path, template: str, cases: list[list]) -> dict:
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SIDE, str(model_dir), template, json.dumps(cases)],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.parametrize("template_file", ["", "rich.jinja", "system_first.jinja"])
async def test_conversions_render_the_ids_vllm_renders(template_file):
    model_dir = ensure_tokenizer()
    if not VLLM_PYTHON.exists() or not (model_dir / "config.json").exists():
        pytest.skip("needs the vLLM venv and the tiny model's config (see VLLM_NOTES.md)")
    template = (TEMPLATES / template_file).read_text() if template_file else ""
    cases = _cases()
    expected = _vllm_render(model_dir, template, cases)
    local = LocalTokenizer(model_dir, chat_template=template or None)
    facts = local.anthropic_facts
    assert (facts.merge_inline_system, facts.disabled_thinking_effort) == (
        expected["merge"],
        expected["effort"],
    )
    tok = Tokenization("m", "local", local)
    ours = []
    for api, body in cases:
        if api == "responses":
            prompt = responses_prompt(body)
        elif api == "messages":
            prompt = messages_prompt(body, facts)
        else:
            prompt = ChatPrompt.from_body(body)
        ours.append(list(await tok.chat(prompt)))
    for case, got, want in zip(cases, ours, expected["ids"], strict=True):
        assert got == want, case
