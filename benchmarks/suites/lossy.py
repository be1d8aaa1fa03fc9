"""Lossy speculative decoding on a named pair (the paper's Figure 5b): the task's score against latency, for each
lenience ``f(p, epsilon)`` (lin, sq, exp) over epsilon, with the undistilled draft and, given ``--distilled``, a
distilled one, at T = 1; ``--run DIR`` takes both, and the pair, from a jobs/distill.py run's folder. The lossless
setting (epsilon 1) samples exactly the target's distribution; the more lenient a setting, the more of the draft's
tokens it keeps, and the nearer the score comes to the draft's own (printed too).

    python -m benchmarks.suites.lossy --run outputs/qwen-async --settings lin:0.1 lin:0.02 sq:0.3 exp:0.4 \\
        --prompts 16 --max-new-tokens 512 --out outputs/lossy-qwen
    python -m benchmarks.suites.lossy target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k draft_vocab=32768 draft_int8=true --distilled DRAFT_FOLDER

The drafts decode as the job's measurements decode them (the pair's dtype, int8 where ``draft_int8`` says). Latency is
reported relative to the target alone, ``(c gamma + v(gamma + 1)) / tau``, from the step costs measured here at batch
1 (:func:`distillspec.decoding.metrics.measure_cost_ratio`) and each setting's tau; the batched decode's own tokens/s is
printed beside it. Writes ``lossy.json``, ``lossy.md`` and ``lossy.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.suites.analysis import plot_lenience
from benchmarks.suites.common import run_pair
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.decoding.metrics import measure_cost_ratio
from distillspec.decoding.speculative import LENIENCES
from distillspec.errors import DistillSpecError
from distillspec.evaluation.study import draft_score, measure_pair
from distillspec.models.loading import encode_prompts, load_decoding_draft, load_decoding_pair
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task


def parse_setting(text: str) -> tuple[str, float]:
    """``lin:0.1`` -> ("lin", 0.1): a lenience and its epsilon, checked."""
    name, _, value = text.partition(":")
    try:
        epsilon = float(value)
    except ValueError:
        epsilon = -1.0
    if name not in LENIENCES or not 0 < epsilon <= 1:
        raise DistillSpecError(
            f"--settings {text!r}: write LENIENCE:EPSILON, LENIENCE one of {sorted(LENIENCES)}, 0 < EPSILON <= 1"
        )
    return name, epsilon


def lenience_points(
    target,
    draft,
    tokenizer,
    task,
    *,
    label: str,
    settings: list[tuple[str | None, float]],
    gamma: int,
    cost,
    num_prompts: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 32,
) -> list[dict]:
    """Lossy SD with ``draft`` at T = 1 for each (lenience, epsilon) of ``settings``: the task's score, alpha, tau
    and the latency relative to the target alone, ``(c gamma + v) / tau`` from ``cost`` (a
    :class:`~distillspec.decoding.metrics.CostRatio`), each record marked with the draft's ``label``."""
    points = []
    for lenience, epsilon in settings:
        (r,) = measure_pair(
            target,
            draft,
            tokenizer,
            task,
            gammas=[gamma],
            temperatures=[1.0],
            num_prompts=num_prompts,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            seed=seed,
            lenience=lenience,
            epsilon=epsilon,
        )
        r |= {"draft": label, "c": cost.c, "v": cost.v, "relative_latency": (cost.c * gamma + cost.v) / r["tau"]}
        points.append(r)
        print(
            f"  {lenience or 'lossless'} {epsilon:g}: {task.metric} {r[task.metric]:.3f}, alpha {r['alpha']:.3f}, "
            f"tau {r['tau']:.2f}, latency {r['relative_latency']:.3f} of the target's"
        )
    return points


def cut_warning(points: list[dict], max_new_tokens: int, metric: str) -> str | None:
    """What to say when the answers mostly ran to ``max_new_tokens``: the score then measures where they were cut."""
    length = sum(p["new_tokens"] / p["prompts"] for p in points) / len(points)
    if length <= 0.9 * max_new_tokens:
        return None
    return (
        f"the answers averaged {length:.0f} of the {max_new_tokens} tokens allowed: most were cut, and the {metric} "
        "measures the cut; raise --max-new-tokens"
    )


def suite_lossy(
    overrides: list[str],
    *,
    settings: list[tuple[str, float]],
    distilled: Path | None,
    run: Path | None = None,
    gamma: int,
    prompts: int,
    max_new_tokens: int,
    batch_size: int,
    out: Path,
) -> dict:
    """The whole suite (see the module docstring)."""
    if run is not None:
        cfg, task, distilled = run_pair(run, overrides)
    else:
        cfg = load_config(None, overrides)
        cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    if task.metric is None:
        raise DistillSpecError(f"dataset={cfg.dataset}: a language-modelling task has no score to trade for latency")
    if distilled is not None and not (distilled / "config.json").exists():
        raise DistillSpecError(f"--distilled {distilled}: not a model folder (a run's draft/, say)")
    target, draft, tokenizer = load_decoding_pair(cfg.models)
    drafts = {"raw": draft}
    if distilled is not None:
        drafts["distilled"] = load_decoding_draft(
            str(distilled), device=cfg.device, dtype=target.dtype, int8=cfg.draft_int8
        )[0]
    ids, _ = encode_prompts(tokenizer, [task.test[0].prompt])
    points, own = [], {}
    for label, model in drafts.items():
        cost = measure_cost_ratio(target, model, ids.to(target.device), gamma=gamma)
        own[label] = draft_score(
            model, tokenizer, task, num_prompts=prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
        )
        print(
            f"== lossy: {label} draft, c {cost.c:.3f}, v {cost.v:.2f}; alone (greedy) {task.metric} "
            f"{own[label][task.metric]:.3f}"
        )
        points += lenience_points(
            target,
            model,
            tokenizer,
            task,
            label=label,
            settings=[(None, 1.0), *settings],
            gamma=gamma,
            cost=cost,
            num_prompts=prompts,
            max_new_tokens=max_new_tokens,
            seed=cfg.seed,
            batch_size=batch_size,
        )
    result = {
        "config": {
            "target": cfg.target,
            "draft": cfg.draft,
            "distilled": str(distilled) if distilled else None,
            "dtype": cfg.dtype,
            "draft_int8": cfg.draft_int8,
            "gamma": gamma,
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "metric": task.metric,
        },
        "draft_alone": own,
        "points": points,
    }
    if warning := cut_warning(points, max_new_tokens, task.metric):
        result["warning"] = warning
    out.mkdir(parents=True, exist_ok=True)
    (out / "lossy.json").write_text(json.dumps(result, indent=1))
    (out / "lossy.md").write_text(format_table(result) + "\n")
    plot_lenience(
        points, task.metric, out / "lossy.png", title=f"{Path(cfg.target).name}: lossy SD, gamma={gamma}, T=1"
    )
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    c, metric = result["config"], result["config"]["metric"]
    lines = [
        f"{Path(c['target']).name} / {Path(c['draft']).name}, {c['dtype']}"
        f"{', int8 drafts' if c['draft_int8'] else ''}, "
        f"gamma {c['gamma']}, T = 1, {c['prompts']} test prompts x {c['max_new_tokens']} tokens",
        "",
        f"| draft | lenience | epsilon | {metric} | alpha | tau | latency / target alone | batched tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['draft']} | {p['lenience'] or 'lossless'} | {p['epsilon']:g} | {p[metric]:.3f} | {p['alpha']:.3f} | "
            f"{p['tau']:.2f} | {p['relative_latency']:.3f} | {p['new_tokens'] / p['seconds']:.1f} |"
        )
    for label, own in result["draft_alone"].items():
        lines.append(f"| {label}, alone (greedy) | | | {own[metric]:.3f} | | | | |")
    if "warning" in result:
        lines += ["", f"Warning: {result['warning']}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_int8=...)"
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["lin:0.1", "lin:0.02", "sq:0.3", "exp:0.4"],
        help="lossy settings LENIENCE:EPSILON (the lossless one is always run)",
    )
    parser.add_argument("--distilled", type=Path, default=None, help="a distilled draft folder (a run's draft/)")
    parser.add_argument("--run", type=Path, default=None, help="a jobs/distill.py output folder: its pair and draft")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16, help="test prompts (the score's sample)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="enough for an answer to end")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("outputs/lossy"))
    args = parser.parse_args()
    suite_lossy(
        args.overrides,
        settings=[parse_setting(s) for s in args.settings],
        distilled=args.distilled,
        run=args.run,
        gamma=args.gamma,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        out=args.out,
    )


if __name__ == "__main__":
    run_main(main)
