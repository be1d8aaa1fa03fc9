"""What a draft vocabulary costs in acceptance, for vocabularies of several sizes chosen from the data set's text alone
or also from the draft's own samples (``draft_vocab_samples``): exact figures, no speculative decoding.

The whole draft scores fixed held-out sequences sampled from the target (exactly, by speculative decoding) at T = 1
and greedily; a draft vocabulary keeps rows of the same head, so the draft restricted to it has the whole draft's
logits renormalised over the kept tokens. For each vocabulary: ``alpha`` = 1 - E[TVD(p, q)] at T = 1 (the acceptance
rate at T = 1), ``greedy`` = the share of positions where the argmaxes agree (the acceptance rate at T = 0), the
target's probability outside the vocabulary (mass the draft can never propose), and tau at gamma 5 expected from
alpha. The whole vocabulary is the first row.

    python -m benchmarks.suites.draft_vocab target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --sizes 32768 49152 --samples 0 64 256 --held 32

The vocabulary is counted on the held-out questions' own data set (its training split), or with ``--vocab-from`` on
each data set named there: what a draft vocabulary made for one task costs on another (``dataset=`` the other task,
``--vocab-from`` the task the draft was made for, and the other task itself beside it).

Writes ``draft_vocab.json`` and ``draft_vocab.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.suites.trajectory import held_out
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.decoding.metrics import alpha_from_tvd, expected_tau
from distillspec.models.loading import load_pair
from distillspec.models.pretrained import draft_vocab_ids, prepare_pair
from distillspec.tasks.data import chat_prompts, load_task
from distillspec.training.losses import forward_logits

GAMMA = 5  #: the gamma of the expected-tau column


@torch.inference_mode()
def measure(logits: dict[float, tuple], keep: torch.Tensor | None) -> dict[str, float]:
    """alpha (T = 1), greedy agreement (T = 0) and the target's mass outside ``keep`` (a bool mask over the
    vocabulary; None: all of it) of the draft whose whole-vocabulary logits are ``logits``."""
    out = {}
    for temperature, name in ((1.0, "alpha"), (0.0, "greedy")):
        draft, target, mask = logits[temperature]
        if keep is not None:
            draft = draft.masked_fill(~keep, float("-inf"))
        out[name] = alpha_from_tvd(draft, target, mask, temperature)
    draft, target, mask = logits[1.0]
    outside = 0.0 if keep is None else torch.softmax(target, -1)[..., ~keep].sum(-1)[mask.bool()].mean()
    out["outside"] = float(outside)
    out["tau"] = expected_tau(out["alpha"], GAMMA)
    return out


def suite_draft_vocab(
    overrides: list[str],
    *,
    sizes: list[int],
    samples: list[int],
    held: int,
    max_new_tokens: int,
    out: Path,
    vocab_from: list[str] | None = None,
) -> dict:
    """The whole suite (see the module docstring); ``vocab_from``: the data sets to count vocabularies on (None: the
    held-out questions' own)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [*overrides, "draft_vocab=0"])
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype, prepack=cfg.prepack)
    start = time.perf_counter()
    sets = held_out(target, draft, tokenizer, task.test[:held], max_new_tokens=max_new_tokens, seed=cfg.seed)
    with torch.inference_mode():
        logits = {t: (forward_logits(draft, b).float(), tl, b.window_mask) for t, (b, tl) in sets.items()}
    del target, sets
    print(f"held-out target samples and both models' logits: {time.perf_counter() - start:.0f} s")
    prompted = lambda d: chat_prompts(load_task(d, seed=cfg.seed), tokenizer, cfg.chat_template)
    sources = {Path(d).name: task if d == cfg.dataset else prompted(d) for d in vocab_from or [cfg.dataset]}
    rows = [{"size": logits[1.0][0].shape[-1], "samples": None, "counted_on": None, **measure(logits, None)}]
    for name, source in sources.items():
        for size in sizes:
            for n in samples:
                start = time.perf_counter()
                ids = draft_vocab_ids(cfg.draft, source, tokenizer, size, samples=n, seed=cfg.seed)
                keep = torch.zeros(rows[0]["size"], dtype=torch.bool)
                keep[ids] = True
                row = {"size": size, "samples": n, "counted_on": name, "seconds": time.perf_counter() - start}
                rows.append({**row, **measure(logits, keep)})
                print(format_row(rows[-1], rows[0]), flush=True)
    dataset = Path(cfg.dataset).name
    result = {"config": {"target": cfg.target, "draft": cfg.draft, "dataset": dataset, "held_out": held,
                         "tokens": max_new_tokens}}  # fmt: skip
    result["rows"] = rows
    (out / "draft_vocab.json").write_text(json.dumps(result, indent=1))
    (out / "draft_vocab.md").write_text(format_table(result) + "\n")
    print(format_table(result))
    return result


def format_row(row: dict, whole: dict) -> str:
    source = "whole vocabulary" if row["samples"] is None else f"text + samples of {row['samples']} prompts"
    if row["samples"] == 0:
        source = "the text"
    if row["counted_on"]:
        source = f"{row['counted_on']}: {source}"
    return (
        f"| {row['size']:,} | {source} | {row['alpha']:.4f} | {row['alpha'] - whole['alpha']:+.4f} | "
        f"{row['greedy']:.4f} | {row['greedy'] - whole['greedy']:+.4f} | {row['outside']:.4f} | {row['tau']:.3f} |"
    )


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"{cfg['held_out']} held-out questions of {cfg['dataset']} x {cfg['tokens']} "
        f"target-sampled tokens; tau expected at gamma {GAMMA}",
        "",
        "| tokens kept | chosen from | alpha (T = 1) | change | greedy (T = 0) | change | target mass outside | tau |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [format_row(row, result["rows"][0]) for row in result["rows"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=...)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768], help="draft vocabulary sizes")
    parser.add_argument(
        "--samples", type=int, nargs="+", default=[0, 64], help="draft_vocab_samples settings (0: the text alone)"
    )
    parser.add_argument("--held", type=int, default=32, help="held-out test questions")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens of each held-out target sample")
    parser.add_argument(
        "--vocab-from", nargs="+", metavar="DATASET", help="count vocabularies on these data sets (default: dataset=)"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/draft-vocab"))
    args = parser.parse_args()
    suite_draft_vocab(
        args.overrides,
        sizes=args.sizes,
        samples=args.samples,
        held=args.held,
        max_new_tokens=args.max_new_tokens,
        out=args.out,
        vocab_from=args.vocab_from,
    )


if __name__ == "__main__":
    run_main(main)
