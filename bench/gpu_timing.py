"""Measure the GPU timing a simulated pod plays back, on a real GPU.

The simulated pods and the DES replay ``bench.podmodel``'s cost model: a prefill
costs ``alpha + uncached tokens / rate`` whatever the cached prefix is, a KV block
loaded from host DRAM (L1) or a shared filesystem (L2) costs ``latency + bytes /
bandwidth``, and a decode step ``itl_base + itl_per_seq x running``. The GPU
profiles in ``bench.profiles`` were derived from datasheets. This script measures
those numbers on whatever CUDA GPU it runs on, for a Llama-3.1-8B-shaped model:

- prefill of ``n`` uncached tokens (a least-squares line through the compute-bound
  ones gives the rate);
- prefill of 512 new tokens behind ``c`` cached ones, through the whole model and as
  one layer's attention alone (flash and masked SDPA): what each cached token adds;
- two prompts prefilled in one forward against one of each length;
- decode steps at several batch sizes, in transformers (eager) and written out over
  the same weights and replayed as a CUDA graph, as vLLM runs decode;
- device memory bandwidth (a decode step's floor is the weights over it);
- host DRAM to GPU: pinned copies laid out as a KV offloader stores them (one copy
  per layer and K/V), fitted to latency + bytes / bandwidth;
- a file on the machine's own disk read into pinned memory and copied up: a local
  NVMe, not the shared filesystem of a real L2, so only a floor for it.

The weights are random: time does not depend on their values. The model runs in
Hugging Face transformers (eager, SDPA attention), not vLLM, which no lease machine
has: its prefill matmuls are the same work, but its fixed cost per forward (Python
launches, no CUDA graphs) is far higher than vLLM's, so the short prefills and the
eager decode step measure the host CPU; the graphed decode step does not.

Run it where torch sees a GPU::

    python3 -m bench.gpu_timing --out DIR     # ~2 minutes on an H200

It needs only torch and transformers (and rich, for the progress bar, if there),
so it runs on a machine without kvgate's own dependencies. ``--tiny`` runs a
two-layer model on the CPU to check the script itself.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Llama-3.1-8B (its config.json on the Hub).
LLAMA31_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}
TINY = {
    **LLAMA31_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}

PREFILL_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)
LINE_TOKENS = (1024, 4096)  # the prefill line's range (--tiny: all it measured)
CACHED_CONTEXTS = (0, 1024, 4096, 8192)
NEW_TOKENS_BEHIND_CACHE = 512
BATCHED_PREFILL_TOKENS = 2048
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXT = 1024
COPY_TOKENS = (16, 64, 256, 1024, 4096)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = intercept + slope * x``; returns (intercept, slope)."""
    slope, intercept = statistics.linear_regression([x for x, _ in points],
                                                    [y for _, y in points])  # fmt: skip
    return intercept, slope


def worst_relative_residual(
    points: Sequence[tuple[float, float]], intercept: float, slope: float
) -> float:
    """The largest |fit - measured| / measured over the points."""
    return max(abs(intercept + slope * x - y) / y for x, y in points)


class _Progress:
    """A rich progress bar when rich is installed, else one line per step."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._done = 0
        try:
            from rich.progress import Progress

            self._bar: Any = Progress()
            self._task = self._bar.add_task("measuring", total=total)
            self._bar.start()
        except ImportError:
            self._bar = None

    def step(self, what: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=what)
        else:
            print(f"[{self._done}/{self._total}] {what}", flush=True)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class _Timer:
    """Times a callable on the device: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, torch: Any, device: str) -> None:
        self._torch = torch
        self._cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self._cuda:
            self._torch.cuda.synchronize()

    def once(self, run: Callable[[], object]) -> float:
        if self._cuda:
            start = self._torch.cuda.Event(enable_timing=True)
            end = self._torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        began = time.perf_counter()
        run()
        return time.perf_counter() - began

    def median(
        self,
        run: Callable[[], object],
        warmup: int,
        reps: int,
        setup: Callable[[], object] | None = None,
    ) -> float:
        """Median seconds of ``reps`` runs after ``warmup``; ``setup`` runs untimed first."""
        times = []
        for i in range(warmup + reps):
            if setup is not None:
                setup()
            self.sync()
            elapsed = self.once(run)
            if i >= warmup:
                times.append(elapsed)
        return statistics.median(times)


@dataclass(frozen=True)
class Bench:
    """What every measurement needs: torch, the device, how to time and report, and
    how many timed runs make a median."""

    torch: Any
    device: str
    timer: _Timer
    progress: _Progress
    reps: int

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def dtype(self) -> Any:
        """bf16 on a GPU, as served; fp32 on a CPU, where the check runs."""
        return self.torch.bfloat16 if self.cuda else self.torch.float32


def _build_model(b: Bench, shape: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch = b.torch
    config = LlamaConfig(**shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(b.dtype)
    try:
        with torch.device(b.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _forward(model: Any, ids: Any, **kwargs: Any) -> Any:
    # Only the last position's logits, as an engine computes for a prefill: the LM head
    # over every position would add a 128k-wide matmul per token that vLLM never does.
    return model(input_ids=ids, logits_to_keep=1, **kwargs)


def measure_prefill(b: Bench, model: Any, tokens: Sequence[int]) -> list[dict[str, float]]:
    torch, timer, device, progress, reps = b.torch, b.timer, b.device, b.progress, b.reps
    vocab = model.config.vocab_size
    rows = []
    for n in tokens:
        ids = torch.randint(0, vocab, (1, n), device=device)
        seconds = timer.median(lambda ids=ids: _forward(model, ids, use_cache=False), 2, reps)
        rows.append({"tokens": n, "seconds": seconds})
        progress.step(f"prefill {n} tokens: {seconds * 1000:.1f} ms")
    return rows


def measure_behind_cache(
    b: Bench, model: Any, contexts: Sequence[int], new_tokens: int
) -> list[dict[str, float]]:
    torch, timer, device, progress, reps = b.torch, b.timer, b.device, b.progress, b.reps
    vocab = model.config.vocab_size
    rows = []
    new_ids = torch.randint(0, vocab, (1, new_tokens), device=device)
    for cached in contexts:
        if cached == 0:
            seconds = timer.median(lambda: _forward(model, new_ids, use_cache=False), 2, reps)
        else:
            prefix = torch.randint(0, vocab, (1, cached), device=device)
            base = _forward(model, prefix, use_cache=True).past_key_values
            seconds = _median_behind(timer, model, new_ids, base, reps)
            del base
        rows.append({"cached_tokens": cached, "new_tokens": new_tokens, "seconds": seconds})
        progress.step(f"{new_tokens} new behind {cached} cached: {seconds * 1000:.1f} ms")
    return rows


def _median_behind(timer: _Timer, model: Any, new_ids: Any, base: Any, reps: int) -> float:
    """Median prefill of ``new_ids`` behind a fresh copy of the cache ``base`` each time."""
    cache: list[Any] = [None]

    def fresh() -> None:
        cache[0] = copy.deepcopy(base)  # each forward appends to the cache it is given

    def prefill() -> None:
        _forward(model, new_ids, past_key_values=cache[0], use_cache=True)

    return timer.median(prefill, 2, reps, setup=fresh)


def measure_attention_behind_cache(
    b: Bench, shape: dict[str, Any], contexts: Sequence[int], new_tokens: int
) -> list[dict[str, Any]]:
    """One layer's attention of ``new_tokens`` queries over ``cached + new`` keys, by kernel.

    ``flash`` is the flash kernel with the causal mask aligned bottom-right (what vLLM's
    flash attention computes for a prefill behind a cached prefix); ``masked`` is SDPA
    with the mask materialised, the path transformers takes behind a cache. A kernel
    this machine lacks (flash on a CPU) is recorded as None.
    """
    torch, timer, device, progress, reps = b.torch, b.timer, b.device, b.progress, b.reps
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    heads = shape["num_attention_heads"]
    head_dim = shape["hidden_size"] // heads
    dtype = b.dtype
    rows: list[dict[str, Any]] = []
    for cached in contexts:
        total = cached + new_tokens
        q = torch.randn(1, heads, new_tokens, head_dim, device=device, dtype=dtype)
        k = torch.randn(1, heads, total, head_dim, device=device, dtype=dtype)
        v = torch.randn(1, heads, total, head_dim, device=device, dtype=dtype)
        bias = causal_lower_right(new_tokens, total)
        # The same mask as a tensor: new token i sees every cached key and new keys <= i.
        mask = torch.ones(new_tokens, total, dtype=torch.bool, device=device).tril(cached)
        runs: dict[str, Callable[[], object]] = {
            "flash": lambda q=q, k=k, v=v, bias=bias: sdpa(q, k, v, attn_mask=bias),
            "masked": lambda q=q, k=k, v=v, mask=mask: sdpa(q, k, v, attn_mask=mask),
        }
        for kernel, attend in runs.items():
            backend = SDPBackend.FLASH_ATTENTION if kernel == "flash" else None
            try:
                if backend is None:
                    seconds: float | None = timer.median(attend, 2, reps)
                else:
                    with sdpa_kernel(backend):
                        seconds = timer.median(attend, 2, reps)
            except RuntimeError:  # no such kernel here
                seconds = None
            rows.append({"cached_tokens": cached, "new_tokens": new_tokens,
                         "kernel": kernel, "seconds_per_layer": seconds})  # fmt: skip
        progress.step(f"attention behind {cached} cached")
    return rows


def measure_batched_prefill(b: Bench, model: Any, tokens: int) -> list[dict[str, float]]:
    """Two prompts of ``tokens`` prefilled in one forward, against one of each length.

    An engine puts prefills that arrive together into one step: whether that step costs
    what the tokens cost one after another is what the simulator's prefill lane assumes.
    """
    torch, timer, device, progress, reps = b.torch, b.timer, b.device, b.progress, b.reps
    vocab = model.config.vocab_size
    rows = []
    for batch, length in ((1, tokens), (2, tokens), (1, 2 * tokens)):
        ids = torch.randint(0, vocab, (batch, length), device=device)
        seconds = timer.median(lambda ids=ids: _forward(model, ids, use_cache=False), 2, reps)
        rows.append({"batch": batch, "tokens": length, "seconds": seconds})
        progress.step(f"prefill {batch} x {length} tokens: {seconds * 1e3:.1f} ms")
    return rows


def measure_graphed_decode(
    b: Bench, model: Any, batches: Sequence[int], context: int, steps: int
) -> list[dict[str, Any]]:
    """One decode step of the model's own weights, written out and replayed as a CUDA
    graph (as vLLM runs decode), per batch size, each sequence ``context`` tokens deep.

    Per layer: RMS norm, Q/K/V projections, the new K/V written into a static cache,
    SDPA over it (grouped KV heads), the output projection, RMS norm and the gated MLP;
    then the final norm, the LM head and the greedy token. Rotary embeddings are left
    out (elementwise, a few microseconds). On a CPU the step runs eagerly."""
    torch, timer, device, progress = b.torch, b.timer, b.device, b.progress
    from torch.nn.functional import rms_norm, scaled_dot_product_attention, silu

    inner = model.model
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    eps = config.rms_norm_eps
    dtype = inner.embed_tokens.weight.dtype
    cuda = b.cuda
    rows: list[dict[str, Any]] = []
    for batch in batches:
        shape = (batch, kv_heads, context + 1, head_dim)
        caches = [(torch.randn(shape, device=device, dtype=dtype),
                   torch.randn(shape, device=device, dtype=dtype))
                  for _ in inner.layers]  # fmt: skip
        ids = torch.randint(0, config.vocab_size, (batch,), device=device)

        def step(ids: Any = ids, caches: list[Any] = caches, batch: int = batch) -> Any:
            h = inner.embed_tokens.weight[ids]
            for layer, (k_cache, v_cache) in zip(inner.layers, caches, strict=True):
                attn, mlp = layer.self_attn, layer.mlp
                x = rms_norm(h, (h.shape[-1],), layer.input_layernorm.weight, eps)
                q = (x @ attn.q_proj.weight.T).view(batch, heads, 1, head_dim)
                k_cache[:, :, context] = (x @ attn.k_proj.weight.T).view(batch, kv_heads, head_dim)
                v_cache[:, :, context] = (x @ attn.v_proj.weight.T).view(batch, kv_heads, head_dim)
                a = scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
                h = h + a.reshape(batch, heads * head_dim) @ attn.o_proj.weight.T
                x = rms_norm(h, (h.shape[-1],), layer.post_attention_layernorm.weight, eps)
                gated = silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)
                h = h + gated @ mlp.down_proj.weight.T
            h = rms_norm(h, (h.shape[-1],), inner.norm.weight, eps)
            return (h @ model.lm_head.weight.T).argmax(-1)

        run: Callable[[], object] = step
        if cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm up outside the capture, as capture requires
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        seconds = timer.median(run, 3, steps)
        rows.append({"batch": batch, "context": context, "seconds": seconds, "graphed": cuda})
        progress.step(f"decode step, batch {batch}, replayed: {seconds * 1e3:.2f} ms")
        del caches, run
    return rows


def measure_decode(
    b: Bench, model: Any, batches: Sequence[int], context: int, steps: int
) -> list[dict[str, float]]:
    torch, timer, device, progress = b.torch, b.timer, b.device, b.progress
    vocab = model.config.vocab_size
    rows = []
    for batch in batches:
        prompt = torch.randint(0, vocab, (batch, context), device=device)
        cache = _forward(model, prompt, use_cache=True).past_key_values
        step_ids = torch.randint(0, vocab, (batch, 1), device=device)
        seconds = timer.median(
            lambda cache=cache, step_ids=step_ids: _forward(
                model, step_ids, past_key_values=cache, use_cache=True
            ),
            3,
            steps,
        )
        del cache
        rows.append({"batch": batch, "context": context, "seconds": seconds})
        progress.step(f"decode step, batch {batch}: {seconds * 1000:.2f} ms")
    return rows


def measure_device_bandwidth(b: Bench, gib: float) -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    torch, timer, device = b.torch, b.timer, b.device
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = timer.median(lambda: dst.copy_(src), 3, 10)
    return 2 * n * 2 / seconds


def _kv_layout(shape: dict[str, Any]) -> tuple[int, int]:
    """(copies per load, bytes per token per copy): one copy per layer for K and for V."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = shape["num_key_value_heads"] * head_dim * 2  # bf16
    return 2 * shape["num_hidden_layers"], per_token


def measure_host_to_gpu(
    b: Bench, shape: dict[str, Any], tokens: Sequence[int]
) -> list[dict[str, float]]:
    """Load ``n`` tokens' KV from pinned host memory as an offloader does: per layer."""
    torch, timer, device, progress = b.torch, b.timer, b.device, b.progress
    copies, per_token = _kv_layout(shape)
    pinned = b.cuda
    rows = []
    for n in tokens:
        host = [
            torch.empty(n * per_token, dtype=torch.uint8, pin_memory=pinned) for _ in range(copies)
        ]
        gpu = [torch.empty(n * per_token, dtype=torch.uint8, device=device) for _ in range(copies)]

        def load(host: list[Any] = host, gpu: list[Any] = gpu) -> None:
            for h, g in zip(host, gpu, strict=True):
                g.copy_(h, non_blocking=True)

        seconds = timer.median(load, 3, 20)
        rows.append({"tokens": n, "bytes": n * per_token * copies, "seconds": seconds})
        progress.step(f"host to GPU, {n} tokens: {seconds * 1000:.2f} ms")
        del host, gpu
    return rows


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measure_file_to_gpu(
    b: Bench, shape: dict[str, Any], tokens: Sequence[int], directory: Path, drop_page_cache: bool
) -> tuple[list[dict[str, float]], bool]:
    """Read ``n`` tokens' KV from one file on local disk, then copy it up.

    One file per load, as LMCache's fs:// backend keeps one file per chunk. Each
    timed read is of a file not read before. With ``drop_page_cache`` the page cache
    is dropped first where the machine allows it (returned), so the numbers are the
    disk's, not DRAM's; that slows every other program on the machine for a while.
    """
    torch, timer, device, progress = b.torch, b.timer, b.device, b.progress
    copies, per_token = _kv_layout(shape)
    pinned = b.cuda
    reps = 5
    dropped = drop_page_cache
    rows = []
    for n in tokens:
        size = n * per_token * copies
        paths = []
        for r in range(reps + 1):
            path = directory / f"kv-{n}-{r}.bin"
            path.write_bytes(os.urandom(size))
            paths.append(path)
        dropped = dropped and _drop_page_cache()
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        gpu = torch.empty(size, dtype=torch.uint8, device=device)
        times = []
        for path in paths:
            began = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                f.readinto(memoryview(buffer.numpy()))
            gpu.copy_(buffer, non_blocking=True)
            timer.sync()
            times.append(time.perf_counter() - began)
            path.unlink()
        seconds = statistics.median(times[1:])  # the first pays the directory's lookup
        rows.append({"tokens": n, "bytes": size, "seconds": seconds})
        progress.step(f"local file to GPU, {n} tokens: {seconds * 1000:.2f} ms")
        del buffer, gpu
    return rows, dropped


def _fit_summary(rows: list[dict[str, float]], x: str) -> dict[str, float]:
    points = [(float(r[x]), r["seconds"]) for r in rows]
    intercept, slope = fit_line(points)
    return {
        "intercept_s": intercept,
        "slope_s": slope,
        "worst_relative_residual": worst_relative_residual(points, intercept, slope),
    }


def run(device: str, shape: dict[str, Any], scratch: Path, reps: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    tiny = shape is TINY
    prefill_tokens = PREFILL_TOKENS[:3] if tiny else PREFILL_TOKENS
    contexts = CACHED_CONTEXTS[:2] if tiny else CACHED_CONTEXTS
    batches = DECODE_BATCHES[:2] if tiny else DECODE_BATCHES
    copy_tokens = COPY_TOKENS[:3] if tiny else COPY_TOKENS
    batched_tokens = 128 if tiny else BATCHED_PREFILL_TOKENS
    context = 128 if tiny else DECODE_CONTEXT
    steps = (prefill_tokens, contexts, contexts, batches, batches, copy_tokens, copy_tokens)
    total = sum(len(s) for s in steps) + 3 + 2  # + batched prefills, + copy and model
    progress = _Progress(total)
    b = Bench(torch, device, _Timer(torch, device), progress, reps)
    result: dict[str, Any] = {"device": device, "shape": shape, "torch": torch.__version__}
    try:
        if b.cuda:
            result["gpu"] = torch.cuda.get_device_name(0)
        bandwidth = measure_device_bandwidth(b, 0.25 if tiny else 4.0)
        result["device_bandwidth_bytes_per_s"] = bandwidth
        progress.step(f"device copy: {bandwidth / 1e12:.2f} TB/s")
        began = time.perf_counter()
        model = _build_model(b, shape)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        result["weight_bytes"] = weight_bytes
        result["decode_floor_s"] = weight_bytes / bandwidth
        progress.step(f"model built in {time.perf_counter() - began:.1f} s")
        with torch.inference_mode():
            prefill = measure_prefill(b, model, prefill_tokens)
            behind = measure_behind_cache(b, model, contexts, NEW_TOKENS_BEHIND_CACHE)
            batched = measure_batched_prefill(b, model, batched_tokens)
            decode = measure_decode(b, model, batches, context, 4 * reps)
            graphed = measure_graphed_decode(b, model, batches, context, 4 * reps)
        del model
        if b.cuda:
            torch.cuda.empty_cache()
        attention = measure_attention_behind_cache(b, shape, contexts, NEW_TOKENS_BEHIND_CACHE)
        host = measure_host_to_gpu(b, shape, copy_tokens)
        with tempfile.TemporaryDirectory(dir=scratch) as directory:
            files, dropped = measure_file_to_gpu(
                b, shape, copy_tokens, Path(directory), drop_page_cache=not tiny
            )
    finally:
        progress.stop()
    # The line through the compute-bound prefills, 1k-4k tokens. Below 1k an eager
    # forward is bound by the host CPU's kernel launches (two H200 runs: 18 and 32 ms at
    # 128 tokens), which says nothing of the GPU; past 4k attention's quadratic term
    # bends the curve up, and the 8k point shows how far.
    linear = [r for r in prefill if tiny or LINE_TOKENS[0] <= r["tokens"] <= LINE_TOKENS[1]]
    result.update(
        {
            "prefill": prefill,
            "prefill_fit": {
                **_fit_summary(linear, "tokens"),
                "tokens": [linear[0]["tokens"], linear[-1]["tokens"]],
            },
            "behind_cache": behind,
            "attention_behind_cache": attention,
            "batched_prefill": batched,
            "decode": decode,
            "decode_fit": _fit_summary(decode, "batch"),
            "graphed_decode": graphed,
            "graphed_decode_fit": _fit_summary(graphed, "batch"),
            "host_to_gpu": host,
            "host_to_gpu_fit": _fit_summary(host, "bytes"),
            "file_to_gpu": files,
            "file_to_gpu_fit": _fit_summary(files, "bytes"),
            "page_cache_dropped": dropped,
        }
    )
    return result


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The measured numbers in the cost model's terms."""
    p = result["prefill_fit"]
    h, f = result["host_to_gpu_fit"], result["file_to_gpu_fit"]
    lines = [
        f"{result.get('gpu', result['device'])}, torch {result['torch']}",
        f"device copy {result['device_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; weights "
        f"{result['weight_bytes'] / 1e9:.1f} GB -> decode floor "
        f"{result['decode_floor_s'] * 1e3:.2f} ms",
        f"prefill: alpha {p['intercept_s'] * 1e3:.1f} ms, {1 / p['slope_s']:,.0f} tokens/s "
        f"(line through {p['tokens'][0]}-{p['tokens'][1]} tokens, worst residual "
        f"{p['worst_relative_residual']:.1%}); the shortest prefill, "
        f"{result['prefill'][0]['seconds'] * 1e3:.1f} ms, bounds the fixed cost from above",
    ]
    for r in result["prefill"]:
        line = p["intercept_s"] + p["slope_s"] * r["tokens"]
        measured = r["seconds"] * 1e3
        lines.append(f"  {r['tokens']:>6} tokens {measured:8.1f} ms (line {line * 1e3:.1f})")
    for r in result["behind_cache"]:
        lines.append(
            f"  {r['new_tokens']} new behind {r['cached_tokens']:>5} cached "
            f"{r['seconds'] * 1e3:8.1f} ms"
        )
    layers = result["shape"]["num_hidden_layers"]
    for r in result.get("attention_behind_cache", []):
        per_layer = r["seconds_per_layer"]
        took = "no such kernel here" if per_layer is None else f"{per_layer * layers * 1e3:.2f} ms"
        lines.append(
            f"  attention alone, {r['kernel']:>6}, {r['new_tokens']} new behind "
            f"{r['cached_tokens']:>5} cached, x {layers} layers: {took}"
        )
    batched = {(r["batch"], r["tokens"]): r["seconds"] for r in result.get("batched_prefill", [])}
    if batched:
        n = min(t for _, t in batched)
        lines.append(
            f"prefill in one forward: 1 x {n} tokens {batched[1, n] * 1e3:.1f} ms, 2 x {n} "
            f"{batched[2, n] * 1e3:.1f} ms, 1 x {2 * n} {batched[1, 2 * n] * 1e3:.1f} ms"
        )
    steps = ", ".join(f"{r['batch']}: {r['seconds'] * 1e3:.1f} ms" for r in result["decode"])
    lines.append(
        f"decode step in transformers, by batch ({result['decode'][0]['context']}-token "
        f"context): {steps} (eager Python launches, not vLLM's step)"
    )
    if "graphed_decode" in result:
        g = result["graphed_decode"]
        fit = result["graphed_decode_fit"]
        how = "replayed as a CUDA graph" if g[0]["graphed"] else "eager (no GPU)"
        lines.append(
            f"decode step, {how} ({g[0]['context']}-token context): "
            + ", ".join(f"{r['batch']}: {r['seconds'] * 1e3:.2f} ms" for r in g)
            + f"; line {fit['intercept_s'] * 1e3:.2f} ms + {fit['slope_s'] * 1e6:.1f} us "
            f"per sequence"
        )
    for name, key, fit in (
        ("host DRAM (pinned) -> GPU", "host_to_gpu", h),
        ("local file -> GPU", "file_to_gpu", f),
    ):
        lines.append(
            f"{name}: latency {fit['intercept_s'] * 1e3:.2f} ms, "
            f"{1 / fit['slope_s'] / 1e9:.1f} GB/s (worst residual "
            f"{fit['worst_relative_residual']:.1%})"
        )
        points = ", ".join(f"{r['tokens']}: {r['seconds'] * 1e3:.2f} ms" for r in result[key])
        lines.append(f"  by tokens: {points}")
    if not result["page_cache_dropped"]:
        lines.append("  (the page cache was not dropped: the file reads may be DRAM's)")
    return lines


def plot_result(result: dict[str, Any], path: Path) -> None:
    """Two panels: what it takes to have ``n`` tokens' KV on the GPU (recompute, load
    from host DRAM, load from a local file), and what a cached prefix adds to a prefill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tiers, behind) = plt.subplots(1, 2, figsize=(12, 4.5))
    fit = result["prefill_fit"]
    measured = [(r["tokens"], r["seconds"] * 1e3) for r in result["prefill"]]
    tiers.plot(*zip(*measured, strict=True), "o-", label="prefill (recompute)")
    span = [measured[0][0], measured[-1][0]]
    line = [(fit["intercept_s"] + fit["slope_s"] * n) * 1e3 for n in span]
    tiers.plot(span, line, ":", color="grey",
               label=f"line through {fit['tokens'][0]}-{fit['tokens'][1]} tokens")  # fmt: skip
    for key, label in (("host_to_gpu", "load from host DRAM (L1)"),
                       ("file_to_gpu", "load from a local file")):  # fmt: skip
        points = [(r["tokens"], r["seconds"] * 1e3) for r in result[key]]
        tiers.plot(*zip(*points, strict=True), "s-", label=label)
    tiers.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms",
              title=f"{result.get('gpu', result['device'])}: n tokens' KV on the GPU")  # fmt: skip
    tiers.legend()
    rows = result["behind_cache"]
    cached = [r["cached_tokens"] for r in rows]
    behind.plot(cached, [r["seconds"] * 1e3 for r in rows], "o-", label="whole model")
    layers = result["shape"]["num_hidden_layers"]
    for kernel in ("flash", "masked"):
        timed = [(r["cached_tokens"], r["seconds_per_layer"] * layers * 1e3)
                 for r in result.get("attention_behind_cache", [])
                 if r["kernel"] == kernel and r["seconds_per_layer"] is not None]  # fmt: skip
        if timed:
            behind.plot(*zip(*timed, strict=True), "s--", label=f"attention alone, {kernel}")
    behind.set(xlabel="cached tokens before them", ylabel="ms", ylim=(0, None),
               title=f"prefill of {rows[0]['new_tokens']} new tokens")  # fmt: skip
    behind.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: dict[str, Any], out: Path) -> list[str]:
    """The summary and the plot beside a run's JSON; returns the summary's lines.

    Without matplotlib (a GPU machine's image may lack it) the plot is left out and
    the lines say so: ``--report JSON`` draws it later wherever matplotlib is.
    """
    lines = summary_lines(result)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    try:
        plot_result(result, out / "gpu_timing.png")
    except ImportError:
        return [*lines, "(no plot: matplotlib is not installed; --report JSON draws it)"]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports/gpu-timing"))
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a two-layer model on the CPU: checks the script, measures nothing",
    )
    parser.add_argument("--reps", type=int, default=10, help="timed runs per point (median)")
    parser.add_argument(
        "--scratch",
        type=Path,
        default=Path("/var/tmp"),
        help="where the file reads' KV files go: a disk, not a tmpfs",
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="measure nothing: write the summary and plot of a recorded run beside it",
    )
    args = parser.parse_args(argv)
    if args.report is not None:
        lines = write_report(json.loads(args.report.read_text()), args.report.parent)
        print("\n".join(lines))
        return 0
    import torch

    if args.tiny:
        device, shape = "cpu", TINY
    elif torch.cuda.is_available():
        device, shape = "cuda", LLAMA31_8B
    else:
        parser.error("no GPU is visible to torch; --tiny checks the script on the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(device, shape, args.scratch, args.reps)
    (args.out / "gpu_timing.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(write_report(result, args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
