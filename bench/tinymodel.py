"""A tiny Llama-shaped model with its own tokenizer, built offline.

No model can be downloaded on the machines kvgate is tested on, so the real-vLLM
end-to-end tests and the simulated pods share a model made here: a byte-level BPE
trained on the licence texts Debian ships, a ChatML chat template, and (for vLLM
only) random bf16 weights. Output is gibberish; tokenization, the KV cache, prefix
caching, events and token accounting are all real.

The tokenizer part needs only ``tokenizers``/``transformers``; the weights part
needs ``torch`` and is run with the vLLM venv's Python:

    python bench/tinymodel.py --weights DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MODEL_NAME = "kvgate-tiny-llama"

# ChatML, the template most open chat models (Qwen, many fine-tunes) use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS_DIRS = (Path("/usr/share/common-licenses"),)


def default_dir() -> Path:
    root = Path(os.environ.get("KVGATE_CACHE_DIR", Path.home() / ".cache" / "kvgate"))
    return root / MODEL_NAME


def _corpus() -> list[str]:
    texts: list[str] = []
    for d in _CORPUS_DIRS:
        if d.is_dir():
            for f in sorted(d.iterdir()):
                if f.is_file():
                    texts.append(f.read_text(errors="ignore"))
    # A fallback so the build never depends on one distribution's files.
    texts.append(_FALLBACK_TEXT * 20)
    return texts


def build_tokenizer(out_dir: Path) -> Path:
    """Train and save the tokenizer (idempotent: a complete dir is reused)."""
    out_dir = Path(out_dir)
    if all((out_dir / f).exists() for f in TOKENIZER_FILES):
        return out_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(tmp))
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        os.replace(f, out_dir / f.name)
    tmp.rmdir()
    return out_dir


def build_weights(out_dir: Path) -> Path:
    """Save random bf16 Llama weights + config beside the tokenizer (needs torch)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and any(out_dir.glob("*.safetensors")):
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # head dim 64
        max_position_embeddings=8192,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def ensure_tokenizer(path: Path | None = None) -> Path:
    return build_tokenizer(Path(path) if path else default_dir())


_FALLBACK_TEXT = (
    "The quick brown fox jumps over the lazy dog. A cache keeps what was computed so "
    "that it need not be computed again. Requests that share a prefix share work. "
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", nargs="?", type=Path, default=None)
    p.add_argument("--weights", action="store_true", help="also write random weights")
    args = p.parse_args(argv)
    out = args.dir or default_dir()
    build_tokenizer(out)
    if args.weights:
        build_weights(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
