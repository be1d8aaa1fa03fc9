"""What shipping the target's top-k log-probabilities (``learner.target_logits=scorer scorer.topk=K``) costs in the
exactness of the distillation loss: each divergence over batches the draft samples (the default recipe's data),
computed with the target's full distribution and with its top k only (the k tokens and "any other token": a lower
bound of the full divergence, :mod:`distillspec.training.divergences`), and the bytes a batch then carries.

    python -m benchmarks.suites.topk target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k draft_vocab=32768 distill.batch_size=8 distill.max_new_tokens=48 --ks 8 20 64 256

With a draft vocabulary the target's distribution is first conditioned on it, as the learner does
(:func:`distillspec.models.draft_vocab.restrict_target`). Writes ``topk.json`` and ``topk.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from distillspec.cli import run_main
from distillspec.config import DIVERGENCE_NAMES, load_config
from distillspec.models.draft_vocab import d2t, restrict_target
from distillspec.models.loading import load_pair
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task
from distillspec.training.divergences import compress_topk, divergence
from distillspec.training.losses import forward_logits, train_temperature
from distillspec.training.rollout import generate_batch


@torch.inference_mode()
def suite_topk(overrides: list[str], ks: list[int], batches: int, out: Path) -> dict:
    """The whole suite (see the module docstring)."""
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)
    d, ids = cfg.distill, d2t(draft)
    temperature = train_temperature(d.temperature)
    generator = torch.Generator().manual_seed(cfg.seed)
    sums = {name: {"full": 0.0, **{str(k): 0.0 for k in ks}} for name in DIVERGENCE_NAMES}
    for i in range(batches):
        examples = task.train[i * d.batch_size : (i + 1) * d.batch_size]
        batch = generate_batch("draft", target, draft, tokenizer, examples, max_new_tokens=d.max_new_tokens,
                               temperature=d.temperature, generator=generator)  # fmt: skip
        full = forward_logits(target, batch).float()
        q = forward_logits(draft, batch).float()
        for name in DIVERGENCE_NAMES:
            sums[name]["full"] += _loss(name, q, full, ids, batch.window_mask, temperature, d.beta) / batches
            for k in ks:
                p = compress_topk(full, k, temperature)
                sums[name][str(k)] += _loss(name, q, p, ids, batch.window_mask, temperature, d.beta) / batches
        print(f"  batch {i + 1}/{batches}: {batch.tokens} tokens")
    positions = d.batch_size * (d.max_new_tokens + 1)
    result = {
        "config": {"target": cfg.target, "draft": cfg.draft, "batches": batches, "batch_size": d.batch_size},
        "divergence": sums,
        "batch_mib": {
            "full": positions * full.shape[-1] * 4 / 2**20,
            **{str(k): positions * k * 12 / 2**20 for k in ks},
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk.json").write_text(json.dumps(result, indent=1))
    (out / "topk.md").write_text(format_table(result) + "\n")
    print(format_table(result))
    return result


def _loss(name, q, p, ids, mask, temperature: float, beta: float) -> float:
    return float(divergence(name, q, restrict_target(p, ids), mask, temperature=temperature, beta=beta))


def format_table(result: dict) -> str:
    ks = [k for k in result["batch_mib"] if k != "full"]
    lines = [
        f"divergence of the draft from the target over {result['config']['batches']} batches of "
        f"{result['config']['batch_size']} draft samples: full distribution, and top k (share of the full)",
        "",
        "| divergence | full | " + " | ".join(f"top {k}" for k in ks) + " |",
        "|---|---|" + "---|" * len(ks),
    ]
    for name, row in result["divergence"].items():
        cells = " | ".join(f"{row[k]:.4f} ({row[k] / row['full']:.1%})" for k in ks)
        lines.append(f"| {name} | {row['full']:.4f} | {cells} |")
    mib = result["batch_mib"]
    lines.append(
        f"| a batch's target scores, MiB | {mib['full']:.1f} | " + " | ".join(f"{mib[k]:.2f}" for k in ks) + " |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., distill.*)")
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 20, 64, 256], help="top-k sizes to compare")
    parser.add_argument("--batches", type=int, default=2, help="draft-sampled batches of distill.batch_size")
    parser.add_argument("--out", type=Path, default=Path("outputs/topk"))
    args = parser.parse_args()
    suite_topk(args.overrides, args.ks, args.batches, args.out)


if __name__ == "__main__":
    run_main(main)
