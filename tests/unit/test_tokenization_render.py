"""Rendering straight through the compiled template gives apply_chat_template's text.

``LocalTokenizer._render_direct`` skips transformers' preparation of the messages when
it could not change them; these tests render the same prompts both ways, under every
chat template kvgate tests with, and check which prompts take the direct path.
"""

from pathlib import Path
from typing import Any

import pytest

from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization import ChatPrompt, LocalTokenizer
from kvindex.tokenization.conversation import (
    build_conversation,
    knows_developer_role,
    normalize_tools,
)
from kvindex.tokenization.local import _CONTENT_LOOP

TEMPLATES = Path(__file__).parent.parent / "data" / "chat-templates"
TEMPLATE_NAMES = ["tokenizer's own", "rich.jinja", "system_first.jinja"]

TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}

# Prompts apply_chat_template would hand to the template unchanged.
DIRECT = {
    "one user turn": ChatPrompt([{"role": "user", "content": "Hi"}]),
    "a conversation": ChatPrompt(
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "2+2? <|im_end|>"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": [{"type": "text", "text": "and"}, "3+3?"]},
        ]
    ),
    "no generation prompt": ChatPrompt(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    ),
    "tools and a tool call": ChatPrompt(
        [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ],
        tools=[TOOL],
    ),
    "a named user and template kwargs": ChatPrompt(
        [{"role": "user", "content": "Hi", "name": "ann"}],
        chat_template_kwargs={"enable_thinking": False, "mood": "calm"},
    ),
    "a reasoning effort": ChatPrompt([{"role": "user", "content": "Hi"}], reasoning_effort="high"),
}
# Prompts whose messages transformers changes, or whose text it trims or checks.
PREPARED = {
    "reasoning to alias": ChatPrompt(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo", "reasoning": "greet back"},
            {"role": "user", "content": "Bye"},
        ]
    ),
    "a continued final message": ChatPrompt(
        [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    "documents": ChatPrompt(
        [{"role": "user", "content": "Hi"}], documents=[{"title": "t", "text": "doc"}]
    ),
    "documents in the template kwargs": ChatPrompt(
        [{"role": "user", "content": "Hi"}], chat_template_kwargs={"documents": []}
    ),
}


@pytest.fixture(scope="module", params=TEMPLATE_NAMES)
def local(request) -> LocalTokenizer:
    if request.param == "tokenizer's own":
        return LocalTokenizer(ensure_tokenizer())
    return LocalTokenizer(ensure_tokenizer(), (TEMPLATES / request.param).read_text())


def _both_ways(local: LocalTokenizer, prompt: ChatPrompt) -> tuple[str | None, str]:
    """(the direct rendering or None, apply_chat_template's) of one prompt."""
    tools = normalize_tools(prompt.tools)
    template = local.template_for(tools)
    conversation = build_conversation(
        prompt.messages,
        openai_content=bool(_CONTENT_LOOP.search(template)),
        knows_developer=knows_developer_role(template),
    )
    kwargs: dict[str, Any] = prompt.template_kwargs()
    direct = local._render_direct(conversation, tools, template, kwargs)
    reference = local._tok.apply_chat_template(
        conversation, tools=tools, chat_template=template, tokenize=False, **kwargs
    )
    return direct, reference


@pytest.mark.parametrize("case", DIRECT)
def test_plain_prompts_render_directly_to_apply_chat_templates_text(local, case):
    direct, reference = _both_ways(local, DIRECT[case])
    assert direct is not None
    assert direct == reference
    assert local.render_chat(DIRECT[case]) == reference


@pytest.mark.parametrize("case", PREPARED)
def test_prompts_transformers_prepares_take_apply_chat_template(local, case):
    direct, reference = _both_ways(local, PREPARED[case])
    assert direct is None
    assert local.render_chat(PREPARED[case]) == reference


def test_a_developer_message_without_tools_takes_apply_chat_template():
    """A template that names the developer role gets the message with ``tools: None``,
    a key transformers drops before rendering."""
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tools is defined %}(tools: {{ m.tools }}){% endif %};{% endfor %}"
        "{# 'developer' #}"
    )
    local = LocalTokenizer(ensure_tokenizer(), template)
    prompt = ChatPrompt([{"role": "developer", "content": "Rules."}])
    direct, reference = _both_ways(local, prompt)
    assert direct is None
    assert local.render_chat(prompt) == reference == "developer:Rules.;"


def test_the_direct_path_does_not_change_the_callers_messages():
    local = LocalTokenizer(ensure_tokenizer(), (TEMPLATES / "rich.jinja").read_text())
    prompt = DIRECT["tools and a tool call"]
    before = repr(prompt.messages), repr(prompt.tools)
    local.render_chat(prompt)
    assert (repr(prompt.messages), repr(prompt.tools)) == before
