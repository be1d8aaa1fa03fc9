"""The paper's findings, reproduced on the garden tasks (each suite returns what goes into its JSON file).

- ``recipes``  Figure 4: data source x divergence grid (the Ray Tune sweep of jobs/sweep.py), tau gain and score.
- ``theory``   Figure 3c: tau predicted from the TVD-based alpha vs tau measured, one point per distilled model.
- ``table``    Table C.1: tau and speedup without / with distillation, gamma in {3, 5, 7}, T in {0, 1}.
- ``lenience`` Figure 5b: task score vs latency of lossy SD (lin, sq, exp over epsilon), raw vs distilled draft.
- ``garden``   Figure 6: raw, distilled, speculative and DistillSpec models over three sizes.
- ``transfer`` a draft distilled on one task, tau gain on the others (one garden trained on all the real tasks).
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace
from pathlib import Path

from benchmarks.suites.analysis import latency_per_token, plot_garden, plot_lenience, plot_theory
from benchmarks.suites.common import (
    SHARED_DATA,
    Scale,
    available,
    best_recipe,
    distilled_draft,
    draft_steps,
    setting,
    suite_recipe,
    task_config,
    with_garden,
)
from benchmarks.suites.lossy import lenience_points
from benchmarks.suites.page import pearson
from benchmarks.suites.transfer_run import before_after
from cluster.sweep import run_sweep
from distillspec.config import ModelSize, cell_config
from distillspec.decoding.metrics import measure_cost_ratio
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import format_sweep, format_table, plot_recipe_grid, plot_tau
from distillspec.evaluation.study import draft_score, measure_pair, measure_phase, run_cell
from distillspec.models.garden import build_garden
from distillspec.models.loading import encode_prompts, load_model, load_pair
from distillspec.tasks.data import Task, chat_prompts, load_task


def _pair(cfg):
    return load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)


def suite_recipes(scale: Scale, overrides: list[str], out: Path) -> dict:
    """Figure 4 on each task: the sweep (Ray Tune trials), its table and its heat map."""
    results = {}
    for name in available(scale.tasks):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        cfg = task_config(name, scale, ["eval.temperatures=[0,1]", *overrides], folder)
        print(
            f"\n== recipes: {name} ({len(cfg.sweep.sources) * len(cfg.sweep.divergences)} cells x "
            f"{len(cfg.sweep.seeds)} seeds, {cfg.sweep.steps} steps each)"
        )
        result = run_sweep(cfg, folder)
        plot_recipe_grid(result, folder / "recipes.png")
        print(format_sweep(result))
        results[name] = result
    return {"tasks": results}


def suite_theory(scale: Scale, overrides: list[str], out: Path) -> dict:
    """Figure 3c from the recipe suite's trials (no new runs): predicted vs measured tau."""
    del overrides
    points = []
    for name in available(scale.tasks):
        path = out.parent / "recipes.json"
        if not path.exists():
            raise DistillSpecError(
                f"suite theory plots the recipe suite's trials: run the recipes suite first ({path})"
            )
        sweep = json.loads(path.read_text())["tasks"].get(name)
        if sweep is None:
            continue
        for trial in sweep["trials"]:
            for k in ("T0", "T1"):
                m = trial["metrics"]
                if f"tau_{k}" in m:
                    points.append(
                        {
                            "task": name,
                            "temperature": k,
                            "recipe": f"{trial['source']}-{trial['divergence']}",
                            "tau": m[f"tau_{k}"],
                            "tau_theory": m[f"tau_theory_{k}"],
                        }
                    )
        for k, r in sweep["before"].items():
            points.append(
                {
                    "task": name,
                    "temperature": k,
                    "recipe": "undistilled",
                    "tau": r["tau"],
                    "tau_theory": r["tau_theory"],
                }
            )
    if not points:
        raise DistillSpecError("the recipe suite's results hold none of these tasks: run the recipes suite first")
    errors = [abs(p["tau_theory"] - p["tau"]) / p["tau"] for p in points]
    fit = pearson([p["tau_theory"] for p in points], [p["tau"] for p in points])
    out.mkdir(parents=True, exist_ok=True)
    plot_theory(points, out / "theory.png")
    print(
        f"\ntheory vs measured tau: {len(points)} models, pearson r {fit:.3f}, mean |error| "
        f"{100 * sum(errors) / len(errors):.1f}%"
    )
    return {"points": points, "pearson_r": fit, "mean_abs_rel_error": sum(errors) / len(errors)}


def suite_table(scale: Scale, overrides: list[str], out: Path) -> dict:
    """Table C.1: per task, tau and measured speedup (batch 1) before / after DistillSpec."""
    results = {}
    for name in available(scale.tasks):
        cfg, task = with_garden(task_config(name, scale, overrides, out / name))
        source, divergence = suite_recipe(out.parent, name)
        distilled = distilled_draft(cfg, name, task, out.parent, source, divergence)
        target, draft, tokenizer = _pair(cfg)
        grid = replace(cfg, eval=replace(cfg.eval, gammas=[3, 5, 7], temperatures=[0.0, 1.0]))
        records = []
        for phase, model in (("before", draft), ("after", load_model(distilled, device=cfg.device)[0])):
            print(f"== table: {name}, {phase} distillation")
            records += measure_phase(phase, grid, target, model, tokenizer, task, speedup_gammas=[3, 5, 7])
        (out / name).mkdir(parents=True, exist_ok=True)
        plot_tau(
            records,
            out / name / "tau.png",
            title=f"{name}: tau before / after DistillSpec ({source} data + {divergence.upper()}, "
            f"{draft_steps(distilled)} steps)",
        )
        print(format_table(records))
        results[name] = {
            "records": records,
            "distilled": distilled,
            "steps": draft_steps(distilled) or cfg.sweep.steps,
            "recipe": {"source": source, "divergence": divergence},
        }
    return {"tasks": results}


#: Lossy SD settings of Figure 5b: epsilons per lenience, from nearly lossless to very lenient.
LENIENCE_GRID = {
    "lin": [0.5, 0.2, 0.1, 0.05, 0.02],
    "sq": [0.7, 0.45, 0.3, 0.2, 0.14],
    "exp": [0.8, 0.6, 0.4, 0.2, 0.1],
}


def suite_lenience(scale: Scale, overrides: list[str], out: Path) -> dict:
    """Figure 5b: task score vs predicted latency of lossy SD, raw vs distilled draft (T = 1, gamma 5)."""
    results = {}
    for name in available(scale.lenience_tasks or scale.tasks):
        cfg, task = with_garden(task_config(name, scale, overrides, out / name))
        if task.metric is None:
            print(f"skipping {name} in the lenience suite: a language-modelling task has no quality score")
            continue
        source, divergence = suite_recipe(out.parent, name)
        distilled = distilled_draft(cfg, name, task, out.parent, source, divergence)
        target, draft, tokenizer = _pair(cfg)
        gamma = cfg.eval.speedup_gamma
        ids, _ = encode_prompts(tokenizer, [task.test[0].prompt])
        cost = measure_cost_ratio(target, draft, ids.to(target.device), gamma=gamma)
        settings = [(None, 1.0)] + [(f, e) for f, eps in LENIENCE_GRID.items() for e in eps]
        points = []
        for label, model in (("raw", draft), ("distilled", load_model(distilled, device=cfg.device)[0])):
            print(f"== lenience: {name}, {label} draft, {len(settings)} settings")
            points += lenience_points(
                target,
                model,
                tokenizer,
                task,
                label=label,
                settings=settings,
                gamma=gamma,
                cost=cost,
                num_prompts=cfg.eval.num_prompts,
                max_new_tokens=cfg.eval.max_new_tokens,
                seed=cfg.seed,
            )
        (out / name).mkdir(parents=True, exist_ok=True)
        plot_lenience(points, task.metric, out / name / "lenience.png", title=f"{name}: lossy SD, gamma={gamma}, T=1")
        results[name] = {
            "points": points,
            "metric": task.metric,
            "c": cost.c,
            "v": cost.v,
            "gamma": gamma,
            "recipe": {"source": source, "divergence": divergence},
        }
    return {"tasks": results}


def suite_garden(scale: Scale, overrides: list[str], out: Path) -> dict:
    """Figure 6: quality vs latency of raw, distilled, speculative and DistillSpec models over three sizes."""
    results = {}
    for name in available(scale.garden_tasks):
        cfg, task = with_garden(task_config(name, scale, overrides, out / name))
        folder = out / name
        medium = ModelSize(d_model=160, n_layers=4, n_heads=4, d_ff=480)
        m_path = str(build_garden(task, replace(cfg.garden, draft=medium), seed=cfg.seed).draft.resolve())
        s_from_l = distilled_draft(cfg, name, task, out.parent)
        target, small, tokenizer = _pair(cfg)
        mid = load_model(m_path, device=cfg.device)[0]
        dcfg = cell_config(cfg.distill, "draft", "tvd", cfg.sweep.steps)
        kw = {"gammas": [], "temperatures": [], "num_prompts": 0, "max_new_tokens": 1, "seed": cfg.seed}
        print(f"== garden: {name}, distilling the medium model from the large one")
        mid_d, _ = run_cell(target, mid, tokenizer, task, dcfg, **kw)
        print(f"== garden: {name}, distilling the small model from the distilled medium one")
        small_from_mid, _ = run_cell(mid_d, small, tokenizer, task, dcfg, **kw)
        models = {
            "S": small,
            "M": mid,
            "L": target,
            "S distilled": load_model(s_from_l, device=cfg.device)[0],
            "M distilled": mid_d,
        }
        prompts = [e.prompt for e in task.test[: cfg.eval.speedup_prompts]]
        n, new = cfg.eval.num_prompts, cfg.eval.max_new_tokens
        quality = {k: draft_score(m, tokenizer, task, num_prompts=n, max_new_tokens=new) for k, m in models.items()}
        metric = next(iter(k for k in quality["L"] if k != "seconds_per_token"), None)
        specs = [("raw", k, k, None) for k in ("S", "M", "L")]
        specs += [("distilled", k, k, None) for k in ("S distilled", "M distilled")]
        specs += [("speculative", "M + S", "M", small), ("speculative", "L + S", "L", small)]
        specs += [
            ("DistillSpec", "M distilled + S distilled(M)", "M distilled", small_from_mid),
            ("DistillSpec", "L + S distilled", "L", models["S distilled"]),
        ]
        print(f"== garden: {name}, latency of {len(prompts)} prompts at batch 1 per model and pair")
        points = [
            {
                "kind": kind,
                "label": label,
                "seconds_per_token": latency_per_token(
                    models[key], d, tokenizer, prompts, gamma=cfg.eval.speedup_gamma, max_new_tokens=new
                ),
                "score": quality[key].get(metric, float("nan")),
            }
            for kind, label, key, d in specs
        ]
        sizes = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
        folder.mkdir(parents=True, exist_ok=True)
        plot_garden(points, metric, folder / "garden.png", title=f"{name}: model garden, greedy, batch 1")
        for p in points:
            print(
                f"  {p['kind']:>12} {p['label']:>30}: {metric} {p['score']:.3f}, "
                f"{1e3 * p['seconds_per_token']:.2f} ms/token"
            )
        results[name] = {"points": points, "metric": metric, "parameters": sizes, "steps": cfg.sweep.steps}
    return {"tasks": results}


def transfer_pretrained(scale: Scale, overrides: list[str], out: Path, key: str) -> dict:
    """A pretrained pair distilled on task ``key`` (the recipe suite's best recipe), tau gain on its own test prompts
    and on those of the other data sets in ../shared/data, which it never trained on (at T = 0 and 1)."""
    cfg, task = with_garden(task_config(key, scale, overrides, out / key))
    source, divergence = best_recipe(out.parent, key)
    distilled = distilled_draft(cfg, key, task, out.parent, source, divergence)
    target, draft, tokenizer = _pair(cfg)
    tasks = {key: task}
    for other in ("gsm8k", "multi30k", "tinyshakespeare"):
        path = SHARED_DATA / other
        if path.exists() and path != Path(cfg.dataset).resolve():
            tasks[other] = chat_prompts(load_task(str(path), seed=cfg.seed), tokenizer, cfg.chat_template)
    kw = {
        "gammas": [cfg.eval.speedup_gamma],
        "temperatures": [0.0, 1.0],
        "num_prompts": cfg.eval.num_prompts,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "seed": cfg.seed,
    }
    student = load_model(distilled, device=cfg.device)[0]
    rows = {}
    for name, t in tasks.items():
        print(f"== transfer: {source} data + {divergence.upper()} on {key}, measured on {name}")
        rows[name] = {
            f"T{r.pop('temperature'):g}": {k: v for k, v in r.items() if k != "gamma"}
            for r in before_after(target, draft, student, tokenizer, t, **kw)
        }
    print(f"\ntau gain at gamma {cfg.eval.speedup_gamma} of the draft distilled on {key}:")
    for name, r in rows.items():
        print(f"{name:>16}" + "".join(f"  {k}: {100 * v['tau_gain']:>+6.1f}%" for k, v in r.items()))
    return {
        "trained_on": key,
        "recipe": {"source": source, "divergence": divergence},
        "draft": distilled,
        "rows": rows,
        "steps": cfg.sweep.steps,
        "gamma": cfg.eval.speedup_gamma,
    }


def suite_transfer(scale: Scale, overrides: list[str], out: Path) -> dict:
    """One garden pair trained on all the real tasks; a draft distilled on each task, tau gain on every task. A
    pretrained pair (scale real): :func:`transfer_pretrained`."""
    pretrained = [n for n in available(scale.tasks) if setting(n, "target")]
    if pretrained:
        return transfer_pretrained(scale, overrides, out, pretrained[0])
    names = [n for n in available(scale.tasks) if n != "arith"]
    if len(names) < 2:
        raise DistillSpecError("suite transfer needs at least two of the real tasks in ../shared/data")
    base = task_config(
        "arith",
        scale,
        [
            "garden.vocab_size=2048",
            "garden.max_len=128",
            "garden.target_steps=600",
            "garden.draft_steps=600",
            *overrides,
        ],
        out,
    )
    tasks = {n: load_task(task_config(n, scale, overrides, out).dataset, seed=base.seed) for n in names}
    rng = random.Random(base.seed)
    mixed = [e for t in tasks.values() for e in t.train[:6000]]
    rng.shuffle(mixed)
    garden = build_garden(Task("mix-" + "-".join(names), mixed, [], None), base.garden, seed=base.seed)

    target, draft, tokenizer = load_pair(str(garden.target), str(garden.draft), device=base.device, dtype=base.dtype)
    kw = {
        "gammas": [base.eval.speedup_gamma],
        "temperatures": [1.0],
        "num_prompts": base.eval.num_prompts,
        "max_new_tokens": base.eval.max_new_tokens,
        "seed": base.seed,
    }
    before = {n: measure_pair(target, draft, tokenizer, t, **kw)[0] for n, t in tasks.items()}
    matrix = {}
    for src, task in tasks.items():
        print(f"== transfer: distilling on {src}")
        dcfg = cell_config(base.distill, "draft", "tvd", base.sweep.steps)
        student, _ = run_cell(
            target, copy.deepcopy(draft), tokenizer, task, dcfg, **{**kw, "gammas": [], "num_prompts": 0}
        )
        matrix[src] = {}
        for dst, t in tasks.items():
            r = measure_pair(target, student, tokenizer, t, **kw)[0]
            matrix[src][dst] = {"tau": r["tau"], "alpha": r["alpha"], "tau_gain": r["tau"] / before[dst]["tau"] - 1}
    print("\ntau gain (rows: distilled on, columns: measured on):")
    print(" " * 16 + "".join(f"{d:>16}" for d in names))
    for src in names:
        print(f"{src:>16}" + "".join(f"{100 * matrix[src][d]['tau_gain']:>+15.1f}%" for d in names))
    return {
        "tasks": names,
        "before": before,
        "matrix": matrix,
        "garden": str(garden.target.parent),
        "steps": base.sweep.steps,
        "gamma": base.eval.speedup_gamma,
    }
