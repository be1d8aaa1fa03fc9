"""What the paper and peer suites share: the tasks, the two scales, configs per task, the distilled drafts."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from distillspec.config import JobConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = (ROOT / ".." / "shared" / "data").resolve()

#: The garden every benchmark trains unless told otherwise: the figures in docs/ were measured with this target (6.9M
#: parameters), learning rate and step count. The job's default garden has a narrower target that trains in a third
#: of the time (``distillspec.config.GardenConfig``).
BENCHMARK_GARDEN = [
    "garden.target.d_model=256",
    "garden.target.d_ff=768",
    "garden.lr=2e-3",
    "garden.target_steps=400",
]

#: Garden settings per task (the real data sets are read in place from ../shared/data).
TASKS: dict[str, list[str]] = {
    "arith": [*BENCHMARK_GARDEN, "dataset=arith"],
    "gsm8k": [
        *BENCHMARK_GARDEN,
        f"dataset={SHARED_DATA / 'gsm8k'}",
        "garden.vocab_size=2048",
        "garden.target_steps=600",
        "garden.draft_steps=600",
        "garden.batch_size=16",
        "garden.max_len=256",
    ],
    "multi30k": [
        *BENCHMARK_GARDEN,
        f"dataset={SHARED_DATA / 'multi30k'}",
        "garden.vocab_size=2048",
        "garden.max_len=64",
        "garden.target_steps=600",
        "garden.draft_steps=600",
        "eval.max_new_tokens=48",
    ],
    "tinyshakespeare": [
        *BENCHMARK_GARDEN,
        f"dataset={SHARED_DATA / 'tinyshakespeare'}",
        "garden.max_len=128",
        "garden.target_steps=600",
        "garden.draft_steps=600",
    ],
}


@dataclass
class Scale:
    """How much each suite runs: ``quick`` (<= 20 minutes on 2 CPU cores) or ``full``."""

    name: str
    tasks: list[str]
    steps: int  #: distillation steps per recipe cell
    num_prompts: int  #: held-out prompts per measurement
    seeds: list[int]
    speedup_prompts: int  #: prompts decoded one at a time for wall-clock figures
    peer_steps: int  #: distillation steps in the TRL comparison
    garden_tasks: list[str] = field(default_factory=lambda: ["arith"])


SCALES = {
    "quick": Scale("quick", ["arith"], steps=40, num_prompts=32, seeds=[0], speedup_prompts=8, peer_steps=120),
    "full": Scale(
        "full",
        ["arith", "gsm8k", "multi30k", "tinyshakespeare"],
        steps=80,
        num_prompts=64,
        seeds=[0, 1],
        speedup_prompts=16,
        peer_steps=240,
    ),
}


def available(tasks: list[str], log=print) -> list[str]:
    """``tasks`` less those whose data is not on this machine (a fresh machine has only arith)."""
    kept = []
    for name in tasks:
        if name != "arith" and not (SHARED_DATA / name).exists():
            log(f"skipping {name}: {SHARED_DATA / name} is not on this machine")
            continue
        kept.append(name)
    return kept


def task_config(task: str, scale: Scale, overrides: list[str], out: Path) -> JobConfig:
    """The task's garden and data, the scale's measurement sizes, then the user's overrides."""
    return load_config(
        None,
        [
            *TASKS[task],
            f"output_dir={out}",
            f"eval.num_prompts={scale.num_prompts}",
            f"eval.speedup_prompts={scale.speedup_prompts}",
            f"sweep.steps={scale.steps}",
            f"sweep.seeds={scale.seeds}",
            *overrides,
        ],
    )


def with_garden(cfg: JobConfig, log=print):
    """``cfg`` with the garden pair's paths filled in (built or reused), and the task."""
    from distillspec.data import load_task
    from distillspec.garden import build_garden

    task = load_task(cfg.dataset, seed=cfg.seed)
    if cfg.target is None:
        garden = build_garden(task, cfg.garden, seed=cfg.seed, log=log)
        cfg = replace(cfg, target=str(garden.target.resolve()), draft=str(garden.draft.resolve()))
    return cfg, task


def distilled_draft(cfg: JobConfig, task, out: Path, source: str = "draft", divergence: str = "tvd") -> str:
    """The DistillSpec draft of a task (on-policy data + TVD by default, seed 0, ``sweep.steps`` steps).

    Reuses the recipe suite's draft when it exists (``out/recipes/<task>/drafts``), else distils one.
    """
    from distillspec.config import cell_config
    from distillspec.models import load_pair
    from distillspec.study import run_cell

    name = f"{source}-{divergence}-s0"
    for folder in (out / "recipes" / task.name / "drafts" / name, out / "drafts" / task.name / name):
        if (folder / "config.json").exists():
            return str(folder)
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, target_dtype=cfg.target_dtype)
    dcfg = cell_config(cfg.distill, source, divergence, cfg.sweep.steps)
    student, _ = run_cell(
        target, draft, tokenizer, task, dcfg, gammas=[], temperatures=[], num_prompts=0, max_new_tokens=1
    )
    student.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    meta = {"source": source, "divergence": divergence, "steps": dcfg.steps}
    (folder / "distillspec.json").write_text(json.dumps(meta))
    return str(folder)


def draft_steps(folder: str | Path) -> int | None:
    """How many steps a saved draft was distilled for: its ``distillspec.json``, else its recipe suite's JSON
    (``<out>/recipes.json`` for ``<out>/recipes/<task>/drafts/<cell>``)."""
    folder = Path(folder)
    if (folder / "distillspec.json").exists():
        return json.loads((folder / "distillspec.json").read_text()).get("steps")
    suite = folder.parents[3] / "recipes.json" if len(folder.parents) > 3 else None
    if suite is not None and suite.exists():
        return json.loads(suite.read_text()).get("tasks", {}).get(folder.parents[1].name, {}).get("steps")
    return None


def command() -> str:
    """The command line that is running (recorded with each suite's results)."""
    script = Path(sys.argv[0]).resolve()
    head = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else sys.argv[0]
    return " ".join(["python", head, *sys.argv[1:]])
