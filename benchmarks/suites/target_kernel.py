"""A float32 target's products on a CPU by kernel: the few-row kernel (:mod:`distillspec.models.few_rows`) against
oneDNN's prepacked layout, which it replaces where it runs. The target is loaded once with each layout (twice its
float32 bytes in memory: 14 GB for the 1.5B Qwen target).

1. Milliseconds of one cached step of k new tokens for each k of ``--ks`` (a decoding step, a verification of
   ``gamma + 1`` positions, a prompt's products), both targets in turn
   (:func:`benchmarks.suites.speed.suite_step_ms`).
2. Tokens/s at batch 1 of the target alone and of speculative decoding with the draft (as the endpoint runs it:
   ``draft_int8``) over each target, on ``--prompts`` held-out questions: each pass over the prompts races SD and
   the target alone over one target (:func:`distillspec.evaluation.measure.race`), the two targets' passes alternating
   ``--repeats`` times; the few-row target's rates over oneDNN's are taken pass by adjacent pass.

    python -m benchmarks.suites.target_kernel target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --gammas 5 --temperatures 0 1 --prompts 4 --max-new-tokens 96 --repeats 2 \\
        --out outputs/target-kernel-qwen

Writes ``target_kernel.json`` and ``target_kernel.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

import torch

from benchmarks.suites.common import cpu_kernels
from benchmarks.suites.speed import suite_step_ms
from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.measure import race
from distillspec.models import few_rows
from distillspec.models.loading import load_model, parameter_count, quantize_decoding_draft, resolve_draft_int8
from distillspec.models.packing import prepack_linears
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task

KERNELS = ("few_rows", "onednn")


def suite_target_kernel(
    overrides: list[str],
    *,
    ks: list[int],
    gammas: list[int],
    temperatures: list[float],
    prompts: int,
    max_new_tokens: int,
    repeats: int,
    out: Path,
) -> dict:
    """The whole suite (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    if not few_rows.available():
        raise DistillSpecError(f"the few-row kernel does not run here: {few_rows.unavailable_reason() or 'see above'}")
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    targets, tokenizer = {}, None
    for kernel in KERNELS:
        targets[kernel], tokenizer = load_model(cfg.target, device="cpu", dtype=torch.float32)
        prepack_linears(targets[kernel], kernel=kernel)
    draft = load_model(cfg.draft, device="cpu", dtype=torch.float32)[0]
    draft_int8 = resolve_draft_int8(cfg.draft_int8, parameter_count(draft))[0]
    quantize_decoding_draft(draft, draft_int8)
    result = {"config": {"target": cfg.target, "draft": cfg.draft, "draft_int8": draft_int8, "ks": ks}}
    result["config"] |= {"gammas": gammas, "prompts": prompts, "max_new_tokens": max_new_tokens, "repeats": repeats}
    result["config"] |= {"threads": torch.get_num_threads()} | cpu_kernels()
    times = suite_step_ms([targets[k] for k in KERNELS], [ks] * len(KERNELS))
    result["step_ms"] = {kernel: {str(k): ms for k, ms in by_k.items()} for kernel, by_k in zip(KERNELS, times)}
    print(format_steps(result))
    texts = [e.prompt for e in task.test[:prompts]]
    result["races"] = []
    for temperature in temperatures:
        for r in range(repeats):
            for kernel in KERNELS if r % 2 == 0 else KERNELS[::-1]:
                raced = race(
                    targets[kernel],
                    {"draft": draft},
                    tokenizer,
                    texts,
                    gammas=gammas,
                    temperature=temperature,
                    max_new_tokens=max_new_tokens,
                    seed=cfg.seed,
                    desc=f"T = {temperature:g}, pass {r + 1}, {kernel}",
                )
                result["races"].append({"kernel": kernel, "temperature": temperature, "repeat": r} | raced)
        (out / "target_kernel.json").write_text(json.dumps(result, indent=1))
    table = format_steps(result) + "\n\n" + format_races(result)
    (out / "target_kernel.md").write_text(table + "\n")
    print(table)
    return result


def format_steps(result: dict) -> str:
    ms = result["step_ms"]
    ks = [str(k) for k in result["config"]["ks"]]
    head = "| kernel | " + " | ".join(f"k = {k}" for k in ks) + " | k = 6 / k = 1 |"
    lines = [head, "|---|" + "---|" * (len(ks) + 1)]
    for kernel, by_k in ms.items():
        ratio = f"{by_k['6'] / by_k['1']:.2f}" if "6" in by_k and "1" in by_k else ""
        lines.append(f"| {kernel} | " + " | ".join(f"{by_k[k]:.1f}" for k in ks) + f" | {ratio} |")
    ratios = " | ".join(f"{ms['few_rows'][k] / ms['onednn'][k]:.2f}" for k in ks)
    lines.append(f"| few_rows / onednn | {ratios} | |")
    return "Milliseconds of one cached step of k new tokens:\n\n" + "\n".join(lines)


def format_races(result: dict) -> str:
    """Per temperature and gamma: each kernel's tokens/s (target alone, SD), SD's speedup, and the few-row target's
    rates over oneDNN's, the mean and the spread over adjacent passes."""
    lines = [
        "| T | gamma | kernel | alpha | tau | target alone, tok/s | SD, tok/s | SD speedup | target alone vs oneDNN "
        "| SD vs oneDNN |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    c = result["config"]
    for temperature in sorted({r["temperature"] for r in result["races"]}):
        for gamma in c["gammas"]:
            runs = {
                k: [r for r in result["races"] if r["kernel"] == k and r["temperature"] == temperature] for k in KERNELS
            }
            by_pass = {k: sorted(runs[k], key=lambda r: r["repeat"]) for k in KERNELS}
            for kernel in KERNELS:
                rows = [next(s for s in r["sd"] if s["gamma"] == gamma) for r in by_pass[kernel]]
                alone = [r["target"]["tokens_per_s"] for r in by_pass[kernel]]
                sd = [s["tokens_per_s"] for s in rows]
                speedup = [s["speedup"] for s in rows]
                line = (
                    f"| {temperature:g} | {gamma} | {kernel} | {mean(s['alpha'] for s in rows):.3f} |"
                    f" {mean(s['tau'] for s in rows):.2f} | {mean(alone):.2f} | {mean(sd):.2f} |"
                    f" {spread(speedup, 'x')} |"
                )
                if kernel == "few_rows":
                    base = by_pass["onednn"]
                    base_sd = [next(s for s in r["sd"] if s["gamma"] == gamma)["tokens_per_s"] for r in base]
                    base_alone = [r["target"]["tokens_per_s"] for r in base]
                    line += f" {spread([a / b for a, b in zip(alone, base_alone)], 'x')} |"
                    line += f" {spread([a / b for a, b in zip(sd, base_sd)], 'x')} |"
                else:
                    line += " 1.00x | 1.00x |"
                lines.append(line)
    return (
        f"{c['prompts']} held-out prompts x {c['max_new_tokens']} tokens, {c['repeats']} passes a kernel, "
        f"draft_int8={c['draft_int8']}:\n\n" + "\n".join(lines)
    )


def spread(values: list[float], unit: str = "") -> str:
    """``mean (min-max)`` of ``values``."""
    return f"{mean(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_int8)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 128], help="new tokens a step")
    parser.add_argument("--gammas", type=int, nargs="+", default=[5])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts, decoded one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts with each target")
    parser.add_argument("--out", type=Path, default=Path("outputs/target-kernel"))
    args = parser.parse_args()
    suite_target_kernel(
        args.overrides,
        ks=args.ks,
        gammas=args.gammas,
        temperatures=args.temperatures,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        out=args.out,
    )


if __name__ == "__main__":
    main()
