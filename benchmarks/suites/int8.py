"""Suite ``int8``: which product of a linear layer is fastest on this machine's CPU, by kernel and row count.

The layers of the Qwen2.5-Coder pair (random weights, no model needed): the target's MLP projection (1536 -> 8960),
the draft's (896 -> 4864) and a draft head of 32,768 tokens (896 -> 32768), each at 1 row (a decoding step), 6 rows (a
verification at gamma 5, or a prompt's worth of a few tokens) and 96 rows (a prompt). Kernels: the eager float32
product, the float32 weight prepacked for oneDNN (what ``prepack`` does to a target), and the int8 layer a draft
decodes with (``draft_int8``): through fbgemm's int8 GEMM in float32 on x86, weight-only in float32 (the kernel it
replaces there) and in bfloat16. Each time is the median of repeated calls; each error the product's relative
distance from the float32 one.

    python benchmarks/benchmark.py int8
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from distillspec.models.packing import Int8Linear, PackedLinear, can_prepack, dynamic_int8

SHAPES = {"target MLP": (1536, 8960), "draft MLP": (896, 4864), "draft head, 32,768 tokens": (896, 32768)}
ROWS = (1, 6, 96)


def median_ms(fn, reps: int = 15) -> float:
    for _ in range(3):  # warm-up
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def suite_int8(
    overrides: list[str], budget: float, out: Path, shapes: dict[str, tuple[int, int]] = SHAPES, reps: int = 15
) -> dict:
    """Milliseconds of one product by layer shape (``{name: (in, out)}``), kernel and row count (see the module
    docstring; the median of ``reps`` calls), with each kernel's ratio to the eager float32 product and its relative
    error; writes ``int8.json`` into ``out``."""
    torch.manual_seed(0)
    rows_out = []
    for name, (fan_in, fan_out) in shapes.items():
        linear = nn.Linear(fan_in, fan_out, bias=False)
        nn.init.normal_(linear.weight, std=fan_in**-0.5)
        kernels = {"float32": linear}
        if can_prepack():
            kernels["float32 prepacked"] = PackedLinear(linear)
        if dynamic_int8(torch.float32):
            kernels["int8, fbgemm (float32)"] = Int8Linear(linear, dynamic=True)
        kernels["int8 weight-only (float32)"] = Int8Linear(linear, dynamic=False)
        kernels["int8 weight-only (bfloat16)"] = Int8Linear(copy.deepcopy(linear).bfloat16(), dynamic=False)
        for rows in ROWS:
            x = torch.randn(rows, fan_in)
            exact = linear(x)
            base = median_ms(functools.partial(linear, x), reps)
            for kernel, layer in kernels.items():
                ms = base if layer is linear else median_ms(functools.partial(layer, x), reps)
                error = ((layer(x).float() - exact).norm() / exact.norm()).item()
                rows_out.append({"layer": name, "rows": rows, "kernel": kernel, "ms": ms, "over_float32": ms / base,
                                 "relative_error": error})  # fmt: skip
                print(f"{name:26s} {rows:3d} rows  {kernel:28s} {ms:8.2f} ms  {ms / base:5.2f}x float32  "
                      f"error {error:.4f}")  # fmt: skip
    result = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    result |= {"rows": rows_out}
    out.mkdir(parents=True, exist_ok=True)
    (out / "int8.json").write_text(json.dumps(result, indent=1))
    return result
