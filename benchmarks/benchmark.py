"""Benchmarks that print figures and ratios and write JSON: a runner over the suites of ``benchmarks/suites/``, a file
per subject. ``python benchmarks/benchmark.py SUITE --help`` tells what a suite measures and how to run it.

    python benchmarks/benchmark.py --list                        # the suites, a line each
    python benchmarks/benchmark.py async --budget 300            # suites, then config overrides (section.key=value)
    python benchmarks/benchmark.py gamma serve.temperature=0
    python benchmarks/benchmark.py quick report                  # the results page: its suites, then docs/RESULTS.md
    python benchmarks/benchmark.py full report                   # (the full group implies --scale full)
    python benchmarks/benchmark.py real report --output-dir outputs/real   # the SmolLM2 pair: docs/RESULTS-real.md
    python benchmarks/benchmark.py report --runs outputs/benchmark outputs/real   # one page from several runs
    python benchmarks/benchmark.py speed target=... --draft-vocab 32768   # a suite with options of its own

Suites of the results page take ``--scale quick`` (the arith garden, <= 20 minutes on 2 CPU cores), ``full`` (also
GSM8K, Multi30k and tinyshakespeare from ../shared/data, several seeds) or ``real`` (the SmolLM2 pair, each suite
within an hour on 2 CPU cores). The other suites of this runner train the benchmark garden, or with ``--scale real``
that pair. Suites with options of their own (``speed``, ``trajectory``, ``draft-vocab``, ``draft-temperature``,
``stop``, ``gpu``, ``topk``, ``lossy``, ``transfer-run``, ``following``, ``client``) take the rest of the command
line as they are, also as ``python -m benchmarks.suites.NAME``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from benchmarks.suites.common import BENCHMARK_GARDEN, SCALES, TASKS, command
from benchmarks.suites.page import write_page
from distillspec.cli import run_main
from distillspec.errors import DistillSpecError


@dataclass(frozen=True)
class Suite:
    """A suite: its file under ``benchmarks/suites/`` and its function. ``runner``: ``f(overrides, budget, out,
    **options)``; ``page``: a results-page suite, ``f(scale, overrides, out)``; ``command``: the file's own
    ``main()``, which reads the rest of the command line."""

    module: str
    function: str
    kind: Literal["runner", "page", "command"] = "runner"
    distilled: bool = False  #: takes --distilled

    def load(self) -> Callable:
        return getattr(importlib.import_module(f"benchmarks.suites.{self.module}"), self.function)

    def doc(self) -> str:
        return importlib.import_module(f"benchmarks.suites.{self.module}").__doc__ or ""

    def summary(self) -> str:
        """The first sentence of the suite's docstring (of its file's, for a suite with a command line of its own)."""
        text = " ".join((self.doc() if self.kind == "command" else self.load().__doc__ or "").split())
        first = text.split(". ")[0].split(": ")[0]
        return first if len(first) <= 100 else first[:99] + "…"


SUITES = {
    "async": Suite("pipeline", "suite_async"),
    "serve": Suite("endpoint", "suite_serve", distilled=True),
    "soak": Suite("endpoint", "suite_soak"),
    "fuzz": Suite("endpoint", "suite_fuzz"),
    "gamma": Suite("gamma", "suite_gamma"),
    "online": Suite("online", "suite_online", distilled=True),
    "latency": Suite("latency", "suite_latency", distilled=True),
    "precision": Suite("precision", "suite_precision"),
    "int8": Suite("int8", "main", "command"),
    "integrity": Suite("transport", "suite_integrity"),
    "trace": Suite("transport", "suite_trace"),
    "vllm": Suite("vllm_engine", "suite_vllm", distilled=True),
    "vllm-acceptance": Suite("vllm_engine", "suite_vllm_acceptance"),
    "recipes": Suite("paper", "suite_recipes", "page"),
    "theory": Suite("paper", "suite_theory", "page"),
    "table": Suite("paper", "suite_table", "page"),
    "lenience": Suite("paper", "suite_lenience", "page"),
    "garden": Suite("paper", "suite_garden", "page"),
    "transfer": Suite("paper", "suite_transfer", "page"),
    "assisted": Suite("peers", "suite_assisted", "page"),
    "trl": Suite("peers", "suite_trl", "page"),
    "speed": Suite("speed", "main", "command"),
    "trajectory": Suite("trajectory", "main", "command"),
    "draft-vocab": Suite("draft_vocab", "main", "command"),
    "draft-temperature": Suite("draft_temperature", "main", "command"),
    "acceptance-by-kind": Suite("acceptance_by_kind", "main", "command"),
    "stop": Suite("stop", "main", "command"),
    "gpu": Suite("gpu", "main", "command"),
    "topk": Suite("topk", "main", "command"),
    "lossy": Suite("lossy", "main", "command"),
    "transfer-run": Suite("transfer_run", "main", "command"),
    "following": Suite("following", "main", "command"),
    "client": Suite("client", "main", "command"),
    "sampler": Suite("sampler", "main", "command"),
    "rollout-draft": Suite("rollout_draft", "main", "command"),
    "target-kernel": Suite("target_kernel", "main", "command"),
    "long-prompts": Suite("long_prompts", "main", "command"),
    "prompt-cache": Suite("prompt_cache", "main", "command"),
}
#: Suite groups: the results page at each scale (``report`` then writes docs/RESULTS.md from the JSON).
GROUPS = {
    "quick": ["recipes", "theory", "table", "lenience", "assisted", "trl"],
    "full": ["recipes", "theory", "table", "lenience", "garden", "transfer", "assisted", "trl"],
    "real": ["async", "recipes", "theory", "table", "transfer", "lenience", "trl"],
}
NAMES = sorted([*SUITES, *GROUPS, "report"])


def timed(name: str, scale: str, run: Callable[[], dict]) -> dict:
    """A suite's results, with the command, scale, machine and minutes that made them (what the results page cites)."""
    start = time.perf_counter()
    result = run()
    return {
        "suite": name,
        "scale": scale,
        "command": command(),
        "seconds": time.perf_counter() - start,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        **result,
    }


def page_suite(name: str, scale: str, overrides: list[str], out: Path, tasks: list[str] | None) -> Callable[[], dict]:
    """A results-page suite at ``scale``, on ``tasks`` where given (each task's settings come from TASKS)."""
    sizes = SCALES[scale]
    if tasks:
        if unknown := sorted(set(tasks) - set(TASKS)):
            raise DistillSpecError(f"--tasks {unknown[0]!r}: choose from {sorted(TASKS)}")
        sizes = replace(sizes, tasks=tasks, garden_tasks=tasks)
    return functools.partial(SUITES[name].load(), sizes, overrides, out / name)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="+", metavar="SUITE", help=f"one or more of {NAMES}, then config overrides")
    parser.add_argument(
        "--scale",
        choices=["quick", "full", "real"],
        help="sizes of the results-page suites (default: the group's, else quick); real: the real pretrained pair",
    )
    parser.add_argument(
        "--budget", type=float, help="seconds of training per pipeline (async, gamma --distilling, online, soak)"
    )
    parser.add_argument("-o", "--output-dir", default="outputs/benchmark")
    docs = str(Path(__file__).resolve().parents[1] / "docs")
    parser.add_argument("--docs", default=docs, help="suite report: where RESULTS.md and its plots go")
    parser.add_argument("--tasks", nargs="+", help="results-page suites: only these tasks (default: the scale's)")
    parser.add_argument(
        "--runs", nargs="+", help="suite report: run folders to merge (default: --output-dir); later ones win a task"
    )
    with_distilled = [n for n, s in SUITES.items() if s.distilled]
    parser.add_argument("--distilled", help=f"suites {', '.join(with_distilled)}: a distilled draft (out/draft)")
    parser.add_argument(
        "--rounds", type=int, help="suite gamma: rounds per setting (default 3 on the garden, 2 on a pretrained pair)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", help="suite gamma: concurrencies (default 1 4 8 16)")
    parser.add_argument("--distilling", action="store_true", help="suite gamma: while a distill job trains the draft")
    parser.add_argument("--clients", type=int, help="suite online: clients sending requests (default 4)")
    parser.add_argument("--distinct", type=int, help="suite online: serve the first N test prompts in turn")
    args, extra = parser.parse_known_args()
    args.overrides = [x for x in args.suites if "=" in x]  # suites and overrides in any order: one has a "="
    args.suites = [x for x in args.suites if "=" not in x]
    if unknown := [x for x in args.suites if x not in NAMES]:
        parser.error(f"unknown suite(s) {unknown}: choose from {NAMES}")
    if commands := [x for x in args.suites if x in SUITES and SUITES[x].kind == "command"]:
        parser.error(f"suite {commands[0]} takes options of its own: give it alone first (its --help lists them)")
    return args, extra


def explain(argv: list[str]) -> bool:
    """``--list``, and ``SUITE --help``: the suites a line each, or what the named suites measure (their files'
    docstrings). False when the command line asks for neither."""
    if "--list" in argv:
        for name, suite in SUITES.items():
            print(f"{name:>16}  {suite.module + '.py':<16} {suite.summary()}")
        print(f"{'groups':>16}  " + "; ".join(f"{g}: {' '.join(s)}" for g, s in GROUPS.items()))
        return True
    named = [a for a in argv if a in SUITES]
    if not named or not {"-h", "--help"} & set(argv):
        return False
    for module in dict.fromkeys(SUITES[n].module for n in named):  # a file's docstring once
        print(f"benchmarks/suites/{module}.py\n\n{SUITES[next(n for n in named if SUITES[n].module == module)].doc()}")
    return True


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] in SUITES and SUITES[argv[0]].kind == "command":  # its own command line
        sys.argv = [f"benchmarks/suites/{SUITES[argv[0]].module}.py", *argv[1:]]
        return SUITES[argv[0]].load()()
    if explain(argv):
        return None
    args, extra = parse_args()
    out = Path(args.output_dir).resolve()
    suites = [s for name in args.suites for s in GROUPS.get(name, [name])]
    scale = args.scale or next((g for g in ("full", "real") if g in args.suites), "quick")
    # Runner suites train the benchmark garden, or with --scale real the real pair on on-policy data with FKL (100
    # steps of the default TVD lowered the real draft's alpha, 0.088 -> 0.054)
    real = scale == "real"
    base = [*TASKS["gsm8k-smollm2"], "eval.num_prompts=32", "distill.divergence=fkl"] if real else BENCHMARK_GARDEN
    budget = args.budget or (480.0 if real else 240.0)
    start = time.perf_counter()
    for name in suites:
        if name == "report":
            runs = [Path(r).resolve() for r in args.runs] if args.runs else [out]
            print(f"wrote {write_page(runs, Path(args.docs), real=real)}")
            continue
        suite = SUITES[name]
        if suite.kind == "page":
            run = page_suite(name, scale, args.overrides + extra, out, args.tasks)
        else:
            options = {"distilled": args.distilled} if suite.distilled else {}
            if name == "gamma":
                options = {"rounds": args.rounds, "concurrency": args.concurrency, "distilling": args.distilling}
            if name == "online":
                options |= {"clients": args.clients, "distinct": args.distinct}
            run = functools.partial(suite.load(), [*base, *args.overrides, *extra], budget, out / name, **options)
        result = timed(name, scale, run)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {out / f'{name}.json'} ({time.perf_counter() - start:.0f}s since the start)")
    if len(suites) > 1:
        print(f"{len(suites)} suites in {time.perf_counter() - start:.0f}s")
    return None


if __name__ == "__main__":
    run_main(main)
