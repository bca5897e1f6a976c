"""Responses and Anthropic Messages bodies become the chat prompt vLLM 0.32 renders.

``test_conversions_vllm.py`` checks the resulting ids against vLLM itself; these
tests spell out each rule of the conversions and of the conversation vLLM builds.
"""

from pathlib import Path

import pytest

from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization import (
    AnthropicFacts,
    ChatPrompt,
    LocalTokenizer,
    UnsupportedPrompt,
    messages_prompt,
    responses_prompt,
)
from kvindex.tokenization.anthropic import merges_inline_system
from kvindex.tokenization.conversation import build_conversation, normalize_tools
from kvindex.tokenization.responses import custom_tool_parameters

TEMPLATES = Path(__file__).parents[1] / "data" / "chat-templates"
KEEP_SYSTEM = AnthropicFacts(merge_inline_system=False, disabled_thinking_effort="none")
MERGE_SYSTEM = AnthropicFacts(merge_inline_system=True, disabled_thinking_effort="low")


# -- Responses ---------------------------------------------------------------------


def test_instructions_and_a_string_input_are_a_system_and_a_user_message():
    prompt = responses_prompt({"model": "m", "input": "hi", "instructions": "be brief"})
    assert prompt == ChatPrompt(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )


def test_tool_calls_and_reasoning_merge_into_the_preceding_assistant_message():
    body = {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "looking"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
             "namespace": "ns"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ]
    }  # fmt: skip
    assert responses_prompt(body).messages == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "looking",
            "reasoning": "why",
            "tool_calls": [
                {"id": "c1", "function": {"name": "ns__f", "arguments": "{}"}, "type": "function"},
                {"id": "c2", "function": {"name": "g", "arguments": "{}"}, "type": "function"},
            ],
        },
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
    ]


def test_a_partial_last_assistant_message_is_continued_not_answered():
    body = {
        "input": [
            {"role": "user", "content": "write"},
            {"role": "assistant", "content": "Once", "status": "incomplete"},
        ]
    }
    prompt = responses_prompt(body)
    assert (prompt.add_generation_prompt, prompt.continue_final_message) == (False, True)
    done = {"input": [*body["input"][:1], {"role": "assistant", "content": "Once"}]}
    assert responses_prompt(done).add_generation_prompt is True


def test_function_namespace_and_custom_tools_are_shown_as_chat_functions_others_never():
    schema = {"type": "object"}
    body = {
        "input": "hi",
        "reasoning": {"effort": "high"},
        "tools": [
            {"type": "function", "name": "f", "parameters": schema, "strict": True},
            {"type": "namespace", "name": "ns",
             "tools": [{"type": "function", "name": "g", "parameters": schema}]},
            {"type": "custom", "name": "grep", "description": "search"},
            {"type": "web_search_preview"},
        ],
    }  # fmt: skip
    prompt = responses_prompt(body)
    assert prompt.reasoning_effort == "high"
    assert prompt.tools == [
        {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}},
        {"type": "function", "function": {"name": "ns__g", "parameters": schema}},
        {"type": "function", "function": {"name": "grep", "description": "search",
                                          "parameters": custom_tool_parameters()}},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [
        {"input": "hi", "previous_response_id": "resp_1"},
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
        {"input": 7},
    ],
)
def test_what_the_pod_alone_can_render_is_unsupported(body):
    with pytest.raises(UnsupportedPrompt):
        responses_prompt(body)


# -- Anthropic Messages ------------------------------------------------------------


def test_system_blocks_are_joined_without_the_billing_header():
    body = {
        "system": [
            {"type": "text", "text": "one. "},
            {"type": "text", "text": "x-anthropic-billing-header: cch=9"},
            {"type": "text", "text": "two"},
        ],
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert messages_prompt(body, None).messages == [
        {"role": "system", "content": "one. two"},
        {"role": "user", "content": "hi"},
    ]


def test_tool_use_thinking_and_tool_results_become_chat_tool_calls_and_tool_messages():
    body = {
        "messages": [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"type": "text", "text": "and?"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        ],
    }  # fmt: skip
    assert messages_prompt(body, None).messages == [
        {
            "role": "assistant",
            "reasoning": "hm",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
                }
            ],
            "content": "checking",
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},
        {"role": "user", "content": "and?"},
        {"role": "tool", "tool_call_id": "t1", "content": ""},
    ]


def test_inline_system_messages_stay_or_merge_as_the_template_requires():
    body = {
        "system": "base. ",
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "system", "content": "late"},
            {"role": "user", "content": "b"},
        ],
    }
    assert [m["content"] for m in messages_prompt(body, KEEP_SYSTEM).messages] == [
        "base. ", "a", "late", "b",
    ]  # fmt: skip
    assert [m["content"] for m in messages_prompt(body, MERGE_SYSTEM).messages] == [
        "base. late", "a", "b",
    ]  # fmt: skip
    with pytest.raises(UnsupportedPrompt):
        messages_prompt(body, None)  # no template to ask


def test_disabled_thinking_takes_the_templates_effort_and_output_config_its_own():
    hi = [{"role": "user", "content": "hi"}]
    assert (
        messages_prompt(
            {"messages": hi, "thinking": {"type": "disabled"}}, MERGE_SYSTEM
        ).reasoning_effort
        == "low"
    )
    assert (
        messages_prompt({"messages": hi, "output_config": {"effort": "max"}}, None).reasoning_effort
        == "max"
    )


def test_tools_are_functions_after_the_conversations_additions_and_removals():
    body = {
        "tools": [{"name": "a", "input_schema": {"properties": {}}},
                  {"name": "b", "input_schema": {"type": "object"}, "defer_loading": True}],
        "messages": [
            {"role": "system", "content": [
                {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "b"}},
                {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}},
                {"type": "tool_addition", "tool": {"type": "tool_definition",
                 "definition": {"name": "c", "input_schema": {"type": "object"}}}}]},
            {"role": "user", "content": "go"},
        ],
    }  # fmt: skip
    assert messages_prompt(body, KEEP_SYSTEM).tools == [
        {"type": "function", "function": {"name": "b", "description": None,
         "parameters": {"type": "object"}, "strict": None, "defer_loading": None}},
        {"type": "function", "function": {"name": "c", "description": None,
         "parameters": {"type": "object"}, "strict": None, "defer_loading": None}},
    ]  # fmt: skip
    assert messages_prompt({**body, "messages": body["messages"][1:]}, None).tools[0]["function"][
        "parameters"
    ] == {"properties": {}, "type": "object"}


def test_images_are_left_to_the_engine():
    body = {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}  # fmt: skip
    with pytest.raises(UnsupportedPrompt):
        messages_prompt(body, None)


# -- the conversation vLLM renders -------------------------------------------------


def test_templates_that_loop_over_content_get_parts_and_tool_text_joined():
    messages = [
        {"role": "user", "content": "hi", "type": "message"},
        {"role": "tool", "tool_call_id": "c", "content": [
            {"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "oops"}}]},
    ]  # fmt: skip
    assert build_conversation(messages, openai_content=True, knows_developer=True) == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "tool", "content": "a\nb", "tool_call_id": "c"},
        {"role": "assistant", "content": [],
         "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]},
    ]  # fmt: skip


def test_developer_turns_merge_with_every_system_turn_when_the_template_lacks_the_role():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "d", "tools": None},
    ]
    assert build_conversation(messages, openai_content=False, knows_developer=False) == [
        {"role": "system", "content": "s\n\nd"},
        {"role": "user", "content": "u"},
    ]


def test_the_billing_header_line_is_cut_from_system_text_only():
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: 1\nkeep"},
        {"role": "user", "content": "x-anthropic-billing-header: 1\nkeep"},
    ]
    assert [m["content"] for m in build_conversation(messages, False, True)] == [
        "keep",
        "x-anthropic-billing-header: 1\nkeep",
    ]


def test_tools_are_dumped_like_vllms_tool_params():
    tools = [{"type": "function", "defer_loading": True, "extra": 1,
              "function": {"name": "f", "strict": None, "x": 2}}]  # fmt: skip
    assert normalize_tools(tools) == [
        {"type": "function", "defer_loading": True,
         "function": {"name": "f", "description": None, "parameters": None,
                      "defer_loading": True}},
    ]  # fmt: skip


# -- what vLLM learns from the template --------------------------------------------


def test_system_first_templates_are_detected_by_vllms_probe():
    assert merges_inline_system((TEMPLATES / "system_first.jinja").read_text())
    assert not merges_inline_system((TEMPLATES / "rich.jinja").read_text())
    assert merges_inline_system(None)


@pytest.mark.parametrize(
    ("template", "facts"),
    [
        ("rich.jinja", AnthropicFacts(False, "none")),  # renders enable_thinking=false
        ("system_first.jinja", AnthropicFacts(True, "low")),  # ignores the effort
    ],
)
def test_a_local_tokenizer_probes_its_template_like_vllm(template, facts):
    local = LocalTokenizer(ensure_tokenizer(), chat_template=(TEMPLATES / template).read_text())
    assert local.anthropic_facts == facts
