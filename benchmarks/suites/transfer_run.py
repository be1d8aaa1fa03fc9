"""A distilled run's draft on tasks it never trained on: alpha and tau before -> after distillation on the test
prompts of the run's own task and of each other data set named (the paper's question of transfer), every task
through the target's chat template, at each gamma and temperature. The drafts decode as the run's measurements
decoded them (the pair's dtype, int8 where the run's ``draft_int8`` says).

    python -m benchmarks.suites.transfer_run --run outputs/qwen-async --datasets ../shared/data/multi30k \\
        ../shared/data/tinyshakespeare --gammas 5 --temperatures 0 1 --prompts 16 --out outputs/transfer-qwen

Writes ``transfer.json`` and ``transfer.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.suites.common import run_pair
from distillspec.cli import run_main
from distillspec.evaluation.study import measure_pair
from distillspec.models.loading import load_decoding_draft, load_decoding_pair
from distillspec.tasks.data import chat_prompts, load_task


def before_after(target, draft, student, tokenizer, task, *, desc: str | None = None, **measure) -> list[dict]:
    """alpha and tau of ``draft`` (undistilled) and ``student`` (distilled) on ``task``'s test prompts at each gamma
    and temperature of ``measure`` (:func:`~distillspec.evaluation.study.measure_pair`'s keywords), and tau's gain."""
    before = measure_pair(target, draft, tokenizer, task, **measure, desc=desc and f"{desc}, undistilled")
    after = measure_pair(target, student, tokenizer, task, **measure, desc=desc and f"{desc}, distilled")
    return [
        {
            "gamma": b["gamma"],
            "temperature": b["temperature"],
            "alpha_before": b["alpha"],
            "alpha_after": a["alpha"],
            "tau_before": b["tau"],
            "tau_after": a["tau"],
            "tau_gain": a["tau"] / b["tau"] - 1.0,
        }
        for b, a in zip(before, after, strict=True)
    ]


def suite_transfer_run(
    run: Path,
    overrides: list[str],
    *,
    datasets: list[str],
    gammas: list[int],
    temperatures: list[float],
    prompts: int,
    max_new_tokens: int,
    batch_size: int,
    out: Path,
) -> dict:
    """The whole suite (see the module docstring)."""
    cfg, task, distilled = run_pair(run, overrides)
    target, draft, tokenizer = load_decoding_pair(cfg.models)
    student = load_decoding_draft(str(distilled), device=cfg.device, dtype=target.dtype, int8=cfg.draft_int8)[0]
    tasks = {Path(cfg.dataset).name: task}
    for dataset in datasets:
        tasks[Path(dataset).name] = chat_prompts(load_task(dataset, seed=cfg.seed), tokenizer, cfg.chat_template)
    kw = {"gammas": gammas, "temperatures": temperatures, "num_prompts": prompts, "max_new_tokens": max_new_tokens,
          "batch_size": batch_size, "seed": cfg.seed}  # fmt: skip
    rows = []
    for name, t in tasks.items():
        for row in before_after(target, draft, student, tokenizer, t, desc=name, **kw):
            rows.append({"task": name, "trained_on": t is task, **row})
    result = {
        "config": {
            "run": str(run),
            "target": cfg.target,
            "draft": cfg.draft,
            "distilled": str(distilled),
            "dtype": cfg.dtype,
            "draft_int8": cfg.draft_int8,
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
        },  # fmt: skip
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(result, indent=1))
    (out / "transfer.md").write_text(format_table(result) + "\n")
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"the draft of {c['run']} ({Path(c['target']).name} target, {c['dtype']}"
        f"{', int8 drafts' if c['draft_int8'] else ''}), {c['prompts']} test prompts x {c['max_new_tokens']} tokens",
        "",
        "| task | gamma | T | alpha before | alpha after | tau before | tau after | change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        task = f"{r['task']} (trained on)" if r["trained_on"] else r["task"]
        lines.append(
            f"| {task} | {r['gamma']} | {r['temperature']:g} | {r['alpha_before']:.3f} | {r['alpha_after']:.3f} | "
            f"{r['tau_before']:.3f} | {r['tau_after']:.3f} | {100 * r['tau_gain']:+.1f}% |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys over the run's (device=..., dtype=...)")
    parser.add_argument("--run", type=Path, required=True, help="a jobs/distill.py output folder")
    parser.add_argument("--datasets", nargs="+", required=True, help="other tasks (local folders or names)")
    parser.add_argument("--gammas", type=int, nargs="+", default=[5])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=16, help="test prompts of each task")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("outputs/transfer-run"))
    args = parser.parse_args()
    suite_transfer_run(
        args.run,
        args.overrides,
        datasets=args.datasets,
        gammas=args.gammas,
        temperatures=args.temperatures,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        out=args.out,
    )


if __name__ == "__main__":
    run_main(main)
