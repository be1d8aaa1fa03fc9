"""Suite ``precision``: float32 against bfloat16 and float16 on this machine's CPU.

With the garden target's shape: a training step under bfloat16 autocast (what ``garden.bf16`` does) and a forward pass
in each dtype (what ``dtype`` does). Half precision pays off only on CPUs with the hardware for it (AMX or
AVX512-BF16).

    python benchmarks/benchmark.py precision
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from benchmarks.suites.common import cpu_kernels
from distillspec.config import load_config
from distillspec.models.garden import make_model, train_tokenizer
from distillspec.models.loading import native_bf16, native_half


def suite_precision(overrides: list[str], budget: float, out: Path) -> dict:
    """float32 against half precision on this machine, with the garden target's shape (random weights, no garden
    needed): a garden training step under bfloat16 autocast, and a target forward pass in each dtype. Tells
    whether ``garden.bf16`` and ``dtype=bfloat16`` pay off here (they do only with bfloat16 hardware)."""
    cfg = load_config(None, overrides)
    tokenizer = train_tokenizer([f"{i} + {i} = {2 * i}" for i in range(200)], cfg.garden.vocab_size)
    torch.manual_seed(cfg.seed)
    model = make_model(cfg.garden.target, tokenizer)
    vocab = model.config.vocab_size

    def median_s(fn, reps: int = 3) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    batch = torch.randint(0, vocab, (8, 100))

    def train_step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    model.train()
    train = {"float32": median_s(lambda: train_step(False)), "bfloat16 autocast": median_s(lambda: train_step(True))}
    prompt, forward = torch.randint(0, vocab, (1, 40)), {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        half = model.to(dtype).eval()
        with torch.inference_mode():
            forward[str(dtype).removeprefix("torch.")] = median_s(lambda m=half: m(input_ids=prompt), reps=10)
    model.float()
    hardware = {"bfloat16": native_bf16("cpu"), "float16": native_half(torch.float16)}
    print(f"bfloat16 hardware on this CPU: {hardware['bfloat16']}; float16: {hardware['float16']}")
    print(f"garden training step (batch 8 x 100 tokens, {cfg.garden.target.n_layers}-layer target):")
    for name, s in train.items():
        print(f"  {name:18s} {s * 1000:8.1f} ms  ({s / train['float32']:.2f}x float32)")
    print("target forward pass (1 x 40 tokens):")
    for name, s in forward.items():
        print(f"  {name:18s} {s * 1000:8.1f} ms  ({s / forward['float32']:.2f}x float32)")
    return {
        "hardware": hardware,
        **cpu_kernels(),
        "train_step_s": train,
        "forward_s": forward,
    }
