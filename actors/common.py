"""What every actor does on start, and the names actors find each other by."""

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


def setup_worker(threads: int = 1) -> None:
    """One torch thread per actor (fractional CPUs on small machines), and INFO logs into the actor's log."""
    import torch  # here, not at the top: the weight store and the prompt log never need it

    torch.set_num_threads(max(1, threads))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def prompts_name(run: str) -> str:
    return f"{run}-prompts"
