"""LocalTokenizer ids equal vLLM 0.32's own renderer (ChatCompletionRequest → renderer).

Runs vLLM's code in its own venv (``~/.cache/kvgate/vllm-venv``, see docs/vllm.md)
on the tiny model; skipped where that venv or the model's weights are missing.
Cases run in order through one ``Tokenization``, so later ones take ids from the
segments earlier ones cached (a conversation growing turn by turn, one document
under different questions): the cached ids must be vLLM's too, under the tiny
model's ChatML template and the test template that reads ``documents``.
"""

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.prompts import text_of_tokens
from bench.tinymodel import ensure_tokenizer
from bench.workloads import RAG_SYSTEM
from kvindex.tokenization import ChatPrompt, LocalTokenizer, Tokenization

VLLM_PYTHON = Path(
    os.environ.get("KVGATE_VLLM_PYTHON", Path.home() / ".cache/kvgate/vllm-venv/bin/python")
)

VLLM_SIDE = """
import json, sys
from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.renderers.registry import renderer_from_config
path, cases = sys.argv[1], json.loads(sys.argv[2])
mc = ModelConfig(model=path, tokenizer=path, max_model_len=4096)
renderer = renderer_from_config(VllmConfig(model_config=mc))
out = []
for case in cases:
    template = case.pop("_template", None)
    if "messages" in case:
        req = ChatCompletionRequest(model="m", **case)
        _, prompts = renderer.render_chat(
            [req.messages], req.build_chat_params(template, "auto"), req.build_tok_params(mc))
    else:
        req = CompletionRequest(model="m", **case)
        prompts = renderer.render_cmpl([{"prompt": req.prompt}], req.build_tok_params(mc))
    out.append(prompts[0]["prompt_token_ids"])
print(json.dumps(out))
"""

CASES = [
    {"messages": [{"role": "user", "content": "Hello there, how are you?"}]},
    {
        "messages": [
            {"role": "system", "content": "Terse."},
            {"role": "user", "content": "2+2 <|im_end|>"},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Write"},
            {"role": "assistant", "content": "Once"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {"messages": [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Go"}]},
    {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True},
    {"prompt": "The quick brown fox jumps over the lazy dog."},
    {"prompt": "no specials", "add_special_tokens": False},
]


DOC_TEMPLATE = (  # the template tests/unit/test_tokenization.py feeds documents to
    "{% for d in documents %}[{{ d['text'] }}]{% endfor %}{{ mood }}|"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def _conversation() -> list[dict[str, Any]]:
    """Three turns of one conversation, each request the previous one extended."""
    turns = [
        "Summarise the cache design in one line. " * 40,
        "Now list its bounds: <|im_end|> is text here, and so is <|im_start|>.",
        "Unicode too: naïve café — 字符 😀 e\u0301, and an empty reply follows.",
    ]
    history: list[dict[str, Any]] = [{"role": "system", "content": "Terse."}]
    cases = []
    for i, turn in enumerate(turns):
        history = [*history, {"role": "user", "content": turn}]
        cases.append({"messages": list(history)})
        history.append({"role": "assistant", "content": "" if i == 1 else f"Answer {i}."})
    return cases


def _rag(doc: str) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "system", "content": RAG_SYSTEM},
                {"role": "user", "content": f"{doc}\n\nQuestion: {question}"},
            ]
        }
        for question in ("what is cached?", "who evicts it?", "why <|endoftext|> here?")
    ]


def _cached_cases(doc: str) -> list[dict[str, Any]]:
    return [
        *_conversation(),
        *_rag(doc),
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]},
        {"prompt": f"{doc} and a completion", "add_special_tokens": True},
        {"prompt": f"{doc} and another", "add_special_tokens": False},
        {
            "_template": DOC_TEMPLATE,
            "messages": [{"role": "user", "content": "Hi"}],
            "documents": [{"text": doc[:2000]}, {"text": "two"}],
            "chat_template_kwargs": {"mood": "calm"},
        },
        {
            "_template": DOC_TEMPLATE,
            "messages": [{"role": "user", "content": "Bye"}],
            "documents": [{"text": doc[:2000]}],
            "chat_template_kwargs": {"mood": "calm"},
        },
    ]


def _vllm_ids(model_dir: Path, cases: list[dict[str, Any]]) -> list[list[int]]:
    if not VLLM_PYTHON.exists() or not (model_dir / "config.json").exists():
        pytest.skip("needs the vLLM venv and the tiny model's config (make test installs them)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SIDE, str(model_dir), json.dumps(cases)],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _our_ids(toks: dict[str | None, Tokenization], cases: list[dict[str, Any]]) -> list:
    ours = []
    for case in cases:
        tok = toks[case.get("_template")]
        if "messages" in case:  # the body vLLM parsed, with its defaults
            ours.append(list(await tok.chat(ChatPrompt.from_body(case))))
        else:
            special = case.get("add_special_tokens", True)
            ours.append(list(await tok.completion(case["prompt"], add_special_tokens=special)))
    return ours


@pytest.mark.e2e
async def test_local_ids_equal_vllm_renderer_ids():
    model_dir = ensure_tokenizer()
    expected = _vllm_ids(model_dir, CASES)
    tok = Tokenization("tiny", "local", LocalTokenizer(model_dir))
    assert await _our_ids({None: tok}, CASES) == expected


@pytest.mark.e2e
async def test_ids_from_cached_segments_equal_vllm_renderer_ids():
    model_dir = ensure_tokenizer()
    doc = text_of_tokens(1500, seed="vllm-doc", tokenizer_dir=model_dir)  # ~4k characters
    cases = _cached_cases(doc)
    expected = _vllm_ids(model_dir, [dict(c) for c in cases])
    toks = {
        None: Tokenization("tiny", "local", LocalTokenizer(model_dir)),
        DOC_TEMPLATE: Tokenization("tiny", "local", LocalTokenizer(model_dir, DOC_TEMPLATE)),
    }
    assert toks[None].incremental is not None

    assert await _our_ids(toks, cases) == expected
    stats = toks[None].stats
    total_chars = sum(len(json.dumps(c)) for c in cases)
    assert stats.reused_tokens > 3 * 1500  # the document's chunks, under every question
    assert stats.prefix_tokens > 0  # a conversation's next turn, after its known prefix
    assert stats.encoded_chars < total_chars / 2
