"""Benchmarks that print figures and ratios and write JSON (suites chosen by name).

    python jobs/benchmark.py async                 # asynchronous pipeline vs the synchronous loop
    python jobs/benchmark.py async --budget 300 garden.cache_dir=.cache/garden

Suite ``async``: the same garden pair, data and recipe, trained for the same wall-clock budget by
``ray.mode=sync`` (one process: sample, then update) and by ``ray.mode=async`` (rollout actors sample while
the Ray Train learner updates). Reports tokens trained per second and the acceptance rate alpha reached
(gamma = eval.speedup_gamma, T = 1, held-out prompts). Goal: async >= 1.3x tokens/s at equal or better alpha.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distillspec.cli import run_main  # noqa: E402
from distillspec.config import load_config  # noqa: E402


def suite_async(overrides: list[str], budget: float, out: Path) -> dict:
    from jobs.distill import main  # noqa: PLC0415

    rows = {}
    for mode in ("sync", "async"):
        cfg = load_config(
            None,
            [
                f"output_dir={out / mode}",
                f"distill.time_budget_s={budget}",
                "distill.steps=100000",  # the budget stops training; the cosine schedule stays near its peak
                "distill.checkpoint_every=0",
                "eval.gammas=[5]",
                "eval.temperatures=[1]",
                "eval.speedup_prompts=0",
                *overrides,
                f"ray.mode={mode}",
            ],
        )
        records = main(cfg)
        log = json.loads((out / mode / "train_log.json").read_text())
        before, after = (next(r for r in records if r["phase"] == p) for p in ("before", "after"))
        seconds = log[-1]["time"] if log else float("nan")
        rows[mode] = {
            "steps": len(log),
            "train_seconds": seconds,
            "tokens": sum(r["tokens"] for r in log),
            "tokens_per_s": sum(r["tokens"] for r in log) / seconds,
            "alpha_before": before["alpha"],
            "alpha_after": after["alpha"],
            "tau_before": before["tau"],
            "tau_after": after["tau"],
            "mean_lag": sum(r.get("lag", 0) for r in log) / max(1, len(log)),
        }
    rows["ratio_tokens_per_s"] = rows["async"]["tokens_per_s"] / rows["sync"]["tokens_per_s"]
    rows["alpha_gap"] = rows["async"]["alpha_after"] - rows["sync"]["alpha_after"]
    print(f"\nasync vs sync, {budget:.0f} s of training each:")
    print(
        f"{'mode':>6} {'steps':>6} {'tokens/s':>9} {'alpha before':>12} {'alpha after':>11} {'tau after':>9} {'lag':>5}"
    )
    for mode in ("sync", "async"):
        r = rows[mode]
        print(
            f"{mode:>6} {r['steps']:>6} {r['tokens_per_s']:>9.1f} {r['alpha_before']:>12.3f} {r['alpha_after']:>11.3f} "
            f"{r['tau_after']:>9.3f} {r['mean_lag']:>5.2f}"
        )
    print(f"tokens/s ratio async/sync: {rows['ratio_tokens_per_s']:.2f}x; alpha async - sync: {rows['alpha_gap']:+.3f}")
    return rows


SUITES = {"async": suite_async}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="+", choices=sorted(SUITES), help="benchmark suites to run")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds of training per mode (suite async)")
    parser.add_argument("--output-dir", default="outputs/benchmark")
    parser.add_argument("overrides", nargs="*", default=[], help="config overrides, e.g. garden.cache_dir=...")
    args, extra = parser.parse_known_args()
    out = Path(args.output_dir).resolve()
    for name in args.suites:
        result = SUITES[name](args.overrides + extra, args.budget, out / name)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {out / f'{name}.json'}")


if __name__ == "__main__":
    run_main(main)
