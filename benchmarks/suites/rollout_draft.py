"""What a rollout batch costs with the draft's own weights and with its decoding copy (``rollout.decoding_copy``): each
samples the same prompts in turn, as a rollout actor samples on-policy continuations
(:func:`distillspec.training.rollout.generate_batch`), and a new version loads into each
(:func:`distillspec.models.loading.load_arrays`: the decoding copy quantizes it as it loads).

1. Seconds per step of a batch of ``--rows`` prompts, EOS ignored, each draft over ``--repeats`` batches (the order
   alternating from batch to batch).
2. Seconds for a new version (the draft's weights as the learner publishes them) to load into each.
3. How far the decoding copy's distribution is from the draft's: the mean TVD between their next-token distributions
   (at ``distill.temperature``) over the continuations the draft sampled, and how often their argmaxes agree.

    python -m benchmarks.suites.rollout_draft target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --rows 8 --max-new-tokens 64 --out outputs/rollout-draft-qwen

Writes ``rollout_draft.json`` and ``rollout_draft.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.suites.common import cpu_kernels
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.models.loading import load_arrays
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task
from distillspec.training.divergences import tvd
from distillspec.training.losses import forward_logits, train_temperature
from distillspec.training.rollout import generate_batch, load_rollout_draft
from distillspec.versions import state_arrays

DRAFTS = ("the weights it trains", "its decoding copy")


def suite_rollout_draft(overrides: list[str], *, rows: int, max_new_tokens: int, repeats: int, out: Path) -> dict:
    """The whole suite (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    m, d = cfg.models, cfg.distill
    drafts = {
        name: load_rollout_draft(m, d.bf16, decoding) for name, decoding in zip(DRAFTS, (False, True), strict=True)
    }
    tokenizer = drafts[DRAFTS[0]][1]
    result = {"config": {"target": cfg.target, "draft": cfg.draft, "dtype": cfg.dtype, "draft_int8": cfg.draft_int8}}
    result["config"] |= {"rows": rows, "max_new_tokens": max_new_tokens, "repeats": repeats}
    result["config"] |= {"temperature": d.temperature, "threads": torch.get_num_threads()} | cpu_kernels()
    sampling = {name: [0.0, 0] for name in DRAFTS}  # seconds, steps
    batches = []
    for r in range(repeats):
        examples = task.train[r * rows : (r + 1) * rows]
        for name in DRAFTS if r % 2 == 0 else DRAFTS[::-1]:
            start = time.perf_counter()
            batch = generate_batch(
                "draft",
                None,
                drafts[name][0],
                tokenizer,
                examples,
                max_new_tokens=max_new_tokens,
                temperature=d.temperature,
                generator=torch.Generator().manual_seed(cfg.seed + r),
                max_prompt_tokens=d.max_prompt_tokens,
                eos_token_id=[],
            )
            sampling[name][0] += time.perf_counter() - start
            sampling[name][1] += max_new_tokens  # every row runs to the budget
            if name == DRAFTS[0]:
                batches.append(batch)
        print(f"batch {r + 1}: " + "; ".join(f"{n}: {s / k * 1e3:.0f} ms a step" for n, (s, k) in sampling.items()))
    result["sampling"] = [
        {"draft": n, "seconds": s, "steps": k, "ms_per_step": 1e3 * s / k} for n, (s, k) in sampling.items()
    ]
    # a version as the learner publishes it, in buffers of its own (as one pulled from the object store)
    version = {name: array.copy() for name, array in state_arrays(drafts[DRAFTS[0]][0]).items()}
    result["load_s"] = {}
    for name in DRAFTS:
        start = time.perf_counter()
        load_arrays(drafts[name][0], version)
        result["load_s"][name] = time.perf_counter() - start
    temperature = train_temperature(d.temperature)
    distance, agree, positions = 0.0, 0.0, 0
    with torch.inference_mode():
        for batch in batches:
            p, q = (forward_logits(drafts[name][0], batch).float() for name in DRAFTS)
            mask = batch.window_mask
            distance += float(tvd(q, p, mask, temperature=temperature, reduction="none").sum())
            agree += float(((p.argmax(-1) == q.argmax(-1)).float() * mask).sum())
            positions += int(mask.sum())
    result["tvd"], result["argmax_agreement"], result["positions"] = distance / positions, agree / positions, positions
    table = format_table(result)
    (out / "rollout_draft.json").write_text(json.dumps(result, indent=1))
    (out / "rollout_draft.md").write_text(table + "\n")
    print(table)
    return result


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['rows']} rows x {c['max_new_tokens']} tokens a batch, {c['repeats']} batches each, draft_int8="
        f"{c['draft_int8']}, dtype={c['dtype']}",
        "",
        "| rollout draft | steps | s | ms per step | ratio | a new version loads in, s |",
        "|---|---|---|---|---|---|",
    ]
    base = result["sampling"][0]["ms_per_step"]
    for row in result["sampling"]:
        lines.append(
            f"| {row['draft']} | {row['steps']} | {row['seconds']:.1f} | {row['ms_per_step']:.0f} |"
            f" {row['ms_per_step'] / base:.2f} | {result['load_s'][row['draft']]:.1f} |"
        )
    lines += [
        "",
        f"Over the {result['positions']} positions the draft sampled: mean TVD between the two {result['tvd']:.4f}, "
        f"argmax agreement {result['argmax_agreement']:.4f}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_int8)")
    parser.add_argument("--rows", type=int, default=8, help="prompts a batch (distill.batch_size)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens a continuation, EOS ignored")
    parser.add_argument("--repeats", type=int, default=2, help="batches each draft samples")
    parser.add_argument("--out", type=Path, default=Path("outputs/rollout-draft"))
    args = parser.parse_args()
    suite_rollout_draft(
        args.overrides, rows=args.rows, max_new_tokens=args.max_new_tokens, repeats=args.repeats, out=args.out
    )


if __name__ == "__main__":
    run_main(main)
