"""The random LoRA adapter is a PEFT adapter vLLM 0.32 can load: config fields it reads,
and one lora_A [r, in] / lora_B [out, r] float32 tensor per targeted module."""

import json
import struct
from array import array

from bench.tinylora import build_lora_adapter


def read_safetensors(path):
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    return header, raw[8 + size :]


def test_the_adapter_has_vllms_tensor_names_shapes_and_config(tmp_path):
    out = build_lora_adapter(tmp_path / "a", seed=3, rank=4)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        4,
        8,
        ["q_proj", "v_proj"],
    )
    header, data = read_safetensors(out / "adapter_model.safetensors")
    meta = header.pop("__metadata__")
    assert meta == {"format": "pt"}
    shapes = {name: spec["shape"] for name, spec in header.items()}
    prefix = "base_model.model.model.layers"
    assert shapes == {
        f"{prefix}.{layer}.self_attn.{module}.{ab}.weight": shape
        for layer in range(2)
        for module, out_dim in (("q_proj", 256), ("v_proj", 128))
        for ab, shape in (("lora_A", [4, 256]), ("lora_B", [out_dim, 4]))
    }
    ends = sorted(spec["data_offsets"] for spec in header.values())
    assert ends[0][0] == 0 and ends[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))  # packed, no gaps
    first = array("f", data[: 4 * 4 * 256])
    assert any(first) and max(abs(x) for x in first) < 0.2  # small random values


def test_seeds_give_different_adapters(tmp_path):
    a = build_lora_adapter(tmp_path / "a", seed=1)
    b = build_lora_adapter(tmp_path / "b", seed=2)
    assert (a / "adapter_model.safetensors").read_bytes() != (
        b / "adapter_model.safetensors"
    ).read_bytes()
