"""The names actors find each other by, and their logger."""

from __future__ import annotations

import logging

NAMESPACE = "distillspec"  #: Ray namespace of the pipeline's named actors (the Serve endpoint joins it too)

log = logging.getLogger("distillspec")


def buffer_name(run: str) -> str:
    return f"{run}-buffer"


def weights_name(run: str) -> str:
    return f"{run}-weights"


def scorer_name(run: str, index: int) -> str:
    return f"{run}-scorer-{index}"


def prompts_name(run: str) -> str:
    return f"{run}-prompts"
