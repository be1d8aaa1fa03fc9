"""DistillSpec end to end: measure alpha/tau, distill the draft toward the target, measure again.

By default the distillation runs as the asynchronous Ray pipeline (rollout actors, an object-store buffer,
a Ray Train learner, a weight store, an evaluation actor; metrics on the Ray dashboard). It starts a
local Ray cluster, or joins the one named by ``ray.address`` / ``$RAY_ADDRESS``:

    python jobs/distill.py                                   # offline default: builds the arith garden
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/distill.py --output-dir $PWD/outputs/ray garden.cache_dir=$PWD/.cache/garden
    python jobs/distill.py ray.mode=sync                     # the single-process loop, no Ray
    python jobs/distill.py --dataset ../shared/data/gsm8k    # garden trained on GSM8K
    python jobs/distill.py --target ORG/big --draft ORG/small --dataset gsm8k
    python jobs/distill.py --config my.yaml distill.steps=500 distill.recipe=supkd

Writes ``results.json`` (one record per phase x gamma x temperature, and the pipeline's ledger and
evaluations), ``tau.png``, ``training.png``, ``config.yaml``, ``train_log.json`` and the distilled draft
(``draft/``, loadable by transformers and as vLLM's draft model) into ``--output-dir``; the learner's Ray Train
checkpoints go to ``--output-dir``/learner, and a rerun with the same ``--output-dir`` resumes from them.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from distillspec.cli import parse_job_args, run_main  # noqa: E402
from distillspec.config import JobConfig, to_dict  # noqa: E402
from distillspec.data import load_task  # noqa: E402
from distillspec.distill import Distiller, resolve_recipe  # noqa: E402
from distillspec.garden import build_garden  # noqa: E402
from distillspec.models import absolute, check_pair_sources, load_pair  # noqa: E402
from distillspec.report import format_table, plot_tau, plot_training  # noqa: E402
from distillspec.study import measure_phase  # noqa: E402


def train_sync(cfg: JobConfig, target, draft, tokenizer, task, out: Path) -> dict:
    """Algorithm A.2 in this process (``ray.mode=sync``): sample a batch, update, repeat."""
    distiller = Distiller(target, draft, tokenizer, task.train, cfg.distill, seed=cfg.seed)
    log, start = [], time.perf_counter()
    bar = tqdm(total=cfg.distill.steps, desc=f"distill ({cfg.distill.recipe}, sync)")
    budget = cfg.distill.time_budget_s
    while distiller.step_count < cfg.distill.steps and not (budget and time.perf_counter() - start > budget):
        log.append({**distiller.step(), "time": time.perf_counter() - start})
        bar.update()
        bar.set_postfix(loss=f"{log[-1]['loss']:.4f}", src=log[-1]["source"])
        every = cfg.distill.checkpoint_every
        if every and distiller.step_count % every == 0 and distiller.step_count < cfg.distill.steps:
            draft.save_pretrained(out / f"checkpoint-{distiller.step_count}")
    bar.close()
    draft.save_pretrained(out / "draft")
    tokenizer.save_pretrained(out / "draft")
    return {"mode": "sync", "train_log": log, "seconds": time.perf_counter() - start, "evaluations": []}


def train_async(cfg: JobConfig, task, out: Path) -> tuple[list[dict], dict]:
    """The Ray pipeline (``ray.mode=async``); the distilled draft lands in ``out/draft``. The measurements before
    and after run as Ray tasks (on a GPU when ``device`` is one), not in this driver: on a cluster the driver runs
    on the head node, which may have no GPU. Returns the measurements and the training summary."""
    import ray  # noqa: PLC0415

    from actors.evaluator import measure_on_cluster  # noqa: PLC0415
    from cluster.connect import connect, metrics_url  # noqa: PLC0415
    from cluster.pipeline import Pipeline, check_devices  # noqa: PLC0415

    check_devices(cfg)
    how = connect(cfg.ray)
    print(f"ray: {how}; metrics (Prometheus): {metrics_url()}; dashboard: {ray.worker.get_dashboard_url() or '-'}")
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
    }


def main(cfg: JobConfig) -> list[dict]:
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir).resolve()
    task = load_task(cfg.dataset, seed=cfg.seed)  # fails early on a missing or empty data set
    print(f"task {task.name}: {len(task.train)} train / {len(task.test)} test examples, metric {task.metric}")
    if cfg.target is None:
        garden = build_garden(task, cfg.garden, seed=cfg.seed)
        cfg = replace(cfg, target=str(garden.target), draft=str(garden.draft))
    # Actors may run in another working directory (a ray job's --working-dir): local paths become absolute.
    cfg = replace(cfg, target=absolute(cfg.target), draft=absolute(cfg.draft))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    check_pair_sources(cfg.target, cfg.draft, compile=cfg.eval.compile)  # a bad path fails in a second
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


if __name__ == "__main__":
    run_main(lambda: main(parse_job_args(__doc__)))
