"""Tables and plots of ``results.json`` records, and the summary of a recipe grid's trials (``jobs/sweep.py``)."""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path


def _pairs(records: list[dict]) -> list[tuple[dict, dict]]:
    before = {(r["gamma"], r["temperature"]): r for r in records if r["phase"] == "before"}
    return [
        (before[(r["gamma"], r["temperature"])], r)
        for r in records
        if r["phase"] == "after" and (r["gamma"], r["temperature"]) in before
    ]


def _speedup(record: dict) -> str:
    if "measured_speedup" not in record:
        return "-"
    if "speedup_min" not in record:
        return f"{record['measured_speedup']:.2f}x"
    return f"{record['measured_speedup']:.2f}x ({record['speedup_min']:.2f}-{record['speedup_max']:.2f})"


def format_table(records: list[dict]) -> str:
    """gamma x temperature: alpha and tau before / after, the change in tau, and speedups where measured."""
    lines = [
        f"{'gamma':>5} {'temp':>5} | {'alpha before':>12} {'alpha after':>11} | "
        f"{'tau before':>10} {'tau after':>9} {'change':>8}"
        f" | {'speedup before':>18} {'speedup after':>18}"
    ]
    lines.append("-" * len(lines[0]))
    for b, a in _pairs(records):
        change = 100.0 * (a["tau"] / b["tau"] - 1.0)
        sb, sa = (_speedup(r) for r in (b, a))
        lines.append(
            f"{b['gamma']:>5} {b['temperature']:>5g} | {b['alpha']:>12.3f} {a['alpha']:>11.3f} | "
            f"{b['tau']:>10.3f} {a['tau']:>9.3f} {change:>+7.1f}% | {sb:>18} {sa:>18}"
        )
    repeats = {r.get("speedup_repeats") for r in records if "measured_speedup" in r}
    if repeats:
        lines.append(
            f"speedups: tokens/s of SD over the target alone's, both drafts and the target alone decoding each prompt "
            f"in turn, {max(r or 1 for r in repeats)} passes: mean (min-max over passes); after the first block: "
            "the same without each call's time to its first tokens (the prompt's prefill)"
        )
    for r in records:
        if "measured_speedup" in r:
            decode = f"{r['decode_speedup']:.2f}x" if "decode_speedup" in r else "-"
            lines.append(
                f"{r['phase']:>6} gamma={r['gamma']} T={r['temperature']:g}: c={r['c']:.3f}, "
                f"speedup {r['measured_speedup']:.2f}x, after the first block {decode} / predicted "
                f"tau/(c*gamma+1) {r['predicted_speedup']:.2f}x = {r['measured_over_predicted']:.2f}; "
                f"with the verify cost v={r['v']:.2f}: {r['measured_over_predicted_with_v']:.2f}"
            )
    return "\n".join(lines)


def _wrapped(title: str, fig) -> str:
    """``title`` in lines as wide as ``fig`` holds at font size 10 (about 13 characters an inch)."""
    return textwrap.fill(title, int(13 * fig.get_figwidth()))


def plot_tau(records: list[dict], path: str | Path, title: str = "") -> None:
    """Grouped bars of tau before / after per (gamma, temperature), with the gamma + 1 ceiling."""
    import matplotlib  # noqa: PLC0415 (matplotlib, optional)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib, optional)

    pairs = _pairs(records)
    labels = [f"γ={b['gamma']}\nT={b['temperature']:g}" for b, _ in pairs]
    x = range(len(pairs))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(pairs)), 4))
    ax.bar([i - 0.2 for i in x], [b["tau"] for b, _ in pairs], 0.4, label="before (undistilled draft)", color="#9bb")
    ax.bar([i + 0.2 for i in x], [a["tau"] for _, a in pairs], 0.4, label="after (distilled draft)", color="#157")
    for i, (b, a) in enumerate(pairs):
        ceiling = "γ + 1 (every draft accepted)" if i == 0 else None
        ax.hlines(b["gamma"] + 1, i - 0.4, i + 0.4, colors="grey", linestyles=":", label=ceiling)
        ax.text(i + 0.2, a["tau"], f"{100 * (a['tau'] / b['tau'] - 1):+.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("block efficiency τ (tokens / target call)")
    ax.set_title(_wrapped(title, fig), fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_training(train_log: list[dict], evaluations: list[dict], path: str | Path, title: str = "") -> None:
    """Loss per learner step and, when the evaluation actor ran, alpha and tau per draft version."""
    import matplotlib  # noqa: PLC0415 (matplotlib, optional)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib, optional)

    panels = 2 if evaluations else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in train_log], [r["loss"] for r in train_log], lw=0.8, color="#157")
    ax.set_xlabel("learner step")
    ax.set_ylabel("divergence (loss)")
    if evaluations:
        ax = axes[0][1]
        steps = [r.get("step", r["version"]) for r in evaluations]
        ax.plot(steps, [r["alpha"] for r in evaluations], "o-", color="#157", label="alpha")
        ax.set_xlabel("learner step of the draft")
        ax.set_ylabel("acceptance rate alpha")
        twin = ax.twinx()
        twin.plot(steps, [r["tau"] for r in evaluations], "s--", color="#c63", label="tau")
        twin.set_ylabel("block efficiency tau")
        ax.legend(loc="lower left", fontsize=8)
        twin.legend(loc="lower right", fontsize=8)
    fig.suptitle(_wrapped(title, fig), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pyplot():
    import matplotlib  # noqa: PLC0415 (matplotlib, optional)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib, optional)

    return plt


def plot_recipe_grid(sweep: dict, path: str | Path) -> None:
    """Figure 4 analogue: tau gain (%) per data source x divergence, one panel per temperature."""
    plt = pyplot()
    cells = {(c["source"], c["divergence"]): c for c in sweep["cells"]}
    sources = [s for s in ("fixed", "draft", "target", "mixed") if any(k[0] == s for k in cells)]
    divergences = [d for d in ("fkl", "jsd", "rkl", "tvd") if any(k[1] == d for k in cells)]
    temps = sorted({k[len("tau_gain_") :] for c in sweep["cells"] for k in c if k.startswith("tau_gain_")})
    score = next((k for k in sweep["cells"][0] if k.startswith("draft_") and k != "draft_seconds_per_token"), None)
    fig, axes = plt.subplots(1, len(temps), figsize=(5.4 * len(temps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps):
        grid = [
            [cells[(s, d)][f"tau_gain_{t}"]["mean"] * 100 if (s, d) in cells else float("nan") for d in divergences]
            for s in sources
        ]
        finite = [abs(v) for row in grid for v in row if not math.isnan(v)]
        limit = max([5.0, *finite])
        image = ax.imshow(grid, cmap="RdYlGn", vmin=-limit, vmax=limit)
        for i, s in enumerate(sources):
            for j, d in enumerate(divergences):
                if (s, d) in cells:
                    c = cells[(s, d)]
                    text = f"{c[f'tau_gain_{t}']['mean'] * 100:+.1f}%"
                    if c[f"tau_gain_{t}"]["n"] > 1:
                        text += f"\n±{c[f'tau_gain_{t}']['std'] * 100:.1f}"
                    if score:
                        text += f"\n{score[6:][:5]} {c[score]['mean']:.2f}"
                    ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(divergences)), [d.upper() for d in divergences])
        ax.set_yticks(range(len(sources)), sources)
        ax.set_title(f"tau gain, gamma={sweep['gamma']}, {t.replace('T', 'T=')}", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"{sweep['task']}: recipe grid, {sweep['steps']} steps a cell", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, standard deviation (0 for one value), min and max of ``values``."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarise(trials: list[dict], rank: str) -> list[dict]:
    """One row per (source, divergence): every reported metric as mean/std/min/max over the seeds."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for t in trials:
        cells.setdefault((t["source"], t["divergence"]), []).append(t)
    rows = []
    for (source, divergence), group in cells.items():
        keys = [k for k, v in group[0]["metrics"].items() if isinstance(v, int | float)]
        rows.append(
            {
                "source": source,
                "divergence": divergence,
                "seeds": [t["seed"] for t in group],
                **{k: spread([t["metrics"][k] for t in group]) for k in keys},
            }
        )
    return sorted(rows, key=lambda r: -r[rank]["mean"])


def format_sweep(result: dict) -> str:
    rank = result["rank"]
    temps = sorted({k.split("_")[-1] for c in result["cells"] for k in c if k.startswith("tau_gain_")})
    head = f"{'source':>7} {'divergence':>10} " + " ".join(f"{'tau gain ' + t:>16}" for t in temps)
    lines = [head, "-" * len(head)]
    for c in result["cells"]:
        gains = " ".join(
            f"{100 * c[f'tau_gain_{t}']['mean']:>+9.1f}% ±{100 * c[f'tau_gain_{t}']['std']:>4.1f}" for t in temps
        )
        lines.append(f"{c['source']:>7} {c['divergence']:>10} {gains}")
    b = result["best"]
    lines.append(
        f"best recipe on {result['task']}: {b['source']} data + {b['divergence'].upper()} "
        f"({rank} {b[rank]['mean']:+.3f})"
    )
    return "\n".join(lines)
