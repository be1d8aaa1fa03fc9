"""The bookkeeping of a bounded sample buffer with a staleness bound and a ledger, free of Ray.

Rollout workers offer items (in the Ray pipeline: object references to batches) tagged with the draft
weight version that produced them; the learner takes them. Every item offered ends in exactly one of
the ledger's columns, so ``produced == refused + dropped + consumed + held`` always holds:

- *refused* at the door: malformed, oversized, or already older than ``max_policy_lag`` versions;
- *dropped* later: it aged past ``max_policy_lag`` while waiting;
- *consumed*: handed to the learner, once.

A full buffer answers ``put`` with ``"full"`` and counts nothing: the producer keeps the item and
tries again (back-pressure).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from distillspec.errors import DistillSpecError


@dataclass
class Ledger:
    produced: int = 0
    refused: int = 0
    dropped: int = 0
    consumed: int = 0

    def balanced(self, held: int) -> bool:
        return self.produced == self.refused + self.dropped + self.consumed + held

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def check_batch(batch: Any, *, max_tokens: int, vocab_size: int | None = None) -> str | None:
    """Why a rollout batch is unfit for training, or None when it is fit.

    A batch is a mapping with ``input_ids``, ``attention_mask`` and ``loss_mask``: integer arrays (numpy or
    torch) of one shape ``[rows, length]``, at most ``max_tokens`` tokens in all, and at least one position
    to learn from.
    """
    if not isinstance(batch, dict):
        return f"a batch must be a mapping, got {type(batch).__name__}"
    missing = [k for k in ("input_ids", "attention_mask", "loss_mask") if k not in batch]
    if missing:
        return f"missing {missing}"
    if not all(isinstance(batch[k], torch.Tensor | np.ndarray) for k in ("input_ids", "attention_mask", "loss_mask")):
        return "input_ids, attention_mask and loss_mask must be arrays"
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        return "input_ids must be an integer array [rows, length]"
    for key in ("attention_mask", "loss_mask"):
        if tuple(batch[key].shape) != ids.shape:
            return f"{key} must have the shape of input_ids {tuple(ids.shape)}"
    if ids.size > max_tokens:
        return f"{ids.size} tokens > max_tokens {max_tokens}"
    if int(np.asarray(batch["loss_mask"]).sum()) == 0:
        return "no position to learn from (loss_mask is all 0)"
    if ids.size and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        return f"token ids outside [0, {vocab_size})"
    return None


class SampleBuffer:
    """A bounded FIFO of ``(version, item)`` with a staleness bound; see the module docstring."""

    def __init__(self, capacity: int, max_policy_lag: int) -> None:
        if capacity < 1 or max_policy_lag < 0:
            raise DistillSpecError(
                f"buffer capacity={capacity}, max_policy_lag={max_policy_lag}: need capacity >= 1 and lag >= 0"
            )
        self.capacity, self.max_policy_lag = capacity, max_policy_lag
        self.items: deque[tuple[int, Any]] = deque()
        self.ledger = Ledger()
        self.refusals: list[str] = []  #: the reason of each refusal, in order

    def __len__(self) -> int:
        return len(self.items)

    def stale(self, version: int, current_version: int) -> bool:
        return current_version - version > self.max_policy_lag

    def put(self, item: Any, *, version: int, current_version: int, problem: str | None = None) -> str:
        """Offer ``item``; returns ``"ok"``, ``"full"`` (not counted: retry later) or ``"refused: <why>"``.

        ``problem`` is the caller's verdict on the item's content (e.g. from :func:`check_batch`).
        """
        if len(self.items) >= self.capacity:
            return "full"
        self.ledger.produced += 1
        if problem is None and self.stale(version, current_version):
            problem = f"version {version} is more than {self.max_policy_lag} behind {current_version}"
        if problem is not None:
            self.ledger.refused += 1
            self.refusals.append(problem)
            return f"refused: {problem}"
        self.items.append((version, item))
        return "ok"

    def take(self, n: int, *, current_version: int) -> list[tuple[int, Any]]:
        """Drop what has gone stale, then hand out up to ``n`` of the oldest items as ``(version, item)``."""
        self.evict(current_version)
        out = [self.items.popleft() for _ in range(min(n, len(self.items)))]
        self.ledger.consumed += len(out)
        return out

    def evict(self, current_version: int) -> int:
        kept = deque(x for x in self.items if not self.stale(x[0], current_version))
        dropped = len(self.items) - len(kept)
        self.items, self.ledger.dropped = kept, self.ledger.dropped + dropped
        return dropped
