"""A target's products on a CPU by layout (``prepack``). A float32 target: the few-row kernel
(:mod:`distillspec.models.few_rows`, ``few_rows``), oneDNN's prepacked layout, which it replaces where it runs
(``onednn``), and the few-row kernel over weights rounded to bfloat16 (``bfloat16``: ``prepack=bfloat16``). A
bfloat16 target: the few-row kernel (``bf16-few-rows``: bfloat16 rows where the CPU has AVX512-BF16, else float32
ones), matrix-vector products (``bf16-matrix-vector``), and oneDNN's products as the model comes (``bf16-plain``).
Either dtype with its layers on 4-bit grids held in 4 bits, the rest through the few-row kernel (``int4``,
``bf16-int4``: ``prepack=int4``, the default where the kernel runs; a float32 one's layers on 6-bit grids in 6 bits), a
float32 one with that rest in int8 (``int4-int8``: ``prepack=int4-int8``) or rounded to bfloat16 (``int4-bf16-rest``:
``prepack=int4`` before it held 6-bit layers in 6 bits); a float32 one with every other linear layer rounded to such
grids as well and held in 4 bits (``int4-all``: a 4-bit quantization of the target, for comparison; no ``prepack`` value
does it). The target is loaded once with each of ``--layouts`` (the 1.5B Qwen target: 7.1 GB a float32 layout, 3.6 GB
the bfloat16 ones, with its float32 embedding 4.5 GB; 3.4 and 2.0 GB with its 4-bit layers in 4 bits). The last layout
named is the baseline, whose dtype the draft takes.

1. Milliseconds of one cached step of k new tokens for each k of ``--ks`` (a decoding step, a verification of
   ``gamma + 1`` positions, a prompt's products), the targets in turn (:func:`benchmarks.suites.speed.suite_step_ms`).
2. How far each layout's next-token distributions are from the baseline's: the mean TVD and the argmax agreement
   over ``--held`` held-out questions, each followed by its reference answer, decoded a token a step (zero and one
   for two float32 layouts, up to the order of their sums).
3. Tokens/s at batch 1 of the target alone and of speculative decoding with the draft (as the endpoint runs it:
   ``draft_int8``) over each target, on ``--prompts`` held-out questions: each pass over the prompts races SD and
   the target alone over one target (:func:`distillspec.evaluation.measure.race`), the targets' passes alternating
   ``--repeats`` times; each layout's rates over the baseline's are taken pass by adjacent pass.

    python -m benchmarks.suites.target_kernel target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --gammas 5 --temperatures 0 1 --prompts 4 --max-new-tokens 96 --repeats 2 \\
        --out outputs/target-kernel-qwen
    python -m benchmarks.suites.target_kernel target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --layouts bf16-int4 bf16-few-rows --ks 1 2 6 128 --gammas 5 \\
        --out outputs/target-kernel-qwen-int4

Writes ``target_kernel.json`` and ``target_kernel.md``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from statistics import mean

import torch
from torch import nn

from benchmarks.suites.common import cpu_kernels
from benchmarks.suites.int8 import apart, stepwise_logits
from benchmarks.suites.speed import suite_step_ms
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.measure import race
from distillspec.models import few_rows
from distillspec.models.loading import (
    encode_prompts,
    load_model,
    parameter_count,
    quantize_decoding_draft,
    resolve_draft_int8,
)
from distillspec.models.packing import (
    INT4_GROUP,
    FewRowLinear,
    Int4Linear,
    PackedLinear,
    grid_layouts,
    grid_linears,
    int4_grid,
    int4_groups,
    prepack_linears,
    replace_linears,
)
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task


def every_layer_in_4_bits(model: nn.Module) -> int:
    """Every linear layer of ``model`` whose shape the kernel's 4-bit products take held in 4 bits
    (:class:`~distillspec.models.packing.Int4Linear`): those on 4-bit grids as they lie, the others rounded to such
    grids (:func:`~distillspec.models.packing.int4_groups`: each group's least to greatest weight in 16 levels).
    Returns how many."""

    def make(linear: nn.Linear) -> Int4Linear | None:
        if linear.out_features % 16 or linear.in_features % INT4_GROUP:
            return None
        codes, scales_zeros = int4_grid(linear.weight) or int4_groups(linear.weight)
        return Int4Linear(linear, few_rows.pack_int4(codes, scales_zeros.to(torch.bfloat16)), linear.weight.dtype)

    return replace_linears(model, make)


def rest_in_bfloat16(model: nn.Module) -> int:
    """``model``'s linear layers on 4-bit grids held in 4 bits, every other one (the 6-bit layers among them) rounded
    to bfloat16 for the few-row kernel: how ``prepack=int4`` held a float32 target before it held the 6-bit layers in
    6 bits. Returns how many were laid out."""
    return grid_linears(model, torch.float32, grid_layouts(model)) + prepack_linears(
        model, kernel="few_rows", weights=torch.bfloat16
    )


#: A layout's name -> the target's dtype, what lays its linear layers out after loading (None: as they come), and
#: the ``prepack`` it is loaded with (False: none).
LAYOUTS: dict[str, tuple[torch.dtype, Callable[[nn.Module], int] | None, bool | str]] = {
    "few_rows": (torch.float32, partial(prepack_linears, kernel="few_rows"), False),
    "onednn": (torch.float32, partial(prepack_linears, kernel="onednn"), False),
    "bfloat16": (torch.float32, partial(prepack_linears, kernel="few_rows", weights=torch.bfloat16), False),
    "int4": (torch.float32, None, "int4"),
    "int4-int8": (torch.float32, None, "int4-int8"),
    "int4-bf16-rest": (torch.float32, rest_in_bfloat16, False),
    "int4-all": (torch.float32, every_layer_in_4_bits, False),
    "bf16-few-rows": (torch.bfloat16, partial(replace_linears, make=partial(PackedLinear, kernel="few_rows")), False),
    "bf16-matrix-vector": (torch.bfloat16, partial(replace_linears, make=FewRowLinear), False),
    "bf16-plain": (torch.bfloat16, None, False),
    "bf16-int4": (torch.bfloat16, None, "int4"),
}


def suite_target_kernel(
    overrides: list[str],
    *,
    layouts: list[str],
    ks: list[int],
    gammas: list[int],
    temperatures: list[float],
    prompts: int,
    max_new_tokens: int,
    repeats: int,
    held: int,
    out: Path,
) -> dict:
    """The whole suite (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    if few_rows.missing():
        raise DistillSpecError(f"the few-row kernel does not run here: {few_rows.missing()}")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or len(set(layouts)) < 2:
        raise DistillSpecError(f"--layouts takes two or more of {', '.join(LAYOUTS)}, not {' '.join(layouts)}")
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    targets, tokenizer = {}, None
    for name in layouts:
        dtype, lay_out, prepack = LAYOUTS[name]
        targets[name], tokenizer = load_model(cfg.target, device="cpu", dtype=dtype, prepack=prepack)
        if lay_out is not None:
            lay_out(targets[name])
    draft = load_model(cfg.draft, device="cpu", dtype=LAYOUTS[layouts[-1]][0])[0]
    draft_int8 = resolve_draft_int8(cfg.draft_int8, parameter_count(draft))[0]
    quantize_decoding_draft(draft, draft_int8)
    result = {"config": {"target": cfg.target, "draft": cfg.draft, "draft_int8": draft_int8, "layouts": layouts}}
    result["config"] |= {"ks": ks, "gammas": gammas, "prompts": prompts, "max_new_tokens": max_new_tokens}
    result["config"] |= {"repeats": repeats, "held": held, "threads": torch.get_num_threads()} | cpu_kernels()
    times = suite_step_ms(list(targets.values()), [ks] * len(targets))
    result["step_ms"] = {name: {str(k): ms for k, ms in by_k.items()} for name, by_k in zip(targets, times)}
    print(format_steps(result))
    result["closeness"] = closeness(targets, tokenizer, task.test[:held])
    texts = [e.prompt for e in task.test[:prompts]]
    result["races"] = []
    for temperature in temperatures:
        for r in range(repeats):
            for name in layouts if r % 2 == 0 else layouts[::-1]:
                raced = race(
                    targets[name],
                    {"draft": draft},
                    tokenizer,
                    texts,
                    gammas=gammas,
                    temperature=temperature,
                    max_new_tokens=max_new_tokens,
                    seed=cfg.seed,
                    desc=f"T = {temperature:g}, pass {r + 1}, {name}",
                )
                result["races"].append({"layout": name, "temperature": temperature, "repeat": r} | raced)
        (out / "target_kernel.json").write_text(json.dumps(result, indent=1))
    table = "\n\n".join([format_steps(result), format_closeness(result), format_races(result)])
    (out / "target_kernel.md").write_text(table + "\n")
    print(table)
    return result


@torch.inference_mode()
def closeness(targets: dict, tokenizer, examples: list) -> dict[str, dict[str, float]]:
    """Per layout, the mean TVD of its next-token distributions from the last layout's and their argmax agreement,
    over each example's reference answer after its prompt, decoded a token a step (:func:`stepwise_logits`)."""
    names = list(targets)
    tvd, agree = {n: [] for n in names[:-1]}, {n: [] for n in names[:-1]}
    for example in examples:
        prompt = encode_prompts(tokenizer, [example.prompt])[0]
        answer = tokenizer(example.reference, return_tensors="pt", add_special_tokens=False).input_ids
        ids = torch.cat([prompt, answer], 1)
        base = stepwise_logits(targets[names[-1]], ids, prompt.shape[1])
        for name in names[:-1]:
            off, same = apart(stepwise_logits(targets[name], ids, prompt.shape[1]), base)
            tvd[name] += off
            agree[name] += same
    return {n: {"tvd": mean(tvd[n]), "argmax_agreement": mean(agree[n]), "positions": len(tvd[n])} for n in tvd}


def format_steps(result: dict) -> str:
    ms = result["step_ms"]
    ks = [str(k) for k in result["config"]["ks"]]
    base = result["config"]["layouts"][-1]
    head = "| layout | " + " | ".join(f"k = {k}" for k in ks) + " | k = 6 / k = 1 |"
    lines = [head, "|---|" + "---|" * (len(ks) + 1)]
    for name, by_k in ms.items():
        ratio = f"{by_k['6'] / by_k['1']:.2f}" if "6" in by_k and "1" in by_k else ""
        lines.append(f"| {name} | " + " | ".join(f"{by_k[k]:.1f}" for k in ks) + f" | {ratio} |")
    for name in list(ms)[:-1]:
        lines.append(f"| {name} / {base} | " + " | ".join(f"{ms[name][k] / ms[base][k]:.2f}" for k in ks) + " | |")
    return "Milliseconds of one cached step of k new tokens:\n\n" + "\n".join(lines)


def format_closeness(result: dict) -> str:
    base = result["config"]["layouts"][-1]
    lines = [f"| layout | mean TVD from {base} | argmax agreement | positions |", "|---|---|---|---|"]
    for name, row in result["closeness"].items():
        lines.append(f"| {name} | {row['tvd']:.5f} | {row['argmax_agreement']:.4f} | {row['positions']} |")
    return f"Next-token distributions on {result['config']['held']} held-out answers:\n\n" + "\n".join(lines)


def format_races(result: dict) -> str:
    """Per temperature and gamma: each layout's tokens/s (target alone, SD), SD's speedup, and its rates over the
    baseline's (the last layout), the mean and the spread over adjacent passes."""
    c = result["config"]
    base = c["layouts"][-1]
    lines = [
        "| T | gamma | layout | alpha | tau | target alone, tok/s | SD, tok/s | SD speedup "
        f"| target alone vs {base} | SD vs {base} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for temperature in sorted({r["temperature"] for r in result["races"]}):
        runs = {
            name: sorted(
                (r for r in result["races"] if r["layout"] == name and r["temperature"] == temperature),
                key=lambda r: r["repeat"],
            )
            for name in c["layouts"]
        }
        for gamma in c["gammas"]:
            alone = {name: [r["target"]["tokens_per_s"] for r in runs[name]] for name in runs}
            sd = {name: [next(s for s in r["sd"] if s["gamma"] == gamma) for r in runs[name]] for name in runs}
            for name in runs:
                rates = [s["tokens_per_s"] for s in sd[name]]
                line = (
                    f"| {temperature:g} | {gamma} | {name} | {mean(s['alpha'] for s in sd[name]):.3f} |"
                    f" {mean(s['tau'] for s in sd[name]):.2f} | {mean(alone[name]):.2f} | {mean(rates):.2f} |"
                    f" {spread([s['speedup'] for s in sd[name]], 'x')} |"
                )
                base_rates = [s["tokens_per_s"] for s in sd[base]]
                line += f" {spread([a / b for a, b in zip(alone[name], alone[base])], 'x')} |"
                line += f" {spread([a / b for a, b in zip(rates, base_rates)], 'x')} |"
                lines.append(line)
    return (
        f"{c['prompts']} held-out prompts x {c['max_new_tokens']} tokens, {c['repeats']} passes a layout, "
        f"draft_int8={c['draft_int8']}:\n\n" + "\n".join(lines)
    )


def spread(values: list[float], unit: str = "") -> str:
    """``mean (min-max)`` of ``values``."""
    return f"{mean(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_int8)")
    parser.add_argument(
        "--layouts", nargs="+", default=["few_rows", "onednn"], help=f"of {', '.join(LAYOUTS)}; the last: the baseline"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16, 128], help="new tokens a step")
    parser.add_argument("--gammas", type=int, nargs="+", default=[5])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts, decoded one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts with each target")
    parser.add_argument(
        "--held", type=int, default=2, help="held-out answers the layouts' distributions are compared on"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/target-kernel"))
    args = parser.parse_args()
    suite_target_kernel(
        args.overrides,
        layouts=args.layouts,
        ks=args.ks,
        gammas=args.gammas,
        temperatures=args.temperatures,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        held=args.held,
        out=args.out,
    )


if __name__ == "__main__":
    run_main(main)
