"""DistillSpec end to end: measure alpha/tau, distill the draft toward the target, measure again.

    python jobs/distill.py                                   # offline default: builds the arith garden
    python jobs/distill.py --dataset ../shared/data/gsm8k    # garden trained on GSM8K
    python jobs/distill.py --target ORG/big --draft ORG/small --dataset gsm8k
    python jobs/distill.py --config my.yaml distill.steps=500 distill.recipe=supkd

Writes ``results.json`` (one record per phase x gamma x temperature), ``tau.png``, ``config.yaml``,
``train_log.json`` and the distilled draft (``draft/``, loadable by transformers and as vLLM's draft model)
into ``--output-dir``.
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
from distillspec.distill import Distiller  # noqa: E402
from distillspec.evaluate import evaluate_sd, measure_speedup  # noqa: E402
from distillspec.garden import build_garden  # noqa: E402
from distillspec.models import load_pair  # noqa: E402
from distillspec.report import format_table, plot_tau  # noqa: E402


def measure(phase: str, cfg: JobConfig, target, draft, tokenizer, task) -> list[dict]:
    test = task.test[: cfg.eval.num_prompts]
    prompts, refs = [e.prompt for e in test], [e.reference for e in test]
    records = []
    grid = [(g, t) for g in cfg.eval.gammas for t in cfg.eval.temperatures]
    for gamma, temperature in tqdm(grid, desc=f"measure {phase}"):
        rec = evaluate_sd(
            target,
            draft,
            tokenizer,
            prompts,
            gamma=gamma,
            temperature=temperature,
            max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=cfg.eval.batch_size,
            seed=cfg.seed,
            references=refs,
            metric=task.metric,
        )
        if gamma == cfg.eval.speedup_gamma and cfg.eval.speedup_prompts:
            rec.update(
                measure_speedup(
                    target,
                    draft,
                    tokenizer,
                    prompts[: cfg.eval.speedup_prompts],
                    gamma=gamma,
                    temperature=temperature,
                    max_new_tokens=cfg.eval.max_new_tokens,
                    seed=cfg.seed,
                )
            )
        records.append({"phase": phase, **rec})
    return records


def main(cfg: JobConfig) -> list[dict]:
    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    task = load_task(cfg.dataset, seed=cfg.seed)  # fails early on a missing or empty data set
    print(f"task {task.name}: {len(task.train)} train / {len(task.test)} test examples, metric {task.metric}")
    if cfg.target is None:
        garden = build_garden(task, cfg.garden, seed=cfg.seed)
        cfg = replace(cfg, target=str(garden.target), draft=str(garden.draft))
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    records = measure("before", cfg, target, draft, tokenizer, task)

    distiller = Distiller(target, draft, tokenizer, task.train, cfg.distill, seed=cfg.seed)
    log = []
    bar = tqdm(total=cfg.distill.steps, desc=f"distill ({cfg.distill.recipe})")
    for _ in range(cfg.distill.steps):
        log.append(distiller.step())
        bar.update()
        bar.set_postfix(loss=f"{log[-1]['loss']:.4f}", src=log[-1]["source"])
        every = cfg.distill.checkpoint_every
        if every and distiller.step_count % every == 0:
            draft.save_pretrained(out / f"checkpoint-{distiller.step_count}")
    bar.close()
    draft.save_pretrained(out / "draft")
    tokenizer.save_pretrained(out / "draft")
    (out / "train_log.json").write_text(json.dumps(log))

    records += measure("after", cfg, target, draft, tokenizer, task)
    (out / "results.json").write_text(json.dumps(records, indent=2))
    plot_tau(
        records,
        out / "tau.png",
        title=f"{task.name}: block efficiency before / after DistillSpec "
        f"({cfg.distill.recipe}: {distiller.recipe.divergence.upper()}, {cfg.distill.steps} steps)",
    )
    print(format_table(records))
    print(
        f"\nwrote {out / 'results.json'}, {out / 'tau.png'} and the distilled draft {out / 'draft'} "
        f"({time.perf_counter() - start:.0f}s)"
    )
    return records


if __name__ == "__main__":
    run_main(lambda: main(parse_job_args(__doc__)))
