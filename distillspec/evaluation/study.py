"""Experiments of the paper's study (Sec. 5): one recipe cell, a draft's own quality, summaries over seeds.

A *cell* of the recipe grid (Figure 4) is a data source x a divergence: distil the draft for a fixed number of
steps with that recipe, then measure alpha/tau (gamma, temperatures) and the draft's own task score. The Ray
Tune sweep (``jobs/sweep.py``) runs one cell per trial; the benchmark suites reuse the drafts it saves.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.config import DistillConfig
from distillspec.decoding.speculative import autoregressive_generate
from distillspec.evaluation.measure import evaluate_sd, measure_speeds
from distillspec.models.loading import decode_new, encode_prompts
from distillspec.tasks.data import Task
from distillspec.tasks.scores import score
from distillspec.training.learner import Distiller


@torch.inference_mode()
def draft_score(
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    *,
    num_prompts: int,
    max_new_tokens: int,
    batch_size: int = 32,
) -> dict[str, float]:
    """The draft decoding alone (greedy): its task score (accuracy, BLEU, ROUGE) and seconds per token."""
    test = task.test[:num_prompts]
    predictions, tokens, start = [], 0, time.perf_counter()
    for i in range(0, len(test), batch_size):
        ids, mask = encode_prompts(tokenizer, [e.prompt for e in test[i : i + batch_size]])
        out = autoregressive_generate(
            draft,
            ids.to(draft.device),
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            eos_token_id=tokenizer.eos_token_id,
            attention_mask=mask.to(draft.device),
            pad_token_id=tokenizer.pad_token_id,
        )
        predictions += decode_new(tokenizer, out.sequences, ids.shape[1], out.num_new_tokens)
        tokens += int(out.num_new_tokens.sum())
    result = score(task.metric, predictions, [e.reference for e in test])
    return {**result, "seconds_per_token": (time.perf_counter() - start) / max(1, tokens)}


def measure_pair(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    *,
    gammas: list[int],
    temperatures: list[float],
    num_prompts: int,
    max_new_tokens: int,
    batch_size: int = 32,
    seed: int = 0,
    lenience: str | None = None,
    epsilon: float = 1.0,
    desc: str | None = None,
    report: Callable[[str], None] | None = None,
) -> list[dict]:
    """:func:`evaluate_sd` at every gamma x temperature on the first ``num_prompts`` test prompts
    (``desc``: show a progress bar with this label; ``report``: called with a line on each setting as it is done)."""
    test = task.test[:num_prompts]
    prompts, refs = [e.prompt for e in test], [e.reference for e in test]
    grid = [(gamma, temperature) for gamma in gammas for temperature in temperatures]
    records = []
    for gamma, temperature in tqdm(grid, desc=desc, disable=desc is None):
        start = time.perf_counter()
        rec = evaluate_sd(
            target,
            draft,
            tokenizer,
            prompts,
            gamma=gamma,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            seed=seed,
            references=refs,
            metric=task.metric,
            lenience=lenience,
            epsilon=epsilon,
        )
        records.append(rec)
        if report is not None:
            report(
                f"gamma {gamma}, T = {temperature:g}: alpha {rec['alpha']:.3f}, tau {rec['tau']:.2f} "
                f"({len(records)}/{len(grid)}, {time.perf_counter() - start:.0f}s)"
            )
    return records


def run_cell(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    cfg: DistillConfig,
    *,
    gammas: list[int],
    temperatures: list[float],
    num_prompts: int,
    max_new_tokens: int,
    seed: int = 0,
) -> tuple[PreTrainedModel, dict]:
    """Distil a copy of ``draft`` with ``cfg`` (Algorithm A.2, ``cfg.steps`` steps), then measure it.

    Returns the distilled draft and a record: training seconds and tokens, the final loss, the SD
    measurements (:func:`measure_pair`) and the draft's own score (:func:`draft_score`).
    """
    student = copy.deepcopy(draft)
    distiller = Distiller(target, student, tokenizer, task.train, cfg, seed=seed)
    start = time.perf_counter()
    log = distiller.run()
    seconds = time.perf_counter() - start
    measured = measure_pair(
        target,
        student,
        tokenizer,
        task,
        gammas=gammas,
        temperatures=temperatures,
        num_prompts=num_prompts,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    own = draft_score(student, tokenizer, task, num_prompts=num_prompts, max_new_tokens=max_new_tokens)
    record = {
        "steps": len(log),
        "train_seconds": seconds,
        "train_tokens": sum(r["tokens"] for r in log),
        "final_loss": statistics.fmean(r["loss"] for r in log[-10:]) if log else float("nan"),
        "sd": measured,
        "draft_alone": own,
    }
    return student, record


#: A phase's draft as a job's progress names it.
DRAFT_NAMES = {"before": "undistilled", "after": "distilled"}


def measure_phase(
    phase: str,
    cfg,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    speedup_gammas: list[int] | None = None,
    *,
    speed: bool = True,
    baseline: PreTrainedModel | None = None,
    report: Callable[[str], None] | None = None,
) -> list[dict]:
    """One phase (``before`` / ``after`` distillation) of a job's measurements (``cfg``: a JobConfig): alpha/tau at
    every ``eval.gammas`` x ``eval.temperatures``, and (``speed``) the wall-clock speedup at ``speedup_gammas``
    (default: ``eval.speedup_gamma``) by :func:`~distillspec.evaluation.measure.measure_speeds`
    (``eval.speedup_repeats`` passes). With a ``baseline`` draft (the undistilled one), both
    drafts' speedups are measured side by side, in one race: the baseline's figures go into each record under
    ``baseline_speed``, for :func:`merge_baseline_speed` to move into the ``before`` records. ``report`` is called
    with a line as each measurement is done (a job's progress)."""
    speedup_gammas = [cfg.eval.speedup_gamma] if speedup_gammas is None else speedup_gammas
    records = measure_pair(
        target,
        draft,
        tokenizer,
        task,
        gammas=cfg.eval.gammas,
        temperatures=cfg.eval.temperatures,
        num_prompts=cfg.eval.num_prompts,
        max_new_tokens=cfg.eval.max_new_tokens,
        batch_size=cfg.eval.batch_size,
        seed=cfg.seed,
        desc=f"measure {phase}",
        report=report,
    )
    prompts = [e.prompt for e in task.test[: min(cfg.eval.num_prompts, cfg.eval.speedup_prompts)]]
    if not speed or not prompts:
        return [{"phase": phase, **rec} for rec in records]
    drafts = {phase: draft} | ({"before": baseline} if baseline is not None else {})
    temperatures = sorted({rec["temperature"] for rec in records if rec["gamma"] in speedup_gammas})
    if report is not None:
        named = " and the ".join(DRAFT_NAMES.get(name, name) for name in drafts)
        report(f"racing the {named} draft against the target alone on {len(prompts)} prompts ...")
    speeds = measure_speeds(
        target,
        drafts,
        tokenizer,
        prompts,
        gammas=speedup_gammas,
        temperatures=temperatures,
        max_new_tokens=cfg.eval.max_new_tokens,
        repeats=cfg.eval.speedup_repeats,
        seed=cfg.seed,
        compile=cfg.eval.compile,
    )
    for rec in records:
        key = (rec["gamma"], rec["temperature"])
        if (phase, *key) in speeds:
            rec.update(speeds[(phase, *key)])
            if baseline is not None:
                rec["baseline_speed"] = speeds[("before", *key)]
    for (name, gamma, temperature), figures in speeds.items() if report is not None else ():
        draft_name, speedup = DRAFT_NAMES.get(name, name), figures["measured_speedup"]
        report(f"the {draft_name} draft, gamma {gamma}, T = {temperature:g}: {speedup:.2f}x the target alone")
    return [{"phase": phase, **rec} for rec in records]


def merge_baseline_speed(records: list[dict]) -> list[dict]:
    """Move the baseline's speed figures measured in the ``after`` phase (``baseline_speed``) into the ``before``
    records of the same gamma and temperature: both speedups then come from one side-by-side race."""
    before = {(r["gamma"], r["temperature"]): r for r in records if r["phase"] == "before"}
    for rec in records:
        speed = rec.pop("baseline_speed", None)
        if speed is not None and (rec["gamma"], rec["temperature"]) in before:
            before[(rec["gamma"], rec["temperature"])].update(speed)
    return records
