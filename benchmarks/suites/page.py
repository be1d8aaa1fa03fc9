"""docs/RESULTS.md from the suites' JSON files: every table with the command that made it, plots beside them."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from benchmarks.suites.analysis import plot_async, race
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import plot_recipe_grid, summarise

DIV = {"fkl": "FKL", "jsd": "JSD", "rkl": "RKL", "tvd": "TVD"}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _pm(cell: dict, key: str, scale: float = 100.0, fmt: str = "+.1f", unit: str = "%") -> str:
    s = cell.get(key)
    if s is None:
        return "-"
    text = f"{scale * s['mean']:{fmt}}{unit}"
    return text + (f" ± {scale * s['std']:{fmt.lstrip('+')}}" if s["n"] > 1 else "")


class Page:
    def __init__(self, runs: list[Path], docs: Path, real: bool = False) -> None:
        """``real``: the page of the real pretrained pair, whose images docs/results names with a ``real-`` prefix
        (one folder for both pages)."""
        self.runs, self.docs, self.lines, self.real = runs, docs, [], real
        self.prefix, self.images = "real-" if real else "", docs / "results"

    def add(self, *lines: str) -> None:
        self.lines += lines

    def image(self, rel: str, name: str, alt: str) -> None:
        """Copy ``rel`` from the latest run folder that has it into docs/results and link it."""
        path = next((r / rel for r in reversed(self.runs) if (r / rel).exists()), None)
        if path is not None:
            self.images.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, self.images / f"{self.prefix}{name}")
            self.add(f"![{alt}](results/{self.prefix}{name})", "")

    def plot(self, fn, data: dict, name: str, alt: str) -> None:
        """Draw ``fn(data, path)`` into docs/results (for figures of data merged from several runs) and link it."""
        self.images.mkdir(parents=True, exist_ok=True)
        fn(data, self.images / f"{self.prefix}{name}")
        self.add(f"![{alt}](results/{self.prefix}{name})", "")

    def header(self, title: str, data: dict) -> None:
        self.add(f"## {title}", "")
        for run in data["runs"]:
            tasks = f" ({', '.join(run['tasks'])})" if len(data["runs"]) > 1 and run["tasks"] else ""
            self.add(f"Made by `{run['command']}`{tasks}: {run['scale']} scale, {run['seconds'] / 60:.1f} min.", "")


#: A recipe's data source in words.
SOURCES = {"draft": "on-policy data", "target": "target samples", "fixed": "fixed answers", "mixed": "mixed data"}


def _recipe(data: dict) -> str:
    """The recipe a suite's drafts were distilled with, in words (DistillSpec's default where the JSON names none)."""
    r = next(iter(t["recipe"] for t in data["tasks"].values() if t.get("recipe")), None)
    if r is None or (r["source"], r["divergence"]) == ("draft", "tvd"):
        return "DistillSpec's default recipe (on-policy data + TVD)"
    return f"the recipe suite's best ({SOURCES[r['source']]} + {r['divergence'].upper()})"


def _table(page: Page, data: dict) -> None:
    page.header("Table C.1 analogue: block efficiency and speedup without and with distillation", data)
    before = (
        "the draft made of the target's first two layers"
        if page.real
        else "the garden draft (trained on the task's data, the paper's fine-tuned baseline)"
    )
    page.add(
        f"Before: {before}. After: the same draft distilled with {_recipe(data)}. "
        "tau on held-out prompts; speedup is measured wall-clock tokens/s of SD over the target alone, one prompt at "
        "a time, on this machine.",
        "",
    )
    for task, t in data["tasks"].items():
        recs = t["records"]
        before = {(r["gamma"], r["temperature"]): r for r in recs if r["phase"] == "before"}
        page.add(f"**{task}** ({t['steps']} distillation steps)", "")
        page.add(
            "| gamma | T | alpha before | alpha after | tau before | tau after | tau gain | speedup before "
            "| speedup after |"
        )
        page.add("|---|---|---|---|---|---|---|---|---|")
        for a in (r for r in recs if r["phase"] == "after"):
            b = before[(a["gamma"], a["temperature"])]
            page.add(
                f"| {a['gamma']} | {a['temperature']:g} | {b['alpha']:.3f} | {a['alpha']:.3f} | {b['tau']:.2f} | "
                f"{a['tau']:.2f} | {_pct(a['tau'] / b['tau'] - 1)} | {b['measured_speedup']:.2f}x | "
                f"{a['measured_speedup']:.2f}x |"
            )
        page.add("")
        page.image(f"table/{task}/tau.png", f"table-{task}.png", f"tau before/after on {task}")


def _recipes(page: Page, data: dict) -> None:
    page.header("Figure 4 analogue: the recipe grid (data source x divergence)", data)
    page.add(
        "Each cell distils the draft for the same number of steps with one data source (fixed = the data set's "
        "references, SupKD; draft = on-policy samples; target = target samples, SeqKD; mixed = half each) and one "
        "divergence, as a Ray Tune trial (`jobs/sweep.py`). Tau gain is over the undistilled draft at gamma = 5; "
        "'draft score' is the distilled draft's own greedy task score. ± is the standard deviation over seeds.",
        "",
    )
    for task, sweep in data["tasks"].items():
        temps = sorted({k[len("tau_gain_") :] for c in sweep["cells"] for k in c if k.startswith("tau_gain_")})
        score = next((k for k in sweep["cells"][0] if k.startswith("draft_") and k != "draft_seconds_per_token"), None)
        seeds = len(sweep["cells"][0]["seeds"])
        page.add(f"**{task}** ({sweep['steps']} steps a cell, {seeds} seed{'s' * (seeds > 1)})", "")
        head = "| data | divergence | " + " | ".join(f"tau gain {t.replace('T', 'T=')}" for t in temps)
        page.add(head + (f" | draft {score[6:]} |" if score else " |"))
        page.add("|---|---|" + "---|" * (len(temps) + bool(score)))
        for c in sorted(sweep["cells"], key=lambda c: (c["source"], c["divergence"])):
            row = f"| {c['source']} | {DIV[c['divergence']]} | " + " | ".join(_pm(c, f"tau_gain_{t}") for t in temps)
            page.add(row + (f" | {_pm(c, score, 1.0, '.3f', '')} |" if score else " |"))
        b = sweep["best"]
        page.add("", f"Best recipe on {task}: **{b['source']} data + {DIV[b['divergence']]}**.", "")
        page.add(*_on_policy_verdict(task, sweep, temps), "")
        page.plot(
            plot_recipe_grid, {"task": task, **sweep}, f"recipes-{task}.png", f"recipe grid on {task}"
        )  # pooled over runs


def _on_policy_verdict(task: str, sweep: dict, temps: list[str]) -> list[str]:
    """On-policy (draft) vs fixed data, per temperature: the mean over divergences, and DistillSpec vs SupKD."""
    cells = {(c["source"], c["divergence"]): c for c in sweep["cells"]}
    lines = []
    for t in temps:
        key = f"tau_gain_{t}"
        draft = [c[key]["mean"] for (s, _), c in cells.items() if s == "draft"]
        fixed = [c[key]["mean"] for (s, _), c in cells.items() if s == "fixed"]
        if not draft or not fixed:
            continue
        d, f = sum(draft) / len(draft), sum(fixed) / len(fixed)
        verdict = "ties with" if abs(d - f) < 0.01 else "beats" if d > f else "does NOT beat"
        line = (
            f"- {t.replace('T', 'T=')}: on-policy data {verdict} fixed data on {task} "
            f"(mean tau gain over divergences {_pct(d)} vs {_pct(f)})"
        )
        if ("draft", "tvd") in cells and ("fixed", "fkl") in cells:
            line += (
                f"; DistillSpec (draft + TVD) {_pct(cells[('draft', 'tvd')][key]['mean'])} vs SupKD (fixed + FKL) "
                f"{_pct(cells[('fixed', 'fkl')][key]['mean'])}"
            )
        lines.append(line + ".")
    return lines


def _theory(page: Page, data: dict) -> None:
    page.header("Figure 3c analogue: tau from TVD vs tau measured", data)
    page.add(
        f"One point per model of the recipe grid (and the undistilled drafts), at T = 0 and T = 1: the tau that "
        f"alpha = 1 - E[TVD(p, q)] predicts, (1 - alpha^(gamma+1)) / (1 - alpha), against the tau speculative decoding "
        f"measured. {len(data['points'])} points; Pearson r = **{data['pearson_r']:.3f}**; mean |error| = "
        f"{100 * data['mean_abs_rel_error']:.1f}% of the measured tau.",
        "",
    )
    page.image("theory/theory.png", "theory.png", "theoretical vs empirical tau")


def _lenience(page: Page, data: dict) -> None:
    page.header("Figure 5b analogue: quality vs latency with lossy speculative decoding", data)
    page.add(
        "Lenience f(p, epsilon) in the acceptance min(1, f(p)/q): lin = p/eps, sq = p/eps^2, exp = p^eps, over a range "
        "of epsilon, with the raw and the distilled draft (gamma = 5, T = 1). Latency relative to the target alone is "
        f"(c*gamma + v)/tau with the measured cost ratio c and verify cost v of this machine. Distilled with "
        f"{_recipe(data)}.",
        "",
    )
    for task, t in data["tasks"].items():
        metric = t["metric"]
        page.add(f"**{task}** (c = {t['c']:.3f}, v = {t['v']:.2f})", "")
        page.add(
            f"| draft | lenience | epsilon | alpha | tau | relative latency | {metric} |",
            "|---|---|---|---|---|---|---|",
        )
        for p in t["points"]:
            page.add(
                f"| {p['draft']} | {p['lenience'] or 'lossless'} | {p['epsilon']:g} | {p['alpha']:.3f} | "
                f"{p['tau']:.2f} | {p['relative_latency']:.3f} | {p[metric]:.3f} |"
            )
        page.add("")
        page.image(f"lenience/{task}/lenience.png", f"lenience-{task}.png", f"lenience on {task}")


def _garden(page: Page, data: dict) -> None:
    page.header("Figure 6 analogue: the model garden", data)
    page.add(
        "Three sizes S < M < L of one architecture trained on the task (L is the target). Raw: each model decoding "
        "alone. Distilled: S and M distilled from L (on-policy + TVD) decoding alone. Speculative: M or L with the raw "
        "S as draft. DistillSpec: the distilled M with an S distilled from it, and L with the S distilled from L. "
        "Greedy decoding, batch 1; speculative output equals its target's, so it has the target's score.",
        "",
    )
    for task, t in data["tasks"].items():
        params = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in t["parameters"].items() if "distilled" not in k)
        page.add(
            f"**{task}** (parameters: {params})",
            "",
            f"| kind | model | {t['metric']} | ms per token |",
            "|---|---|---|---|",
        )
        for p in t["points"]:
            page.add(f"| {p['kind']} | {p['label']} | {p['score']:.3f} | {1e3 * p['seconds_per_token']:.2f} |")
        page.add("")
        page.image(f"garden/{task}/garden.png", f"garden-{task}.png", f"model garden on {task}")


def _transfer(page: Page, data: dict) -> None:
    page.header("Transfer: a draft distilled on one task, measured on the others", data)
    if "rows" in data:  # a pretrained pair: one draft, distilled on one task
        recipe = data["recipe"]
        temps = list(next(iter(data["rows"].values())))
        page.add(
            f"The draft distilled on {data['trained_on']} ({data['steps']} steps, {recipe['source']} data + "
            f"{DIV[recipe['divergence']]}, the recipe grid's best), against the undistilled draft on the held-out "
            f"prompts of each data set, at gamma = {data['gamma']}.",
            "",
            "| measured on | " + " | ".join(f"alpha {t} | tau {t} | tau gain {t}" for t in temps) + " |",
            "|---|" + "---|---|---|" * len(temps),
        )
        for name, row in data["rows"].items():
            cells = [
                f"{r['alpha_before']:.3f} -> {r['alpha_after']:.3f} | {r['tau_before']:.2f} -> {r['tau_after']:.2f} | "
                f"{_pct(r['tau_gain'])}"
                for r in row.values()
            ]
            page.add(f"| {name} | " + " | ".join(cells) + " |")
        page.add("")
        return
    names = data["tasks"]
    page.add(
        f"One garden pair trained on all of {', '.join(names)} (one tokenizer); its draft distilled on each task "
        f"({data['steps']} steps, on-policy + TVD), tau gain at gamma = {data['gamma']}, T = 1 on every task's "
        "held-out prompts. Rows: distilled on; columns: measured on.",
        "",
        "| distilled on | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    )
    for src in names:
        page.add(f"| {src} | " + " | ".join(_pct(data["matrix"][src][d]["tau_gain"]) for d in names) + " |")
    page.add("")


def _assisted(page: Page, data: dict) -> None:
    page.header("Peer: transformers assisted generation", data)
    compiled = all("ours_sd_compiled" in t[temp] for t in data["tasks"].values() for temp in ("T0", "T1"))
    page.add(
        "Same garden pair, same gamma, batch 1, one prompt at a time: `target.generate(assistant_model=draft)` with a "
        "constant `num_assistant_tokens` = gamma, against this project's `speculative_generate`; and the same at "
        "batch 8, which assisted generation does not support."
        + (
            " *Compiled*: `speculative_generate(..., compile=True)`, both models' decoding steps through "
            "`torch.compile` at static shapes; compiling (with one pass over the prompts) is left out of the timed "
            "rounds and reported."
            if compiled
            else ""
        ),
        "",
        "| task | T | HF generate | HF assisted | DistillSpec, target only | DistillSpec SD | DistillSpec SD batch 8 "
        "| DistillSpec SD / HF assisted | "
        + ("DistillSpec SD compiled | compiled / HF assisted | compile s | " if compiled else "")
        + "greedy outputs equal |",
        "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if compiled else "") + "---|",
    )

    def bold(ratio: float) -> str:
        return f"**{ratio:.3f}x**"

    for task, t in data["tasks"].items():
        for temp in ("T0", "T1"):
            r = t[temp]
            hf = r.get("hf_greedy", r.get("hf_sample"))
            agree = f"{100 * r['greedy_outputs_agree']:.0f}%" if "greedy_outputs_agree" in r else "-"
            extra = (
                f"{r['ours_sd_compiled']['tokens_per_s']:.1f} | {bold(r['ratio_ours_sd_compiled_over_hf_assisted'])}"
                f" | {r['compile_and_first_pass_s']:.0f} | "
                if compiled
                else ""
            )
            page.add(
                f"| {task} | {temp[1:]} | {hf['tokens_per_s']:.1f} | {r['hf_assisted']['tokens_per_s']:.1f} | "
                f"{r['ours_target_only']['tokens_per_s']:.1f} | {r['ours_sd']['tokens_per_s']:.1f} | "
                f"{r['ours_sd_batch8']['tokens_per_s']:.1f} | {bold(r['ratio_ours_sd_over_hf_assisted'])} | "
                f"{extra}{agree} |"
            )
    page.add(
        "",
        "Tokens/s: the median of interleaved rounds (every method once per round, in one process), since this "
        "machine's speed drifts from minute to minute.",
        "",
    )


def _trl(page: Page, data: dict) -> None:
    page.header("Peer: TRL's on-policy distillation trainer", data)
    page.add(
        "TRL's `DistillationTrainer` (on-policy generalised JSD, the GKD trainer's successor) against this "
        "project's loop with the matching recipe (`gkd`: draft-generated data, JSD with the same beta), same "
        "pair, prompts, batch, learning rate, schedule and steps. alpha (gamma = 5, T = 1, held-out prompts) "
        "against training seconds; evaluations are left out of the clock. The common alpha is the lower of "
        "the two best; the table gives the time each loop needs to reach it.",
        "",
        "| task | steps | batch | alpha start | alpha DistillSpec | alpha TRL | seconds DistillSpec | seconds TRL "
        "| time to the same alpha, DistillSpec / TRL |",
        "|---|---|---|---|---|---|---|---|---|",
    )

    for task, r in data["tasks"].items():
        reached = race(r["curves"]["ours"], r["curves"]["trl"])
        ratio = reached["ratio"]
        if ratio is None:
            verdict = "neither raised alpha above the start"
        else:
            verdict = f"**{ratio:.2f}x** at alpha {reached['goal_alpha']:.3f}"
        page.add(
            f"| {task} | {r['steps']} | {r['batch_size']} | {r['alpha_start']:.3f} | {r['alpha_final']['ours']:.3f} | "
            f"{r['alpha_final']['trl']:.3f} | {r['train_seconds']['ours']:.0f} | "
            f"{r['train_seconds']['trl']:.0f} | {verdict} |"
        )
        if "time_ratio_best_over_trl" in r:
            b, src = r["time_ratio_best_over_trl"], r["best_recipe"]
            page.add(
                f"| {task}, DistillSpec with the task's best recipe ({src['source']} data, {src['divergence']}) | "
                f"{r['steps']} | {r['batch_size']} | {r['alpha_start']:.3f} | "
                f"{r['curves']['ours_best'][-1]['alpha']:.3f} | {r['alpha_final']['trl']:.3f} | "
                f"{r['curves']['ours_best'][-1]['seconds']:.0f} | {r['train_seconds']['trl']:.0f} | "
                + ("-" if b is None else f"**{b:.2f}x** at alpha {r['best_goal_alpha']:.3f}")
                + " |"
            )
    page.add("")
    for task in data["tasks"]:
        page.image(f"trl/{task}/trl.png", f"trl-{task}.png", f"alpha vs time on {task}")


def _async(page: Page, data: dict) -> None:
    page.header("The asynchronous pipeline against the synchronous loop", data)
    c = data["step_costs"]
    stages = ", ".join(f"{k} {v:.2f} s ({c['stages_1thread'][k]:.2f} s)" for k, v in c["stages"].items())
    page.add(
        f"The same pair, data and recipe, trained for {data['budget']:.0f} s of wall-clock time by the one-process "
        "loop (`ray.mode=sync`: sample, score, update in turn) and by the Ray pipeline with the target's logits "
        "computed in the learner (`async`, the default: two rollout actors) or in a scoring actor (`async-scorer`: "
        "one rollout actor, one scorer). One torch thread per actor; no evaluations while training. alpha at gamma 5, "
        "T = 1 on "
        "held-out prompts. *Bound*: the most the pipeline's actors allow on these cores, from the stage times of one "
        f"step measured alone ({c['batch_size']} sequences x {c['max_new_tokens']} tokens, {c['threads']} threads, "
        f"one thread in brackets): {stages}; with each stage on its own device the bound is "
        f"{c['bound_own_devices']:.2f}x.",
        "",
        "| pipeline | learner steps | steps/s | x sync | bound | of bound | samples/s | policy lag | alpha before | "
        "alpha after | tau after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    )
    logs = {}
    for name in data["pipelines"]:
        paths = [r / "async" / name / "train_log.json" for r in reversed(page.runs)]
        path = next((p for p in paths if p.exists()), None)
        if path is not None:
            logs[name] = json.loads(path.read_text())
    for name, r in data["pipelines"].items():
        page.add(
            f"| {name} | {r['steps']} | {r['steps_per_s']:.3f} | {r['ratio_steps_per_s']:.2f}x | {r['bound']:.2f}x | "
            f"{r['of_bound']:.2f} | {r['samples_per_s']:.2f} | {r['mean_lag']:.2f} | {r['alpha_before']:.3f} | "
            f"{r['alpha_after']:.3f} | {r['tau_after']:.2f} |"
        )
    page.add("")
    if logs:
        page.plot(plot_async, logs, "async.png", "learner steps and training loss over wall-clock time per pipeline")


SECTIONS = {
    "async": _async,
    "table": _table,
    "recipes": _recipes,
    "theory": _theory,
    "lenience": _lenience,
    "garden": _garden,
    "transfer": _transfer,
    "assisted": _assisted,
    "trl": _trl,
}


def merge(runs: list[dict]) -> dict:
    """One suite's results from several run folders: per task, the latest run that has it wins."""
    merged = dict(runs[-1])
    latest = {task: i for i, r in enumerate(runs) if isinstance(r.get("tasks"), dict) for task in r["tasks"]}
    credited = []  # (run, the tasks it gives the page): the latest run of each task, every seed of a recipe grid
    for i, r in enumerate(runs):
        if not isinstance(r.get("tasks"), dict):
            credited.append((r, []))
            continue
        tasks = [t for t, v in r["tasks"].items() if latest[t] == i or _pools(v, t, i, runs)]
        if tasks:
            credited.append((r, tasks))
    merged["runs"] = [
        {"command": r["command"], "scale": r["scale"], "seconds": r["seconds"], "tasks": tasks} for r, tasks in credited
    ]
    merged["seconds"] = sum(r["seconds"] for r, _ in credited)
    if isinstance(merged.get("tasks"), dict):
        merged["tasks"] = {k: v for r in runs for k, v in r["tasks"].items()}
        for task, sweep in merged["tasks"].items():  # recipe grids of one task from several runs: pool the seeds
            if "trials" in sweep:
                merged["tasks"][task] = pool_seeds([r["tasks"][task] for r in runs if task in r.get("tasks", {})])
    if "points" in merged:  # theory: the latest run's points for each task
        latest = {p["task"]: i for i, r in enumerate(runs) for p in r["points"]}
        merged["points"] = [p for i, r in enumerate(runs) for p in r["points"] if latest[p["task"]] == i]
        x, y = [p["tau_theory"] for p in merged["points"]], [p["tau"] for p in merged["points"]]
        merged["pearson_r"] = pearson(x, y)
        merged["mean_abs_rel_error"] = sum(abs(a - b) / b for a, b in zip(x, y)) / len(x)
    return merged


def _pools(sweep: dict, task: str, i: int, runs: list[dict]) -> bool:
    """Whether run ``i``'s recipe grid of ``task`` gives the pooled grid a seed no later run replaces."""
    key = ("target", "draft", "steps")
    later = [r["tasks"][task] for r in runs[i + 1 :] if task in r.get("tasks", {})]
    if "trials" not in sweep or any(any(s.get(k) != sweep.get(k) for k in key) for s in later):
        return False
    seeds = {(t["source"], t["divergence"], t["seed"]) for t in sweep["trials"]}
    return bool(seeds - {(t["source"], t["divergence"], t["seed"]) for s in later for t in s.get("trials", [])})


def pool_seeds(sweeps: list[dict]) -> dict:
    """One recipe grid from runs of the same task and pair with different seeds (a later run wins a seed)."""
    same = {(s.get("target"), s.get("draft"), s["steps"]) for s in sweeps}
    if len(sweeps) == 1 or len(same) > 1:  # different pairs or budgets do not pool: the latest run wins
        return sweeps[-1]
    trials = {(t["source"], t["divergence"], t["seed"]): t for s in sweeps for t in s["trials"]}
    pooled = dict(sweeps[-1])
    pooled["trials"] = list(trials.values())
    pooled["cells"] = summarise(pooled["trials"], pooled["rank"])
    best = pooled["cells"][0]
    pooled["best"] = {"source": best["source"], "divergence": best["divergence"], pooled["rank"]: best[pooled["rank"]]}
    return pooled


def pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sx, sy = math.sqrt(sum((a - mx) ** 2 for a in x)), math.sqrt(sum((b - my) ** 2 for b in y))
    return sxy / (sx * sy) if sx and sy else float("nan")


#: The two results pages, the garden models' and the real pretrained pair's (``--scale real``): the page, and the
#: notes written by hand that end it (inputs of the page, kept under ``benchmarks/notes/``).
PAGES = {False: ("RESULTS.md", "results.md"), True: ("RESULTS-real.md", "results-real.md")}
NOTES = Path(__file__).resolve().parents[1] / "notes"


def write_page(runs: Path | list[Path], docs: Path, *, real: bool = False) -> Path:
    """Write ``docs/RESULTS.md`` (``real``: ``docs/RESULTS-real.md``), and copy the plots to ``docs/results/``, from
    the suites' JSON files under ``runs`` (one folder, or several whose tasks are merged: the latest folder wins a
    task they share)."""
    runs = [runs] if isinstance(runs, Path) else runs
    found = {}
    for name in SECTIONS:
        parts = [json.loads((r / f"{name}.json").read_text()) for r in runs if (r / f"{name}.json").exists()]
        if parts:
            found[name] = merge(parts)
    if not found:
        where = ", ".join(str(r) for r in runs)
        raise DistillSpecError(f"no suite results under {where}: run e.g. `python benchmarks/benchmark.py quick` first")
    filename, notes = PAGES[real]
    page = Page(runs, docs, real)
    total = sum(d["seconds"] for d in found.values())
    machine = next(iter(found.values()))["machine"]
    models = (
        "Models: SmolLM2-135M-Instruct (the target) and a draft made of its first two layers with its embeddings, "
        "final norm and tied head (`--draft first:2`), prompts through the target's chat template; budgets are sized "
        "for a CPU, so the figures are early-training figures on a real model"
        if real
        else "Models are the project's garden (Llama-architecture models trained from scratch here), so absolute "
        "figures are small-model, CPU figures; the directions are what to compare with the paper"
    )
    page.add(
        "# Results on a real pretrained pair" if real else "# Results",
        "",
        f"Generated by `python benchmarks/benchmark.py report{' --scale real' * real}` on {time.strftime('%Y-%m-%d')} "
        f"from the suites' JSON; every section names the command that made it. Machine: {machine}, no GPU. The suites "
        f"below took {total / 60:.1f} minutes in all. {models}.",
        "",
    )
    for name, data in found.items():
        SECTIONS[name](page, data)
    if (NOTES / notes).exists():
        page.add((NOTES / notes).read_text())
    docs.mkdir(parents=True, exist_ok=True)
    path = docs / filename
    path.write_text("\n".join(page.lines).rstrip() + "\n")
    return path
