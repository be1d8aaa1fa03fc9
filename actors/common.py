"""The names actors find each other by, and their logger."""

from __future__ import annotations

import logging

NAMESPACE = "distillspec"  #: Ray namespace of the pipeline's named actors (the Serve endpoint joins it too)

log = logging.getLogger("distillspec")


class Stopped(Exception):
    """A rollout actor was told the pipeline is done while it waited for served prompts or samples: it has no batch
    to make, and the buffer, closed by then, ends its feed."""


def stopped(exc: BaseException | None) -> bool:
    """Whether ``exc`` is :class:`Stopped` or a Ray task error that carries it (through the tasks that took its
    result as an argument: a scorer's ``score(sample())``)."""
    while exc is not None and not isinstance(exc, Stopped):
        exc = getattr(exc, "cause", None)
    return exc is not None


def buffer_name(run: str) -> str:
    return f"{run}-buffer"


def weights_name(run: str) -> str:
    return f"{run}-weights"


def scorer_name(run: str, index: int) -> str:
    return f"{run}-scorer-{index}"


def prompts_name(run: str) -> str:
    return f"{run}-prompts"
