"""The recipe grid (data source x divergence x seed) as parallel Ray Tune trials: what ``jobs/sweep.py`` runs.

Each trial distils the draft for ``sweep.steps`` steps with one recipe (:func:`distillspec.evaluation.study.run_cell`)
and reports alpha, tau and its gain over the undistilled draft at gamma = ``eval.speedup_gamma`` and each of
``eval.temperatures``, the TVD-based alpha and tau, and the distilled draft's own task score.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import ray
import torch
from ray import tune

from cluster.connect import connect
from distillspec.cli import sigterm_held
from distillspec.config import JobConfig, cell_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import summarise
from distillspec.evaluation.study import measure_pair, run_cell
from distillspec.models.loading import load_pair
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import Task, load_task


def _key(t: float) -> str:
    return f"T{t:g}"


def flatten(sd: list[dict], draft_alone: dict, before: dict[str, dict]) -> dict[str, float]:
    """One trial's report: per temperature alpha, tau, the tau gain over ``before``, and the TVD-based figures."""
    metrics: dict[str, float] = {}
    for r in sd:
        k = _key(r["temperature"])
        metrics |= {
            f"alpha_{k}": r["alpha"],
            f"tau_{k}": r["tau"],
            f"alpha_tvd_{k}": r["alpha_tvd"],
            f"tau_theory_{k}": r["tau_theory"],
            f"tau_gain_{k}": r["tau"] / before[k]["tau"] - 1.0,
        }
    metrics |= {f"draft_{k}": v for k, v in draft_alone.items()}
    return metrics


def measured(cfg: JobConfig) -> dict:
    """What each trial and the undistilled baseline measure, the same for both so that their taus compare: gamma
    ``eval.speedup_gamma`` at each of ``eval.temperatures`` on ``eval.num_prompts`` prompts."""
    e = cfg.eval
    return {
        "gammas": [e.speedup_gamma],
        "temperatures": e.temperatures,
        "num_prompts": e.num_prompts,
        "max_new_tokens": e.max_new_tokens,
    }


def trial(params: dict, cfg: JobConfig, task, before: dict[str, dict], out: str) -> None:
    """One Ray Tune trial: distil one recipe cell on ``task`` (a :class:`~distillspec.tasks.data.Task`), report its
    measurements."""
    torch.set_num_threads(max(1, int(cfg.sweep.trial_cpus)))
    torch.manual_seed(params["seed"])
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)
    dcfg = cell_config(cfg.distill, params["source"], params["divergence"], cfg.sweep.steps)
    student, record = run_cell(
        target,
        draft,
        tokenizer,
        task,
        dcfg,
        **measured(cfg),
        seed=params["seed"],
    )
    if cfg.sweep.save_drafts:
        folder = Path(out) / "drafts" / cell_name(params)
        student.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "distillspec.json").write_text(json.dumps({**params, "steps": dcfg.steps}))
    tune.report(
        {
            **flatten(record["sd"], record["draft_alone"], before),
            "train_seconds": record["train_seconds"],
            "train_tokens": record["train_tokens"],
            "final_loss": record["final_loss"],
        }
    )


def cell_name(params: dict) -> str:
    return f"{params['source']}-{params['divergence']}-s{params['seed']}"


def run_sweep(cfg: JobConfig, out: Path, *, log=print) -> dict:
    """Build or load the pair, measure the undistilled draft, run the grid as Tune trials; returns sweep.json's data."""
    if cfg.sweep.rank_temperature not in cfg.eval.temperatures:
        raise DistillSpecError(
            f"sweep.rank_temperature={cfg.sweep.rank_temperature:g} is not among eval.temperatures="
            f"{cfg.eval.temperatures}: add it there, or rank at one of those"
        )
    start = time.perf_counter()
    cfg, task, before, memory = _baseline(cfg, log)
    with sigterm_held():  # Ray's own handler would abort the process
        started = connect(cfg.ray).startswith("started")
    rank = f"tau_gain_{_key(cfg.sweep.rank_temperature)}"
    grid = {
        "source": tune.grid_search(cfg.sweep.sources),
        "divergence": tune.grid_search(cfg.sweep.divergences),
        "seed": tune.grid_search(cfg.sweep.seeds),
    }
    memory = _fitting(memory, log)
    resources = {"cpu": cfg.sweep.trial_cpus, "gpu": cfg.sweep.trial_gpus, "memory": memory}
    trainable = tune.with_resources(
        tune.with_parameters(
            trial,
            cfg=replace(cfg, device="cuda" if cfg.sweep.trial_gpus else cfg.device),
            task=task,
            before=before,
            out=str(out),
        ),
        resources,
    )
    try:
        tuner = tune.Tuner(
            trainable,
            param_space=grid,
            tune_config=tune.TuneConfig(metric=rank, mode="max"),
            run_config=tune.RunConfig(name=f"sweep-{task.name}", storage_path=str(out / "tune"), verbose=1),
        )
        results = tuner.fit()
    except RuntimeError as e:  # Tune's controller stops when Ray kills a trial's actor for memory
        if "low on memory" not in str(e):
            raise
        raise DistillSpecError(
            f"the node ran out of memory with {memory / 2**30:.1f} GiB asked per trial: "
            "ask for more (sweep.trial_memory_gb) so that fewer trials run at once"
        ) from e
    finally:
        if started:
            ray.shutdown()
    trials, failed = _collect(results)
    if not trials:
        raise DistillSpecError(f"every sweep trial failed; the first: {failed[0]['error'] if failed else '?'}")
    cells = summarise(trials, rank)
    best = cells[0]
    return {
        "task": task.name,
        "metric": task.metric,
        "target": cfg.target,
        "draft": cfg.draft,
        "gamma": cfg.eval.speedup_gamma,
        "steps": cfg.sweep.steps,
        "rank": rank,
        "before": before,
        "trials": trials,
        "failed": failed,
        "cells": cells,
        "best": {"source": best["source"], "divergence": best["divergence"], rank: best[rank]},
        "seconds": time.perf_counter() - start,
    }


def _baseline(cfg: JobConfig, log=print) -> tuple[JobConfig, Task, dict, int]:
    """The pair made local (trials run in their own working directories: they get the task itself and absolute model
    paths), the task as the target is prompted, the undistilled draft's alpha and tau at each temperature, and the
    bytes of host memory a trial asks for."""
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed), log=log)
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)
    records = measure_pair(
        target,
        draft,
        tokenizer,
        task,
        **measured(cfg),
        seed=cfg.seed,
    )
    before = {_key(r["temperature"]): r for r in records}
    log(
        f"{task.name}: undistilled draft at gamma={cfg.eval.speedup_gamma}: "
        + ", ".join(f"{k} alpha {r['alpha']:.3f} tau {r['tau']:.3f}" for k, r in before.items())
    )
    memory = int(cfg.sweep.trial_memory_gb * 2**30) or trial_memory(target, draft, cfg)
    return cfg, task, before, 0 if cfg.sweep.trial_gpus else memory


def trial_memory(target, draft, cfg: JobConfig) -> int:
    """Bytes of host memory one trial holds, over-estimated: the target's weights as loaded, the draft's float32
    weights with gradients and AdamW's two moments (as if all of it trained), and a batch's logits from both models
    in float32, twice (the logits and their softmax or gradient)."""
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    student = 16 * sum(p.numel() for p in draft.parameters())
    d = cfg.distill
    logits = 2 * 4 * d.batch_size * (d.max_prompt_tokens + d.max_new_tokens)
    return weights + student + logits * (target.config.vocab_size + draft.config.vocab_size)


def _fitting(memory: int, log=print) -> int:
    """``memory``, capped at the largest node's (a trial asking for more than any node has would never start)."""
    largest = max((n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"]), default=0)
    if memory:
        log(f"each trial asks for {memory / 2**30:.1f} GiB of memory (the largest node has {largest / 2**30:.1f})")
    return int(min(memory, largest)) if largest else memory


def _collect(results) -> tuple[list[dict], list[dict]]:
    """The Tune trials' recipes with their reported metrics, and the failed ones with their errors."""
    trials, failed = [], []
    for result in results:
        params = {k: result.config[k] for k in ("source", "divergence", "seed")}
        if result.error is not None:
            error = getattr(result.error, "cause", None) or result.error  # Ray wraps the trial's own exception
            failed.append({**params, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"})
            continue
        metrics = {k: v for k, v in result.metrics.items() if _reported(k)}
        trials.append({**params, "metrics": metrics})
    return trials, failed


def _reported(key: str) -> bool:
    return key.startswith(("alpha", "tau", "draft_", "train_", "final_loss"))
