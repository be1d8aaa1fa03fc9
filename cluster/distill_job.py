"""The main job (``jobs/distill.py``): measure alpha/tau, distill the draft toward the target (the Ray pipeline, or
the single-process loop with ``ray.mode=sync``), measure again, write the results, plots and the distilled draft."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from actors.evaluator import measure_on_cluster, progress
from actors.learner import RUN_DIR, checkpoint_steps
from cluster.connect import connect, dashboard_url, logs_dir, metrics_url
from cluster.pipeline import EVALUATIONS, Pipeline, check_devices
from distillspec.cli import sigterm_held
from distillspec.config import JobConfig, resolve_recipe, to_dict
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import format_table, plot_tau, plot_training
from distillspec.evaluation.study import measure_phase, merge_baseline_speed
from distillspec.files import RecordLog, exclusive, read_json, write_atomic, write_folder, write_json
from distillspec.models.loading import decoding_copy, load_pair
from distillspec.models.pretrained import RUN_CONFIG, prepare_pair
from distillspec.tasks.data import load_task
from distillspec.training.learner import LOG_FILE, Distiller, checkpoint_log, load_checkpoint, save_checkpoint

SYNC_CHECKPOINT = "checkpoint"  #: the single-process loop's checkpoint folder under output_dir
#: The measurements before distillation under output_dir, with what they measured, for a run that stops and reruns
BEFORE = "before.json"
#: The config's knobs and sections that do not change what the measurements before distillation measure
NOT_MEASURED = ("output_dir", "overwrite", "distill", "ray", "rollout", "scorer", "buffer", "learner", "evaluator",
                "serve", "sweep")  # fmt: skip


def measured_before(cfg: JobConfig, out: Path, measure: Callable[[], list[dict]]) -> list[dict]:
    """The measurements before distillation: those that a run in ``out`` took already and kept (``BEFORE``), where
    this run would measure the same (the pair, the data, the precisions, ``eval``: all but :data:`NOT_MEASURED`), else
    ``measure()``'s, kept there: a stopped run that reruns to resume its checkpoint does not measure the undistilled
    draft again."""
    measured = json.loads(json.dumps({k: v for k, v in to_dict(cfg).items() if k not in NOT_MEASURED}))
    kept = read_json(out / BEFORE)
    if isinstance(kept, dict) and kept.get("measured") == measured and isinstance(kept.get("records"), list):
        print(f"measure before: as the run before this one measured it ({out / BEFORE})")
        return kept["records"]
    records = measure()
    write_json(out / BEFORE, {"measured": measured, "records": records}, indent=1)
    return records


def train_sync(cfg: JobConfig, target, draft, tokenizer, task, out: Path) -> dict:
    """Algorithm A.2 in this process (``ray.mode=sync``): sample a batch, update, repeat. Checkpoints go to
    ``out/checkpoint`` in the learner's format; a rerun of an unfinished run resumes from there."""
    distiller = Distiller(target, draft, tokenizer, task.train, cfg.distill, seed=cfg.seed)
    learner, folder, seconds, resumed = distiller.learner, out / SYNC_CHECKPOINT, 0.0, None
    if cfg.learner.resume and (folder / "state.pt").exists():
        seconds, log = load_checkpoint(folder, learner), checkpoint_log(folder, out / LOG_FILE)
        resumed = learner.step_count
        print(f"resuming from the checkpoint at step {resumed} in {folder}")
    else:
        log = RecordLog(out / LOG_FILE)
    distiller.start = start = time.perf_counter() - seconds
    steps, budget, every = cfg.distill.steps, cfg.distill.time_budget_s, cfg.distill.checkpoint_every
    bar = tqdm(total=steps, initial=learner.step_count, desc=f"distill ({cfg.distill.recipe}, sync)")
    while learner.step_count < steps and not (budget and time.perf_counter() - start > budget):
        log.append(distiller.step())
        bar.update()
        bar.set_postfix(loss=f"{log.records[-1]['loss']:.4f}", src=log.records[-1]["source"])
        if every and learner.step_count % every == 0 and learner.step_count < steps:
            save_checkpoint(folder, learner, tokenizer, log, seconds=time.perf_counter() - start)
    bar.close()
    save_checkpoint(folder, learner, tokenizer, log, seconds=time.perf_counter() - start)
    write_folder(out / "draft", lambda tmp: (draft.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    return {
        "mode": "sync",
        "train_log": log.records,
        "seconds": time.perf_counter() - start,
        "evaluations": [],
        "resumed_from": resumed,
    }


def train_async(cfg: JobConfig, task, out: Path) -> tuple[list[dict], dict]:
    """The Ray pipeline (``ray.mode=async``); the distilled draft lands in ``out/draft``. The measurements before
    and after run as Ray tasks (on a GPU when ``device`` is one), not in this driver: on a cluster the driver runs
    on the head node, which may have no GPU. Returns the measurements and the training summary."""
    check_devices(cfg)
    with sigterm_held():  # Ray's own handler would abort the process
        how = connect(cfg.ray)
    print(f"ray: {how}; dashboard: {dashboard_url() or '-'}; metrics (Prometheus): {metrics_url()}")
    if not cfg.ray.log_to_driver:
        print(f"ray: the actors' logs are in {logs_dir()} (ray.log_to_driver=true shows them here)")
    threads = torch.get_num_threads()  # the measurements run alone, before and after the pipeline
    records = measured_before(
        cfg, out, lambda: measure_on_cluster("before", cfg, cfg.draft, task, threads=threads, speed=False)
    )
    pipeline = Pipeline(cfg, task, out, fixed_cluster=how.startswith("started"))
    if pipeline.resumed_from is not None:
        print(f"resuming the learner from its checkpoint at step {pipeline.resumed_from} in {out / 'learner'}")
    try:
        result = pipeline.run()
    finally:
        pipeline.shutdown()
    steps = len(result.train_log) - (result.resumed_from or 0)
    ledger = result.ledger
    print(
        f"pipeline: {steps} learner steps in {result.seconds:.0f}s; ledger produced {ledger['produced']} = "
        f"consumed {ledger['consumed']} + dropped {ledger['dropped']} + refused {ledger['refused']} + held "
        f"{ledger['held']} ({'balanced' if ledger['balanced'] else 'NOT BALANCED'})"
    )
    for alarm in result.alarms:
        print(f"ALARM: {alarm}")
    records += measure_on_cluster("after", cfg, str(out / "draft"), task, threads=threads, baseline=cfg.draft)
    merge_baseline_speed(records)
    return records, {
        "mode": "async",
        "train_log": result.train_log,
        "seconds": result.seconds,
        "ledger": ledger,
        "evaluations": result.evaluations,
        "alarms": result.alarms,
        "resumed_from": result.resumed_from,
        "first_step_s": result.startup.get("first_step_s"),
        "startup": result.startup,
    }


def check_rerun(cfg: JobConfig, out: Path) -> None:
    """A finished run (its ``results.json``) is not redone or overwritten unless ``overwrite`` says so; then it is
    done again from the start (its checkpoints, log and evaluations go: resuming a finished run would train nothing).
    """
    if (out / "results.json").exists() and read_json(out / "results.json") is None:
        print(f"{out / 'results.json'} does not parse (a run cut off while writing it): this run replaces it")
    elif (out / "results.json").exists() and not cfg.overwrite:
        raise DistillSpecError(
            f"{out} holds a finished run (results.json): give another --output-dir for a new run, or add "
            "overwrite=true to run it again there from the start"
        )
    elif (out / "results.json").exists():
        shutil.rmtree(out / RUN_DIR, ignore_errors=True)
        shutil.rmtree(out / SYNC_CHECKPOINT, ignore_errors=True)
        for name in (LOG_FILE, EVALUATIONS, BEFORE):
            (out / name).unlink(missing_ok=True)
        print(f"overwrite=true: {out} held a finished run; this one starts from step 0 (its checkpoints removed)")


#: What a resumed run must share with the checkpoint it resumes: the pair, the data and the recipe.
RESUME_KEYS = ("target", "draft", "dataset", "distill.recipe", "distill.divergence", "distill.lambda1",
               "distill.lambda2", "distill.train")  # fmt: skip


def check_resume(cfg: JobConfig, out: Path) -> None:
    """A run that would resume a checkpoint in ``out`` distils what that checkpoint was distilling (its
    ``config.yaml``), or stops with what changed; a run that starts afresh is not checked."""
    sync = cfg.ray.mode == "sync"
    checkpoint = (out / SYNC_CHECKPOINT / "state.pt").exists() if sync else bool(checkpoint_steps(out))
    if not (cfg.learner.resume and checkpoint and (out / RUN_CONFIG).exists()):
        return
    try:
        before, now = yaml.safe_load((out / RUN_CONFIG).read_text()) or {}, to_dict(cfg)
    except yaml.YAMLError:
        return  # not what this project wrote: nothing to compare with

    def value(tree: dict, key: str):
        for part in key.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    changed = [
        f"{k} {value(before, k)!r} -> {value(now, k)!r}" for k in RESUME_KEYS if value(before, k) != value(now, k)
    ]
    if changed:
        raise DistillSpecError(
            f"{out} holds a checkpoint of another run ({'; '.join(changed)}): resuming it would mix the two; give "
            "another --output-dir"
        )


def run(cfg: JobConfig) -> list[dict]:
    """The main job: measure, distill, measure again, write results (see ``jobs/distill.py``)."""
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir).resolve()
    with exclusive(out):
        return _run(cfg, out, start)


def _run(cfg: JobConfig, out: Path, start: float) -> list[dict]:
    check_rerun(cfg, out)
    task = load_task(cfg.dataset, seed=cfg.seed)  # fails early on a missing or empty data set
    print(f"task {task.name}: {len(task.train)} train / {len(task.test)} test examples, metric {task.metric}")
    cfg, task = prepare_pair(cfg, task)
    check_resume(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    saved = to_dict(replace(cfg, serve=replace(cfg.serve, api_key=None)))  # the run's folder never holds the key
    write_atomic(out / RUN_CONFIG, yaml.safe_dump(saved, sort_keys=False))
    if cfg.ray.mode == "sync":
        target, draft, tokenizer = load_pair(
            cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype, prepack=cfg.prepack
        )
        # The draft trains in float32; it is measured as the evaluator decodes it, in the pair's dtype.
        baseline = decoding_copy(draft, target.dtype, cfg.draft_int8)
        records = measured_before(
            cfg,
            out,
            lambda: measure_phase(
                "before", cfg, target, baseline, tokenizer, task, speed=False, report=progress("before")
            ),
        )
        training = train_sync(cfg, target, draft, tokenizer, task, out)
        distilled = decoding_copy(draft, target.dtype, cfg.draft_int8)
        records += measure_phase(
            "after", cfg, target, distilled, tokenizer, task, baseline=baseline, report=progress("after")
        )
        merge_baseline_speed(records)
    else:
        records, training = train_async(cfg, task, out)
    write_json(out / "train_log.json", training["train_log"])

    summary = {k: v for k, v in training.items() if k != "train_log"}
    write_json(out / "results.json", {"records": records, "training": summary}, indent=2)
    divergence = resolve_recipe(cfg.distill).divergence.upper()
    title = f"{task.name}: {cfg.distill.recipe} ({divergence}), {len(training['train_log'])} steps, {training['mode']}"
    plot_tau(records, out / "tau.png", title=f"block efficiency before / after DistillSpec - {title}")
    plot_training(training["train_log"], training["evaluations"], out / "training.png", title=title)
    print(format_table(records))
    print(
        f"\nwrote {out / 'results.json'}, {out / 'tau.png'}, {out / 'training.png'} and the distilled draft "
        f"{out / 'draft'} ({time.perf_counter() - start:.0f}s)"
    )
    return records
