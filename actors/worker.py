"""What an actor that runs torch does on start (the weight store and the prompt log import neither this nor torch)."""

from __future__ import annotations

import logging

import torch


def setup_worker(threads: int = 1) -> None:
    """One torch thread per actor (fractional CPUs on small machines), and INFO logs into the actor's log."""
    torch.set_num_threads(max(1, threads))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
