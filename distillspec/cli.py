"""Entry-point helper: a user's mistake is one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from distillspec.config import JobConfig, load_config
from distillspec.errors import DistillSpecError

FLAGS = {
    "target": "target model: hub id or local directory (default: the garden's)",
    "draft": "draft model: hub id or local directory (default: the garden's)",
    "dataset": "arith (default), gsm8k, xsum, cnn_dailymail, wmt14, lm1b, or a local path",
    "output_dir": "where results, plots and the distilled draft go",
}


def parse_job_args(
    doc: str | None,
    argv: list[str] | None = None,
    flags: tuple[str, ...] = tuple(FLAGS),
    defaults: tuple[str, ...] = (),
) -> JobConfig:
    """``--config FILE``, the named ``flags`` and ``section.key=value`` overrides -> a validated JobConfig.

    ``defaults`` are overrides the job applies first (e.g. its own output folder); the user's win over them.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with any of the config's keys")
    for flag in flags:
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, help=FLAGS[flag])
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. distill.steps=100 eval.gammas=[3,5]")
    args = parser.parse_args(argv)
    overrides = [*defaults, *args.overrides]
    overrides += [f"{flag}={json.dumps(getattr(args, flag))}" for flag in flags if getattr(args, flag) is not None]
    return load_config(args.config, overrides)


def run_main(main: Callable[[], Any]) -> None:
    try:
        main()
    except DistillSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
