"""Entry-point helper: ``--config``, flags and ``section.key=value`` overrides -> one validated config; ``--help``
lists every key the job reads (default and help text); a user's mistake is one line on stderr and exit status 2,
never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from distillspec.config import JobConfig, describe, load_config
from distillspec.errors import DistillSpecError

FLAGS = {
    "target": "target model: hub id, local folder, .gguf file or smollm2-135m-instruct (default: the garden's)",
    "draft": "draft model: as --target, or the target's layers: first:K, spread:K, layers:i,j (default: the garden's)",
    "dataset": "arith (default), gsm8k, xsum, cnn_dailymail, wmt14, lm1b, or a local path",
    "output_dir": "where results, plots and the distilled draft go",
    "run": "an output folder of jobs/distill.py: serve its distilled draft with its target (serve.run)",
}
#: Flags that set a key inside a section.
FLAG_KEYS = {"run": "serve.run"}
#: The config sections each job reads (its --help lists their keys).
SECTIONS = {
    "distill": ("garden", "distill", "eval", "ray", "rollout", "scorer", "buffer", "learner", "evaluator", "vllm"),
    "serve": ("garden", "serve", "ray", "vllm"),
    "sweep": ("garden", "distill", "eval", "ray", "sweep"),
    "garden": ("garden", "eval"),
}


def keys_help(sections: tuple[str, ...]) -> str:
    """The ``--help`` epilog: every key of ``sections`` (and the top-level ones) with its default and help."""
    rows = describe(JobConfig, sections)
    width = max(len(key) for key, _, _ in rows) + 2
    lines = ["config keys (section.key=value on the command line, or in a --config YAML file):"]
    section = None
    for key, default, text in rows:
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            lines.append(f"\n  [{head}]" if head else "")
        body = textwrap.wrap(f"{text} (default: {default})", 118 - width - 4) or [""]
        lines.append(f"    {key:<{width}}{body[0]}")
        lines += [" " * (4 + width) + more for more in body[1:]]
    return "\n".join(lines)


def parse_job_args(
    doc: str | None,
    argv: list[str] | None = None,
    flags: tuple[str, ...] = ("target", "draft", "dataset", "output_dir"),
    defaults: tuple[str, ...] = (),
    job: str = "distill",
) -> JobConfig:
    """``--config FILE``, the named ``flags`` and ``section.key=value`` overrides -> a validated JobConfig.

    ``defaults`` are overrides the job applies first (e.g. its own output folder); the user's win over them.
    """
    parser = argparse.ArgumentParser(
        description=doc, epilog=keys_help(SECTIONS[job]), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="YAML file with any of the config's keys")
    for flag in flags:
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, help=FLAGS[flag])
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. distill.steps=100 eval.gammas=[3,5]")
    args = parser.parse_args(argv)
    overrides = [*defaults, *args.overrides]
    overrides += [
        f"{FLAG_KEYS.get(flag, flag)}={json.dumps(getattr(args, flag))}"
        for flag in flags
        if getattr(args, flag) is not None
    ]
    return load_config(args.config, overrides)


#: Set (unless the user set them) before a job starts: third-party progress bars and notices that a user cannot act
#: on stay out of the job's console; the processes a job starts (Ray's workers) inherit them.
QUIET = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" and hub bars
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",  # the fork warning of tokenizers in Ray workers
}


def stop_on_sigterm() -> None:
    """A service manager's stop (SIGTERM) interrupts the job as Ctrl-C does (set it after ``ray.init``, which installs
    a handler of its own that aborts the process)."""

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """Hold a SIGTERM back while Ray starts, then stop the job as Ctrl-C does. One that comes before ``ray.init``
    installs a handler of its own (which aborts the process with a stack dump) waits here; one that comes after it
    meets Ray's. (Blocking the signal instead would close that window, but the processes Ray starts meanwhile would
    inherit the block, and a local cluster's shutdown then waits seconds for each of them.)"""
    held: list[int] = []
    signal.signal(signal.SIGTERM, lambda number, _frame: held.append(number))
    try:
        yield
    finally:
        stop_on_sigterm()
    if held:
        raise KeyboardInterrupt


def run_main(main: Callable[[], Any]) -> None:
    """Run a job's ``main``: a user's mistake is one line and exit status 2, Ctrl-C or SIGTERM "interrupted" and 130."""
    for key, value in QUIET.items():
        os.environ.setdefault(key, value)
    stop_on_sigterm()
    try:
        main()
    except DistillSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
