"""Acceptance at T = 1 where the draft proposes at its own temperature: exact figures, no speculative decoding.

Speculative decoding stays exact whatever distribution the draft proposes from: the target accepts draft token x with
probability min(1, p(x) / q(x)) and resamples from the residual, both with the q the draft sampled from. So a draft
may propose from ``softmax(z / t)`` (its logits ``z`` at a temperature ``t`` of its own) while the target samples at
T = 1, and ``t`` below 1 sharpens a draft less sure than its target. alpha = 1 - E[TVD(p, q_t)] on fixed held-out
target samples (at T = 1, exactly, by speculative decoding) for each ``t`` and each draft; greedy decoding takes the
argmax, which no temperature moves. tau at gamma 3 and 5 is expected from alpha.

    python -m benchmarks.suites.draft_temperature target=qwen2.5-coder-1.5b-instruct \\
        draft=qwen2.5-coder-0.5b-instruct dataset=../shared/data/gsm8k draft_vocab=32768 \\
        --drafts outputs/trajectory-qwen-tvd-150/drafts/0 --temperatures 0.7 0.8 0.9 1.1 --held 32

Writes ``draft_temperature.json``, ``draft_temperature.md`` and ``draft_temperature.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.suites.trajectory import acceptance, held_out
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.decoding.metrics import expected_tau
from distillspec.evaluation.report import pyplot
from distillspec.models.draft_vocab import vocab_size
from distillspec.models.loading import load_model, load_pair
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task

GAMMAS = (3, 5)  #: the gammas of the expected-tau columns


def suite_draft_temperature(
    overrides: list[str], *, drafts: list[str], temperatures: list[float], held: int, max_new_tokens: int, out: Path
) -> dict:
    """The whole suite (see the module docstring): the job's draft first, then each of ``drafts``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype, prepack=cfg.prepack)
    start = time.perf_counter()
    sets = held_out(target, draft, tokenizer, task.test[:held], max_new_tokens=max_new_tokens, seed=cfg.seed)
    print(f"held-out target samples: {sets[1.0][0].tokens} tokens at T = 1 in {time.perf_counter() - start:.0f} s")
    grid = sorted({1.0, *temperatures})
    result = {"config": {"target": cfg.target, "held_out": held, "max_new_tokens": max_new_tokens}, "drafts": {}}
    vocab = vocab_size(target)
    for name in [cfg.draft, *drafts]:
        model = draft if name == cfg.draft else load_model(name, device=cfg.device)[0]
        scored = acceptance(model, sets, vocab, draft_temperatures=grid)
        result["drafts"][name] = {"greedy": scored["greedy"], "alpha": scored["alpha_at"]}
        best = max(scored["alpha_at"].items(), key=lambda kv: kv[1])
        print(f"{name}: alpha {scored['alpha']:.4f} at t = 1, {best[1]:.4f} at t = {best[0]}")
        (out / "draft_temperature.json").write_text(json.dumps(result, indent=1))
    (out / "draft_temperature.md").write_text(format_table(result) + "\n")
    plot(result, out / "draft_temperature.png")
    print(format_table(result))
    return result


def short(name: str, width: int = 48) -> str:
    """A draft's name for a table or a legend: its path's tail where the whole is long."""
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def format_table(result: dict) -> str:
    taus = " / ".join(str(g) for g in GAMMAS)
    lines = [
        f"alpha at T = 1 (1 - TVD) on {result['config']['held_out']} held-out questions, the draft proposing at "
        "temperature t; greedy agreement (T = 0) does not depend on t",
        "",
        f"| draft | t | alpha | change | E[tau] gamma {taus} | greedy |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["drafts"].items():
        base = row["alpha"]["1.0"]
        for t, alpha in row["alpha"].items():
            tau = " / ".join(f"{expected_tau(alpha, g):.3f}" for g in GAMMAS)
            lines.append(f"| {short(name)} | {t} | {alpha:.4f} | {alpha - base:+.4f} | {tau} | {row['greedy']:.4f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in result["drafts"].items():
        ax.plot([float(t) for t in row["alpha"]], list(row["alpha"].values()), "o-", label=short(name))
    ax.set(xlabel="draft temperature t (the target samples at T = 1)", ylabel="alpha (1 - TVD)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_vocab)"
    )
    parser.add_argument("--drafts", nargs="*", default=[], help="more drafts to score (folders, e.g. a run's drafts)")
    parser.add_argument(
        "--temperatures", nargs="+", type=float, default=[0.7, 0.8, 0.9, 1.1], help="draft temperatures besides 1"
    )
    parser.add_argument("--held", type=int, default=32, help="held-out test questions")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="target-sampled tokens per question")
    parser.add_argument("--out", type=Path, default=Path("outputs/draft-temperature"))
    args = parser.parse_args()
    suite_draft_temperature(
        args.overrides,
        drafts=args.drafts,
        temperatures=args.temperatures,
        held=args.held,
        max_new_tokens=args.max_new_tokens,
        out=args.out,
    )


if __name__ == "__main__":
    run_main(main)
