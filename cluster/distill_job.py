"""The main job (``jobs/distill.py``): measure alpha/tau, distill the draft toward the target (the Ray pipeline, or
the single-process loop with ``ray.mode=sync``), measure again, write the results, plots and the distilled draft."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from actors.evaluator import measure_on_cluster
from cluster.connect import connect, dashboard_url, logs_dir, metrics_url
from cluster.pipeline import Pipeline, check_devices
from distillspec.config import JobConfig, resolve_recipe, to_dict
from distillspec.data import chat_prompts, load_task
from distillspec.errors import DistillSpecError
from distillspec.garden import build_garden
from distillspec.learner import Distiller, load_checkpoint, save_checkpoint
from distillspec.models import check_pair_sources, load_pair, load_tokenizer
from distillspec.pretrained import resolve_pair
from distillspec.report import format_table, plot_tau, plot_training
from distillspec.study import measure_phase

SYNC_CHECKPOINT = "checkpoint"  #: the single-process loop's checkpoint folder under output_dir


def train_sync(cfg: JobConfig, target, draft, tokenizer, task, out: Path) -> dict:
    """Algorithm A.2 in this process (``ray.mode=sync``): sample a batch, update, repeat. Checkpoints go to
    ``out/checkpoint`` in the learner's format; a rerun of an unfinished run resumes from there."""
    distiller = Distiller(target, draft, tokenizer, task.train, cfg.distill, seed=cfg.seed)
    learner, folder, log, seconds, resumed = distiller.learner, out / SYNC_CHECKPOINT, [], 0.0, None
    if cfg.ray.resume and (folder / "state.pt").exists():
        log, seconds = load_checkpoint(folder, learner)
        resumed = learner.step_count
        print(f"resuming from the checkpoint at step {resumed} in {folder}")
    distiller.start = start = time.perf_counter() - seconds
    steps, budget, every = cfg.distill.steps, cfg.distill.time_budget_s, cfg.distill.checkpoint_every
    bar = tqdm(total=steps, initial=learner.step_count, desc=f"distill ({cfg.distill.recipe}, sync)")
    while learner.step_count < steps and not (budget and time.perf_counter() - start > budget):
        log.append(distiller.step())
        bar.update()
        bar.set_postfix(loss=f"{log[-1]['loss']:.4f}", src=log[-1]["source"])
        if every and learner.step_count % every == 0 and learner.step_count < steps:
            save_checkpoint(folder, learner, tokenizer, log, seconds=time.perf_counter() - start)
    bar.close()
    save_checkpoint(folder, learner, tokenizer, log, seconds=time.perf_counter() - start)
    draft.save_pretrained(out / "draft")
    tokenizer.save_pretrained(out / "draft")
    return {
        "mode": "sync",
        "train_log": log,
        "seconds": time.perf_counter() - start,
        "evaluations": [],
        "resumed_from": resumed,
    }


def train_async(cfg: JobConfig, task, out: Path) -> tuple[list[dict], dict]:
    """The Ray pipeline (``ray.mode=async``); the distilled draft lands in ``out/draft``. The measurements before
    and after run as Ray tasks (on a GPU when ``device`` is one), not in this driver: on a cluster the driver runs
    on the head node, which may have no GPU. Returns the measurements and the training summary."""
    check_devices(cfg)
    how = connect(cfg.ray)
    print(f"ray: {how}; dashboard: {dashboard_url() or '-'}; metrics (Prometheus): {metrics_url()}")
    if not cfg.ray.log_to_driver:
        print(f"ray: the actors' logs are in {logs_dir()} (ray.log_to_driver=true shows them here)")
    threads = torch.get_num_threads()  # the measurements run alone, before and after the pipeline
    records = measure_on_cluster("before", cfg, cfg.draft, task, threads=threads)
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
    records += measure_on_cluster("after", cfg, str(out / "draft"), task, threads=threads)
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
    """A finished run (its ``results.json``) is not redone or overwritten unless ``overwrite`` says so."""
    if (out / "results.json").exists() and not cfg.overwrite:
        raise DistillSpecError(
            f"{out} holds a finished run (results.json): give another --output-dir for a new run, or add "
            "overwrite=true to run again there (its checkpoints are kept unless ray.resume=false)"
        )


def run(cfg: JobConfig) -> list[dict]:
    """The main job: measure, distill, measure again, write results (see ``jobs/distill.py``)."""
    start = time.perf_counter()
    cfg.check_pair()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir).resolve()
    check_rerun(cfg, out)
    task = load_task(cfg.dataset, seed=cfg.seed)  # fails early on a missing or empty data set
    print(f"task {task.name}: {len(task.train)} train / {len(task.test)} test examples, metric {task.metric}")
    if cfg.target is None:
        garden = build_garden(task, cfg.garden, seed=cfg.seed)
        cfg = replace(cfg, target=str(garden.target), draft=str(garden.draft))
    # What the workers load: GGUF files and packaged models dequantized, layer drafts made (each cached once), local
    # paths absolute (actors may run in another working directory, a ray job's --working-dir).
    target, draft = resolve_pair(cfg.target, cfg.draft)
    cfg = replace(cfg, target=target, draft=draft)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    check_pair_sources(cfg.target, cfg.draft, compile=cfg.eval.compile)  # a bad path fails in a second
    task, raw = chat_prompts(task, load_tokenizer(cfg.target), cfg.chat_template), task
    if task is not raw:
        print("prompts: the target's chat template, each question a user message (chat_template=false: the task's own)")
    if cfg.ray.mode == "sync":
        target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, target_dtype=cfg.target_dtype)
        records = measure_phase("before", cfg, target, draft, tokenizer, task)
        training = train_sync(cfg, target, draft, tokenizer, task, out)
        records += measure_phase("after", cfg, target, draft, tokenizer, task)
    else:
        records, training = train_async(cfg, task, out)
    (out / "train_log.json").write_text(json.dumps(training["train_log"]))

    summary = {k: v for k, v in training.items() if k != "train_log"}
    (out / "results.json").write_text(json.dumps({"records": records, "training": summary}, indent=2))
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
