"""Held-out acceptance along the first steps of distillation, for several learner settings side by side: a cheap
look at whether a recipe, a learning rate or a divergence moves a draft toward its target before a long run.

Each setting starts from the same draft and takes ``--steps`` learner steps (sampling as its recipe says, Algorithm
A.2); every ``--every`` steps the draft is scored on fixed held-out sequences sampled from the target (exactly, by
speculative decoding) at T = 1 and greedily: ``alpha`` = 1 - E[TVD(p, q)] at T = 1 on the first (Eq. 3: the
acceptance rate at T = 1) and ``greedy`` = the share of positions where the two argmaxes agree on the second (the
acceptance rate at T = 0). No speculative decoding runs after the start, so a step costs what a learner step costs.

    python -m benchmarks.suites.trajectory target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k draft_vocab=32768 distill.batch_size=8 distill.max_new_tokens=48 \\
        --settings "distill.lr=3e-5" "distill.lr=3e-6" "distill.lr=3e-6 distill.divergence=fkl" --steps 8

With ``--train-on held`` the learner's questions are the held-out questions themselves (its samples of them are still
its own): what a recipe buys where it has already seen every question it is measured on, a ceiling for what more
questions of the same kind could buy it. ``--unseen N`` scores N more test questions beside them, which the learner
never sees: what training on a few questions over and over (a stream of repeated prompts) does to new ones.
``--steps 0`` without ``--settings`` scores the draft alone (``draft=<its folder>``, a draft distilled elsewhere). The
target's held-out samples are exact whatever draft proposes them, but which tokens they are depends on the draft the
suite loads: two drafts scored in two runs are scored on other draws of the same questions, which move alpha by as
much as a point. To compare drafts on the same draws, score them in one run:
``benchmarks/suites/acceptance_by_kind.py`` (or ``draft_temperature.py``) with ``--drafts``.

Writes ``trajectory.json`` (after every evaluation), ``trajectory.md`` (a row per setting and evaluation) and
``trajectory.png``; with ``--keep-drafts``, each setting's draft as of its last evaluation in ``drafts/N``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import resource
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.decoding.metrics import position_tvd
from distillspec.evaluation.report import pyplot
from distillspec.files import write_folder
from distillspec.models.draft_vocab import d2t, expand_logits, vocab_size
from distillspec.models.loading import load_pair
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task
from distillspec.training.batches import Batch
from distillspec.training.learner import Learner
from distillspec.training.losses import forward_logits
from distillspec.training.rollout import Sampler, generate_batch


@torch.inference_mode()
def held_out(target, draft, tokenizer, examples, *, max_new_tokens: int, seed: int) -> dict[float, tuple]:
    """Target samples (by speculative decoding, exact) at T = 1 and T = 0 on ``examples``, each with what scores a
    draft on it: the target's logits over the T = 1 samples, its argmax over the greedy ones
    (``{temperature: (batch, target logits or argmax)}``)."""
    generator = torch.Generator(device=target.device).manual_seed(seed)
    sets = {}
    for temperature in (1.0, 0.0):
        batch = generate_batch(
            "target",
            target,
            draft,
            tokenizer,
            examples,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=generator,
        )
        logits = forward_logits(target, batch)
        sets[temperature] = (batch, logits.float() if temperature > 0 else logits.argmax(-1))
    return sets


@torch.inference_mode()
def position_acceptance(
    draft, sets: dict[float, tuple], vocab: int, *, rows: int = 4, draft_temperatures: Sequence[float] = ()
) -> dict[float, dict[float, torch.Tensor]]:
    """The acceptance of ``draft`` at each position of the held-out sets, ``rows`` sequences at a time (a
    whole-vocabulary distribution over every held-out position would take gigabytes): ``1 - TVD(p, q_t)`` on the
    T = 1 set, for t = 1 and each of ``draft_temperatures`` (the draft's logits divided by t), and the argmax
    agreement (0 or 1) on the greedy set; ``{set temperature: {t: [rows, columns of Batch.window_mask]}}``, 0 where
    the window mask is 0."""
    ids, out = d2t(draft), {}
    for temperature in (1.0, 0.0):
        batch, target = sets[temperature]
        temperatures = dict.fromkeys((1.0, *draft_temperatures) if temperature > 0 else (1.0,))  # each t once
        parts: dict[float, list[torch.Tensor]] = {t: [] for t in temperatures}
        for start in range(0, batch.input_ids.shape[0], rows):
            part = slice(start, start + rows)
            mask = batch.window_mask[part].float()
            piece = Batch(batch.input_ids[part], batch.attention_mask[part], batch.loss_mask[part])
            logits = expand_logits(forward_logits(draft, piece, start=batch.window).float(), ids, vocab)
            for t in temperatures:  # t = 1 scores the logits as they are, without a copy
                scaled = logits if t == 1.0 else logits / t
                parts[t].append((1.0 - position_tvd(scaled, target[part], temperature)) * mask)
        out[temperature] = {t: torch.cat(values) for t, values in parts.items()}
    return out


def acceptance(
    draft, sets: dict[float, tuple], vocab: int, *, rows: int = 4, draft_temperatures: Sequence[float] = ()
) -> dict[str, Any]:
    """``alpha`` (T = 1) and ``greedy`` (T = 0) of ``draft`` on the held-out sets (see the module docstring): the means
    of :func:`position_acceptance` over the positions scored. With ``draft_temperatures``, also ``alpha_at``: alpha at
    T = 1 where the draft proposes from its logits divided by each (``{str(t): alpha}``; speculative decoding stays
    exact whatever distribution the draft proposes from)."""
    scores = position_acceptance(draft, sets, vocab, rows=rows, draft_temperatures=draft_temperatures)
    means = {
        temperature: {
            t: float(v.sum()) / max(float(sets[temperature][0].window_mask.sum()), 1.0) for t, v in at.items()
        }
        for temperature, at in scores.items()
    }
    out: dict[str, Any] = {"alpha": means[1.0][1.0], "greedy": means[0.0][1.0]}
    if draft_temperatures:
        out["alpha_at"] = {str(t): means[1.0][t] for t in draft_temperatures}
    return out


def run_setting(
    cfg,
    target,
    draft,
    tokenizer,
    task,
    score: Callable[[torch.nn.Module], dict[str, Any]],
    *,
    steps: int,
    every: int,
    rows: list[dict],
    save: Callable[[], None],
    keep: Path | None = None,
    questions: list | None = None,
) -> list[dict]:
    """``steps`` learner steps of a copy of ``draft`` with ``cfg.distill`` on ``questions`` (default: the task's
    training split); the held-out acceptance (``score(model)``) every ``every``, appended to ``rows`` and saved
    (``save()``) as it comes, so a run stopped early keeps what it measured. With ``keep``, the draft as of each
    evaluation is written there too (``save_pretrained``, with the tokenizer): a ``draft=`` for the other suites and
    jobs."""
    model = copy.deepcopy(draft)
    learner = Learner(model, target, cfg.distill)
    sampler = Sampler(
        target, model, tokenizer, task.train if questions is None else questions, cfg.distill, seed=cfg.seed
    )
    for step in range(1, steps + 1):
        start = time.perf_counter()
        source, batch = sampler()
        record = learner.step(batch, source=source, wait_s=time.perf_counter() - start)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        print(
            f"  step {step}/{steps}: loss {record['loss']:.4f}, sampling {record['wait_s']:.1f} s, "
            f"update {record['compute_s']:.1f} s, peak memory {peak:.1f} GiB",
            flush=True,
        )
        if step % every == 0 or step == steps:
            rows.append({"step": step, "loss": record["loss"], "seconds": record["time"], **score(model)})
            save()
            if keep is not None:
                write_folder(keep, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
            print(f"  step {step}: held-out alpha {rows[-1]['alpha']:.4f}, greedy {rows[-1]['greedy']:.4f}", flush=True)
    return rows


def suite_trajectory(
    overrides: list[str],
    settings: list[str],
    *,
    steps: int,
    every: int,
    held: int,
    out: Path,
    keep_drafts: bool = False,
    train_on: str = "train",
    unseen: int = 0,
) -> dict:
    """The whole suite (see the module docstring)."""
    if steps > 0 and not settings:
        raise SystemExit("--settings: at least one learner setting to train (only --steps 0 scores the draft alone)")
    if unseen and train_on != "held":
        raise SystemExit(
            "--unseen N scores questions besides the held-out ones the learner trains on (--train-on held); "
            "the learner never sees the held-out questions otherwise: raise --held instead"
        )
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides)
    task = load_task(cfg.dataset, seed=cfg.seed)
    if len(task.test) < held + unseen:
        raise SystemExit(f"--unseen {unseen}: the task has {len(task.test)} test questions, {held} of them held out")
    cfg, task = prepare_pair(cfg, task)
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype, prepack=cfg.prepack)
    vocab = vocab_size(target)

    def target_samples(examples: list) -> dict[float, tuple]:
        return held_out(target, draft, tokenizer, examples, max_new_tokens=cfg.distill.max_new_tokens, seed=cfg.seed)

    start = time.perf_counter()
    sets = target_samples(task.test[:held])
    unseen_sets = target_samples(task.test[held : held + unseen]) if unseen else None
    tokens = {str(t): batch.tokens for t, (batch, _) in sets.items()}
    print(f"held-out target samples: {tokens} tokens in {time.perf_counter() - start:.0f} s")
    result = {
        "config": {
            "target": cfg.target,
            "draft": cfg.draft,
            "dtype": cfg.dtype,
            "held_out": held,
            "train_on": train_on,
            "unseen": unseen,
        }
    }

    def score(model: torch.nn.Module) -> dict[str, Any]:
        """Acceptance on the held-out questions, and on the unseen ones beside them where there are any."""
        scored = acceptance(model, sets, vocab)
        if unseen_sets is not None:
            scored["unseen"] = acceptance(model, unseen_sets, vocab)
        return scored

    result["start"] = score(draft)
    print(f"the draft as loaded: alpha {result['start']['alpha']:.4f}, greedy {result['start']['greedy']:.4f}")
    result["settings"] = {}

    def save() -> None:
        (out / "trajectory.json").write_text(json.dumps(result, indent=1))

    save()  # the start, kept though no setting trains (--steps 0) or the first is stopped
    for index, setting in enumerate(settings):
        print(f"{setting}:")
        distill = load_config(None, [*overrides, *setting.split()]).distill
        if distill.bf16 is None:  # as the edge resolved it for the run
            distill = dataclasses.replace(distill, bf16=cfg.distill.bf16)
        setting_cfg = dataclasses.replace(cfg, distill=distill)
        rows = result["settings"][setting] = []
        keep = out / "drafts" / str(index) if keep_drafts else None
        if keep is not None:
            result.setdefault("drafts", {})[setting] = str(keep)
        run_setting(
            setting_cfg,
            target,
            draft,
            tokenizer,
            task,
            score,
            steps=steps,
            every=every,
            rows=rows,
            save=save,
            keep=keep,
            questions=task.test[:held] if train_on == "held" else None,
        )
        gc.collect()  # the setting's draft copy and optimizer state, before the next one's
    (out / "trajectory.md").write_text(format_table(result) + "\n")
    plot(result, out / "trajectory.png")
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    start, unseen = result["start"], result["config"].get("unseen", 0)
    seen = " (the questions trained on)" if result["config"].get("train_on") == "held" else ""
    lines = [
        f"held-out alpha (T = 1, 1 - TVD) and greedy agreement (T = 0) on {result['config']['held_out']} questions"
        f"{seen}; the draft as loaded {start['alpha']:.4f} / {start['greedy']:.4f}",
    ]
    if unseen:
        lines.append(
            f"unseen: the same on {unseen} questions the learner never saw; the draft as loaded "
            f"{start['unseen']['alpha']:.4f} / {start['unseen']['greedy']:.4f}"
        )
    head = "| setting | step | loss | alpha (T = 1) | change | greedy (T = 0) | change |"
    if unseen:
        head += " unseen alpha | change | unseen greedy | change |"
    lines += ["", head + " step s |", "|---" * head.count("|") + "|"]

    def cells(now: dict, before: dict) -> str:
        return (
            f" {now['alpha']:.4f} | {now['alpha'] - before['alpha']:+.4f} | {now['greedy']:.4f} | "
            f"{now['greedy'] - before['greedy']:+.4f} |"
        )

    for setting, rows in result["settings"].items():
        for row in rows:
            line = f"| {setting} | {row['step']} | {row['loss']:.4f} |" + cells(row, start)
            if unseen:
                line += cells(row["unseen"], start["unseen"])
            lines.append(f"{line} {row['seconds']:.0f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("alpha", "greedy"), ("alpha at T = 1 (1 - TVD)", "greedy agreement (T = 0)")):
        for setting, rows in result["settings"].items():
            steps = [0] + [r["step"] for r in rows]
            (line,) = ax.plot(steps, [result["start"][key]] + [r[key] for r in rows], "o-", label=setting)
            if "unseen" in result["start"]:  # the same setting, dashed, on the questions it never saw
                values = [result["start"]["unseen"][key]] + [r["unseen"][key] for r in rows]
                ax.plot(steps, values, "s--", color=line.get_color(), label=f"{setting} (unseen questions)")
        ax.set(xlabel="learner step", title=title)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # below the plots: a setting's name is long
    fig.legend(handles, labels, loc="lower center", fontsize=8)
    fig.tight_layout(rect=(0, 0.05 * len(labels) + 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., distill.*)")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=[],
        help='learner settings to compare, each one quoted: "distill.lr=3e-6" (none with --steps 0: score the draft)',
    )
    parser.add_argument("--steps", type=int, default=8, help="learner steps per setting")
    parser.add_argument("--every", type=int, default=2, help="steps between held-out evaluations")
    parser.add_argument("--held", type=int, default=24, help="held-out test questions")
    parser.add_argument("--out", type=Path, default=Path("outputs/trajectory"))
    parser.add_argument(
        "--keep-drafts",
        action="store_true",
        help="write each setting's draft, as of its last evaluation, to OUT/drafts/N (N: the setting's index)",
    )
    parser.add_argument(
        "--train-on",
        choices=["train", "held"],
        default="train",
        help="the questions the learner samples: the task's training split, or the held-out questions themselves "
        "(a ceiling: what the recipe buys on questions it has seen)",
    )
    parser.add_argument(
        "--unseen",
        type=int,
        default=0,
        help="with --train-on held: also score this many further test questions, which the learner never sees",
    )
    args = parser.parse_args()
    suite_trajectory(
        args.overrides,
        args.settings,
        steps=args.steps,
        every=args.every,
        held=args.held,
        out=args.out,
        keep_drafts=args.keep_drafts,
        train_on=args.train_on,
        unseen=args.unseen,
    )


if __name__ == "__main__":
    run_main(main)
