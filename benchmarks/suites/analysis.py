"""The analyses and figures of the results pages (docs/RESULTS*.md) that the product itself does not use:
races between training curves, batch-1 latency, and the theory, lenience, garden and peer plots."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
from distillspec.evaluation.report import pyplot
from distillspec.models.loading import encode_prompts


def time_to_alpha(curve: list[dict], alpha: float) -> float | None:
    """The first ``seconds`` of a training curve (``{"seconds", "alpha"}`` points) where alpha >= ``alpha``."""
    return next((p["seconds"] for p in curve if p["alpha"] >= alpha), None)


def race(ours: list[dict], theirs: list[dict]) -> dict:
    """Time for each of two training curves (their first point: the common start) to reach the same alpha.

    The goal is the lower of the two best alphas after the start, so both reach it; ``ratio`` is our time over
    theirs (None when neither raised alpha above the start).
    """
    start = ours[0]["alpha"]
    goal = min(max(p["alpha"] for p in ours[1:]), max(p["alpha"] for p in theirs[1:]))
    if goal <= start:
        return {"goal_alpha": goal, "seconds_ours": None, "seconds_theirs": None, "ratio": None}
    t_ours, t_theirs = time_to_alpha(ours[1:], goal), time_to_alpha(theirs[1:], goal)
    return {"goal_alpha": goal, "seconds_ours": t_ours, "seconds_theirs": t_theirs, "ratio": t_ours / t_theirs}


@torch.inference_mode()
def latency_per_token(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    gamma: int,
    max_new_tokens: int,
) -> float:
    """Seconds per generated token at batch 1, greedy: ``target`` alone (``draft`` None) or with SD."""
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        ids, _ = encode_prompts(tokenizer, [prompt])
        ids = ids.to(target.device)
        kw = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "temperature": 0.0}
        start = time.perf_counter()
        if draft is None:
            out = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens, **kw)
        else:
            out = speculative_generate(target, draft, ids, gamma=gamma, max_new_tokens=max_new_tokens, **kw)
        seconds += time.perf_counter() - start
        tokens += int(out.num_new_tokens.sum())
    return seconds / max(1, tokens)


def plot_theory(points: list[dict], path: str | Path) -> None:
    """Figure 3c analogue: tau predicted from alpha = 1 - E[TVD] vs tau measured, one point per model."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    markers = {"T0": "o", "T1": "^"}
    tasks = sorted({p["task"] for p in points})
    for i, task in enumerate(tasks):
        for temp, marker in markers.items():
            sel = [p for p in points if p["task"] == task and p["temperature"] == temp]
            if sel:
                ax.scatter(
                    [p["tau_theory"] for p in sel],
                    [p["tau"] for p in sel],
                    marker=marker,
                    s=18,
                    color=f"C{i}",
                    label=f"{task}, {temp.replace('T', 'T=')}",
                )
    lo = min(min(p["tau"], p["tau_theory"]) for p in points)
    hi = max(max(p["tau"], p["tau_theory"]) for p in points)
    ax.plot([lo, hi], [lo, hi], color="grey", ls=":", lw=1, label="y = x")
    ax.set_xlabel("tau from TVD: (1 - alpha^(gamma+1)) / (1 - alpha)")
    ax.set_ylabel("tau measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lenience(points: list[dict], metric: str, path: str | Path, title: str = "") -> None:
    """Figure 5b analogue: task score vs latency relative to the target alone, per draft and lenience."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    styles = {"raw": "--", "distilled": "-"}
    colors = {"lin": "C0", "sq": "C1", "exp": "C2"}
    for draft, ls in styles.items():
        lossless = next((p for p in points if p["draft"] == draft and p["lenience"] is None), None)
        if lossless is None:
            continue
        ax.scatter(
            [lossless["relative_latency"]],
            [lossless[metric]],
            marker="*",
            s=90,
            color="k" if draft == "distilled" else "grey",
            zorder=3,
            label=f"{draft} draft, lossless",
        )
        for f, color in colors.items():
            sel = sorted((p for p in points if p["draft"] == draft and p["lenience"] == f), key=lambda p: -p["epsilon"])
            if not sel:
                continue  # a lenience not measured: no line, no legend entry
            ax.plot(
                [lossless["relative_latency"]] + [p["relative_latency"] for p in sel],
                [lossless[metric]] + [p[metric] for p in sel],
                ls=ls,
                marker=".",
                color=color,
                label=f"{draft} draft, {f}",
            )
    ax.set_xlabel("latency / target-only latency  ((c*gamma + v) / tau)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_garden(points: list[dict], metric: str, path: str | Path, title: str = "") -> None:
    """Figure 6 analogue: task score vs milliseconds per token for each kind of model over the sizes."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, kind in enumerate(("raw", "distilled", "speculative", "DistillSpec")):
        sel = sorted((p for p in points if p["kind"] == kind), key=lambda p: p["seconds_per_token"])
        ax.plot(
            [1e3 * p["seconds_per_token"] for p in sel],
            [p["score"] for p in sel],
            marker="o",
            color=f"C{i}",
            label=kind,
        )
        for p in sel:
            ax.annotate(
                p["label"],
                (1e3 * p["seconds_per_token"], p["score"]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set_xlabel("ms per token (batch 1, greedy)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_peer_curves(curves: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """alpha against training seconds (evaluations left out), one line per system."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, curve in curves.items():
        ax.plot([p["seconds"] for p in curve], [p["alpha"] for p in curve], marker="o", label=name)
    ax.set_xlabel("training seconds")
    ax.set_ylabel("acceptance rate alpha")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_async(logs: dict[str, list[dict]], path: str | Path, window: int = 10) -> None:
    """The pipelines of suite async over wall-clock time: learner steps, and the training loss (mean of the last
    ``window`` steps), one line per pipeline (``logs``: its ``train_log.json`` records)."""
    plt = pyplot()
    fig, (steps, loss) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, log in logs.items():
        seconds = [r["time"] for r in log]
        steps.plot(seconds, [r["step"] for r in log], label=name)
        losses = [r["loss"] for r in log]
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / min(window, i + 1) for i in range(len(losses))]
        loss.plot(seconds, smooth, label=name)
    steps.set_xlabel("training seconds")
    steps.set_ylabel("learner steps")
    loss.set_xlabel("training seconds")
    loss.set_ylabel(f"training loss (mean of {window} steps)")
    steps.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
