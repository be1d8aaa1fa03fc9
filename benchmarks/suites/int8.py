"""What int8 weights cost a draft and save it on this CPU, kernel by kernel.

Kernels (:class:`distillspec.models.packing.Int8Linear`, what ``draft_int8`` decodes with): weight-only int8 in the
model's dtype, its activations in bfloat16 for a float32 model on a CPU (``draft_int8=true``); fbgemm's int8 GEMM
(x86), which rounds the activations to 7 bits as well, one scale per row (``draft_int8=fbgemm``); and int4, up to
four rows (drafting steps; twelve through the few-row kernel, wherever it runs) through 4-bit weights in
groups of 32, more through fbgemm (``draft_int8=int4``); there, also ``int4-torch``: the same through torch's kernel.
Over 16 rows (a prompt) the weight-only kernel takes the int8 values as floats, then the row scales. Each int8 kernel is
timed in a float32 and in a bfloat16 model (taking that model's activations). Beside them, the eager float32
product, the float32 weight prepacked for oneDNN and laid out for the few-row kernel where it runs (what ``prepack``
does to a float32 target: :mod:`distillspec.models.few_rows`), the eager bfloat16 product (a model in
``dtype=bfloat16``) and the bfloat16 product as matrix-vector ones (what ``prepack`` does to a bfloat16 target).

1. Milliseconds of one product, on the layers of the Qwen2.5-Coder pair with random weights (no model needed): the
   target's MLP projection (1536 -> 8960), the draft's (896 -> 4864) and a draft head of 32,768 tokens (896 ->
   32768), each at 1 row (a drafting step), 6 rows (a verification at gamma 5) and 96 rows (a prompt); each time
   the median of repeated calls, each error the product's relative distance from the float32 one.
2. With ``--held N``, the job's draft itself on N held-out examples of its data set, each prompt followed by its
   reference, decoded as a speculative decoder's draft decodes (the prompt prefilled, then one token a step): its
   step time, the median time it takes to read a prompt, and for each kernel the mean TVD between the int8 draft's
   distribution and the draft's own at each position (the acceptance at T = 1 can change by at most this much:
   ``|TVD(p, q) - TVD(p, q')| <= TVD(q, q')``) and how often their argmaxes agree (what greedy acceptance can keep);
   then, for the float draft and each int8 one, the acceptance itself against the target's distributions at the same
   positions (read in one pass): ``alpha = E[1 - TVD(p, q)]`` (T = 1) and how often the argmaxes agree (T = 0), on
   text neither model wrote, with far less spread than a race's few hundred drafted tokens.

    python benchmarks/benchmark.py int8
    python -m benchmarks.suites.int8 target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --held 8

Writes ``int8.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.suites.common import cpu_kernels, limits_text, quantize_kind, suite_int8_kernels
from benchmarks.suites.speed import suite_step_ms
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.decoding.kvcache import CachedLM, bucketed_capacity
from distillspec.decoding.metrics import position_tvd
from distillspec.models.loading import encode_prompts, load_model
from distillspec.models.packing import FewRowLinear, PackedLinear, can_prepack
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task

SHAPES = {"target MLP": (1536, 8960), "draft MLP": (896, 4864), "draft head, 32,768 tokens": (896, 32768)}
ROWS = (1, 6, 96)


def median_ms(fn, reps: int = 15, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def kernel_times(shapes: dict[str, tuple[int, int]] = SHAPES, reps: int = 15) -> list[dict]:
    """Part 1 (see the module docstring): a row per layer shape (``{name: (in, out)}``), row count and kernel."""
    torch.manual_seed(0)
    rows_out = []
    for name, (fan_in, fan_out) in shapes.items():
        linear = nn.Linear(fan_in, fan_out, bias=False)
        nn.init.normal_(linear.weight, std=fan_in**-0.5)
        kernels = {"float32": linear}
        if can_prepack():
            kernels["float32 prepacked"] = PackedLinear(linear, kernel="onednn")
            if (few := PackedLinear(linear)).kernel == "few_rows":  # where the few-row kernel takes it
                kernels["float32 few-row kernel"] = few
        kernels["bfloat16"] = copy.deepcopy(linear).bfloat16()
        kernels["bfloat16 few rows"] = FewRowLinear(copy.deepcopy(linear).bfloat16())
        for model_dtype in (torch.float32, torch.bfloat16):
            for kernel in suite_int8_kernels():
                label = f"int8 {kernel} ({str(model_dtype).removeprefix('torch.')} model)"
                layer = nn.Sequential(copy.deepcopy(linear).to(model_dtype))
                kernels[label] = quantize_kind(layer, kernel)
        for rows in ROWS:
            x = torch.randn(rows, fan_in)
            exact = linear(x)
            base = median_ms(functools.partial(linear, x), reps)
            for kernel, layer in kernels.items():
                x_in = x.bfloat16() if "bfloat16" in kernel else x  # a layer takes its model's activations
                ms = base if layer is linear else median_ms(functools.partial(layer, x_in), reps)
                error = ((layer(x_in).float() - exact).norm() / exact.norm()).item()
                rows_out.append({"layer": name, "rows": rows, "kernel": kernel, "ms": ms, "over_float32": ms / base,
                                 "relative_error": error})  # fmt: skip
                print(f"{name:26s} {rows:3d} rows  {kernel:34s} {ms:8.2f} ms  {ms / base:5.2f}x float32  "
                      f"error {error:.4f}", flush=True)  # fmt: skip
    return rows_out


@torch.inference_mode()
def prefill_ms(model, prompt: torch.Tensor, reps: int = 2) -> float:
    """Median milliseconds ``model`` takes to read ``prompt`` [1, L] into a fresh cache (after one untimed read)."""
    capacity = bucketed_capacity(prompt.shape[1] + 1)
    return median_ms(lambda: CachedLM(model, capacity=capacity).prefill(prompt, torch.ones_like(prompt)), reps, 1)


@torch.inference_mode()
def stepwise_logits(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The next-token logits [positions, V] (float32) of ``model`` over ``ids`` [1, L] after its first ``prompt_len``
    tokens, decoded as a draft decodes: the prompt prefilled, then one token a step."""
    lm = CachedLM(model, capacity=bucketed_capacity(ids.shape[1] + 1))
    logits = [lm.prefill(ids[:, :prompt_len], torch.ones_like(ids[:, :prompt_len]))]
    logits += [lm.step(ids[:, t : t + 1])[:, -1] for t in range(prompt_len, ids.shape[1] - 1)]
    return torch.cat(logits).float()


def apart(logits: torch.Tensor, reference: torch.Tensor) -> tuple[list[float], list[float]]:
    """At each position of two models' logits [positions, V]: the TVD of their distributions, and whether their
    argmaxes agree (1 - the TVD of T = 0) (:func:`~distillspec.decoding.metrics.position_tvd`)."""
    tvd = position_tvd(logits, reference).tolist()
    return tvd, (1 - position_tvd(logits, reference, temperature=0)).tolist()


def draft_closeness(overrides: list[str], held: int) -> dict:
    """Part 2 (see the module docstring) on the job's draft (``overrides``: its config keys)."""
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    draft, tokenizer = load_model(cfg.draft, device=cfg.device, dtype=getattr(torch, cfg.dtype))
    variants = {"float": draft}
    for kernel in suite_int8_kernels():
        variants[kernel] = quantize_kind(copy.deepcopy(draft), kernel)
    steps = suite_step_ms(list(variants.values()), [[1]] * len(variants))
    result = {"dtype": cfg.dtype, "held": held, "step_ms": {k: ms[1] for k, ms in zip(variants, steps)}}
    target = load_model(cfg.target, device=cfg.device, dtype=getattr(torch, cfg.dtype))[0]
    tvd = {kernel: [] for kernel in variants if kernel != "float"}
    agree = {kernel: [] for kernel in tvd}
    accepted = {kernel: [] for kernel in variants}  # 1 - TVD(p, q) at each position
    greedy = {kernel: [] for kernel in variants}  # the target's argmax is the draft's
    prompt_ms, prompt_tokens = {kernel: [] for kernel in variants}, []
    for example in task.test[:held]:
        prompt = encode_prompts(tokenizer, [example.prompt])[0]
        prompt_tokens.append(prompt.shape[1])
        for kernel, model in variants.items():
            prompt_ms[kernel].append(prefill_ms(model, prompt))
        ids = torch.cat(
            [prompt, tokenizer(example.reference, return_tensors="pt", add_special_tokens=False).input_ids], 1
        )
        with torch.inference_mode():
            p = target(ids).logits[0, prompt.shape[1] - 1 : -1].float()
        q = stepwise_logits(draft, ids, prompt.shape[1])
        for kernel, model in variants.items():
            q8 = q if kernel == "float" else stepwise_logits(model, ids, prompt.shape[1])
            rejected, same = apart(q8, p)
            accepted[kernel] += [1 - r for r in rejected]
            greedy[kernel] += same
            if kernel != "float":
                off, same = apart(q8, q)
                tvd[kernel] += off
                agree[kernel] += same
    result["positions"] = len(next(iter(tvd.values()), []))
    result["prompt_ms"] = {k: statistics.median(v) for k, v in prompt_ms.items()}
    result["prompt_tokens"] = statistics.median(prompt_tokens)
    result["kernels"] = {
        k: {"tvd": statistics.fmean(tvd[k]), "argmax_agreement": statistics.fmean(agree[k])} for k in tvd
    }
    result["acceptance"] = {
        k: {"alpha": statistics.fmean(accepted[k]), "argmax_agreement": statistics.fmean(greedy[k])} for k in variants
    }
    for kernel, row in result["acceptance"].items():
        print(
            f"{Path(cfg.draft).name}, {'float' if kernel == 'float' else f'int8 {kernel}'} against the target: "
            f"alpha {row['alpha']:.4f} (T = 1), argmax agreement {row['argmax_agreement']:.4f} (T = 0)"
        )
    for kernel, row in result["kernels"].items():
        print(f"{Path(cfg.draft).name}, int8 {kernel}: step {result['step_ms'][kernel]:.1f} ms "
              f"(float {result['step_ms']['float']:.1f}), prompt {result['prompt_ms'][kernel]:.0f} ms "
              f"(float {result['prompt_ms']['float']:.0f}), mean TVD from the float draft {row['tvd']:.4f}, "
              f"argmax agreement {row['argmax_agreement']:.4f} over {result['positions']} positions")  # fmt: skip
    return result


def suite_int8(
    overrides: list[str], out: Path, *, held: int = 0, shapes: dict[str, tuple[int, int]] = SHAPES, reps: int = 15
) -> dict:
    """The whole suite (see the module docstring); writes ``int8.json`` into ``out``."""
    result = cpu_kernels() | {"threads": torch.get_num_threads()}
    print(f"CPU kernels: {result['cpu_capability']}{limits_text(result['isa_limits'])}")
    result["rows"] = kernel_times(shapes, reps)
    if held:
        result["draft"] = draft_closeness(overrides, held)
    out.mkdir(parents=True, exist_ok=True)
    (out / "int8.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=...)")
    parser.add_argument("--held", type=int, default=0, help="held-out examples to compare the int8 drafts on (0: none)")
    parser.add_argument("--out", type=Path, default=Path("outputs/int8"))
    args = parser.parse_args()
    suite_int8(args.overrides, args.out, held=args.held)


if __name__ == "__main__":
    run_main(main)
