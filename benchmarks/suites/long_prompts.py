"""Speculative decoding on long prompts: the draft reading the whole prompt or only its last N tokens.

A speculative call's target reads the prompt before its first token, as the target alone does; the draft reads it
too, with its first drafts, a cost the target alone does not pay. On a prompt of a few hundred tokens that is small;
on one of thousands it can outweigh what the drafts save. ``draft_context=N`` (``speculative_generate``, the
endpoint's ``serve.draft_context``) has the draft read only the prompt's last N tokens: its proposals depend mostly on
the recent ones, and the output stays the target's whatever the draft reads; ``auto`` (the endpoint's default) is
:func:`~distillspec.decoding.speculative.auto_draft_context`.

Each prompt is a held-out question after ``--shots`` worked examples of the training split (GSM8K's few-shot form),
through the pair's prompt format. Per prompt and temperature, the target alone and speculative decoding with each
draft context decode ``--max-new-tokens`` tokens in turn (the same seed each); the first token's time (a call of one
token, taken once per prompt: the target's reading of the prompt, which every decoder pays alike) is subtracted, so
the figures are tokens/s after the first token, with tau and alpha for speculative decoding.

    python -m benchmarks.suites.long_prompts target=qwen2.5-coder-1.5b-instruct \\
        draft=qwen2.5-coder-0.5b-instruct dataset=../shared/data/gsm8k --shots 8 --prompts 3 \\
        --draft-contexts all 512 128

Writes ``long_prompts.json`` and ``long_prompts.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.suites.common import command, few_shot
from distillspec.cli import run_main
from distillspec.config import DraftContext
from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.decoding.speculative import autoregressive_generate, speculative_generate


def context_name(context: DraftContext) -> str:
    if context == "auto":
        return "auto"
    return "the whole prompt" if context is None else f"its last {context} tokens"


def suite_long_prompts(
    overrides: list[str],
    *,
    shots: int,
    prompts: int,
    draft_contexts: list[DraftContext],
    gamma: int,
    temperatures: list[float],
    max_new_tokens: int,
    out: Path,
    log=print,
) -> dict:
    """The whole suite (see the module docstring); writes ``long_prompts.json`` and ``long_prompts.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    pair = few_shot(overrides, shots, prompts)
    cfg, target, draft, ids = pair.cfg, pair.target, pair.draft, pair.prompts
    lengths = [int(x.shape[1]) for x in ids]
    log(f"prompts of {lengths} tokens ({shots} worked examples before each question)")
    runs = [("target alone", None)] + [("SD", c) for c in draft_contexts]
    totals = {(t, mode, c): {"tokens": 0, "seconds": 0.0, "counts": AcceptanceCounts(0, 0, 0)}
              for t in temperatures for mode, c in runs}  # fmt: skip
    differ: dict[str, list[int]] = {}  # at T = 0: where a decoder's text first left the target alone's, by prompt
    with torch.inference_mode():
        speculative_generate(target, draft, ids[0][:, -32:], gamma=gamma, max_new_tokens=4, temperature=0)  # warm-up
        for i, prompt in enumerate(ids):
            start = time.perf_counter()
            autoregressive_generate(target, prompt, max_new_tokens=1, temperature=0)
            first = time.perf_counter() - start
            for t in temperatures:
                greedy = None
                for mode, c in runs:
                    generator = torch.Generator().manual_seed(i)
                    common = {"max_new_tokens": max_new_tokens, "temperature": t, "generator": generator}
                    start = time.perf_counter()
                    if mode == "target alone":
                        result = autoregressive_generate(target, prompt, **common)
                    else:
                        result = speculative_generate(target, draft, prompt, gamma=gamma, draft_context=c, **common)
                    seconds = time.perf_counter() - start - first
                    row = totals[(t, mode, c)]
                    row["tokens"] += int(result.num_new_tokens.sum()) - 1
                    row["seconds"] += seconds
                    if result.stats is not None:
                        row["counts"] += result.stats.counts
                    if t == 0:  # greedy: the target's tokens, but for rounding where a near tie is scored otherwise
                        new = result.sequences[0, prompt.shape[1] :].tolist()
                        greedy = new if greedy is None else greedy
                        apart = [j for j, (a, b) in enumerate(zip(new, greedy)) if a != b]
                        if apart:
                            differ.setdefault(f"{mode}, the draft reading {context_name(c)}", []).append(apart[0])
            log(f"prompt {i + 1}/{len(ids)}: the first token {first:.2f} s")
    rows = []
    for (t, mode, c), row in totals.items():
        entry = {"temperature": t, "decoder": mode, "draft_context": c, "tokens_per_s": row["tokens"] / row["seconds"]}
        if row["counts"].blocks:
            entry["alpha"], entry["tau"] = row["counts"].alpha, row["counts"].tau
        rows.append(entry)
    result = {
        "command": command(),
        "config": {"target": cfg.target, "draft": cfg.draft, "shots": shots, "prompt_tokens": lengths, "gamma": gamma},
        "greedy_first_differences": differ,
        "rows": rows,
    }
    (out / "long_prompts.json").write_text(json.dumps(result, indent=1))
    (out / "long_prompts.md").write_text(format_table(result) + "\n")
    log(format_table(result))
    return result


def format_table(result: dict) -> str:
    config = result["config"]
    lines = [
        f"{len(config['prompt_tokens'])} prompts of {min(config['prompt_tokens'])}-{max(config['prompt_tokens'])} "
        f"tokens ({config['shots']} worked examples before each question), gamma {config['gamma']}: tokens/s after "
        "the first token",
        "",
        "| T | decoder | the draft reads | alpha | tau | tokens/s | over the target alone |",
        "|---|---|---|---|---|---|---|",
    ]
    alone = {r["temperature"]: r["tokens_per_s"] for r in result["rows"] if r["decoder"] == "target alone"}
    for r in result["rows"]:
        reads = "" if r["decoder"] == "target alone" else context_name(r["draft_context"])
        alpha, tau = (f"{r['alpha']:.3f}", f"{r['tau']:.2f}") if "alpha" in r else ("", "")
        ratio = r["tokens_per_s"] / alone[r["temperature"]]
        lines.append(
            f"| {r['temperature']:g} | {r['decoder']} | {reads} | {alpha} | {tau} | {r['tokens_per_s']:.2f} | "
            f"{ratio:.2f}x |"
        )
    differ = result["greedy_first_differences"]
    lines.append("")
    if not differ:
        lines.append("At T = 0 every decoder gave the target alone's tokens.")
    for decoder, positions in differ.items():
        lines.append(
            f"At T = 0, {decoder}: the text left the target alone's at token {', '.join(map(str, positions))} "
            f"({len(positions)} of {len(config['prompt_tokens'])} prompts: a near tie that a step and a verification "
            "score apart in bfloat16)."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=...)")
    parser.add_argument("--shots", type=int, default=8, help="worked examples before each question")
    parser.add_argument("--prompts", type=int, default=3, help="held-out questions")
    parser.add_argument(
        "--draft-contexts",
        nargs="+",
        default=["all", "512", "128"],
        help="what the draft reads of each prompt: all, auto, or its last N tokens",
    )
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("outputs/long-prompts"))
    args = parser.parse_args()
    contexts = []
    for c in args.draft_contexts:
        if c not in ("all", "auto") and not (c.isdigit() and int(c) > 0):
            parser.error(f"--draft-contexts takes all, auto or a positive number of tokens, not {c!r}")
        contexts.append(None if c == "all" else c if c == "auto" else int(c))
    suite_long_prompts(
        args.overrides,
        shots=args.shots,
        prompts=args.prompts,
        draft_contexts=contexts,
        gamma=args.gamma,
        temperatures=args.temperatures,
        max_new_tokens=args.max_new_tokens,
        out=args.out,
    )


if __name__ == "__main__":
    run_main(main)
