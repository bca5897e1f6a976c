"""LocalTokenizer ids equal vLLM 0.32's own renderer (ChatCompletionRequest → renderer).

Runs vLLM's code in its own venv (``~/.cache/kvgate/vllm-venv``, see docs/vllm.md)
on the tiny model; skipped where that venv or the model's weights are missing.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.tinymodel import ensure_tokenizer
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
    if "messages" in case:
        req = ChatCompletionRequest(model="m", **case)
        _, prompts = renderer.render_chat(
            [req.messages], req.build_chat_params(None, "auto"), req.build_tok_params(mc))
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


@pytest.mark.e2e
async def test_local_ids_equal_vllm_renderer_ids():
    model_dir = ensure_tokenizer()
    if not VLLM_PYTHON.exists() or not (model_dir / "config.json").exists():
        pytest.skip("needs the vLLM venv and the tiny model's config (make test installs them)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SIDE, str(model_dir), json.dumps(CASES)],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    )  # fmt: skip
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    tok = Tokenization("tiny", "local", LocalTokenizer(model_dir))
    ours = []
    for case in CASES:
        if "messages" in case:  # the body vLLM parsed above, with its defaults
            ours.append(await tok.chat(ChatPrompt.from_body(case)))
        else:
            ours.append(
                await tok.completion(
                    case["prompt"], add_special_tokens=case.get("add_special_tokens", True)
                )
            )
    assert ours == expected
