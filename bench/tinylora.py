"""A random LoRA adapter for the tiny Llama of ``bench.tinymodel``, written without peft.

vLLM 0.32 loads a LoRA adapter from a directory holding ``adapter_config.json`` (PEFT's
``LoraConfig`` fields it reads: ``r``, ``lora_alpha``, ``target_modules``) and
``adapter_model.safetensors`` with one ``lora_A`` (``[r, in_features]``) and one
``lora_B`` (``[out_features, r]``) tensor per targeted module, named
``base_model.model.<module path>.lora_{A,B}.weight`` (``vllm/lora/utils.py:
parse_fine_tuned_lora_name``). The safetensors file is written by hand (an 8-byte
little-endian header length, a JSON header, raw little-endian data), so neither
torch nor peft is needed: the e2e fixtures run in the gateway's venv.
"""

from __future__ import annotations

import json
import random
import struct
from array import array
from pathlib import Path

# bench.tinymodel's LlamaConfig: hidden 256, 4 query heads and 2 KV heads of 64.
HIDDEN = 256
KV_DIM = 2 * 64
LAYERS = 2
TARGETS = {"q_proj": (HIDDEN, HIDDEN), "v_proj": (HIDDEN, KV_DIM)}  # (in, out)


def _safetensors(tensors: dict[str, tuple[list[int], array[float]]]) -> bytes:
    """Tensors (shape, float32 data) in the safetensors file format."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, data) in tensors.items():
        size = len(data) * data.itemsize
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(head)) + head + b"".join(d.tobytes() for _, d in tensors.values())


def build_lora_adapter(out_dir: Path, seed: int = 0, rank: int = 8) -> Path:
    """Write a random rank-``rank`` adapter on q_proj and v_proj of every layer."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], array[float]]] = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = array("f", (rng.gauss(0.0, 0.02) for _ in range(rank * fan_in)))
            b = array("f", (rng.gauss(0.0, 0.02) for _ in range(fan_out * rank)))
            tensors[f"{prefix}.lora_A.weight"] = ([rank, fan_in], a)
            tensors[f"{prefix}.lora_B.weight"] = ([fan_out, rank], b)
    (out_dir / "adapter_model.safetensors").write_bytes(_safetensors(tensors))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(TARGETS),
        "base_model_name_or_path": None,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
