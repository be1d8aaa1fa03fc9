"""A training batch and its way from a rollout worker to the learner.

- :class:`Batch`: prompts left-padded to one column, continuations after them (the tensors the loss reads);
- :class:`ServedSample`: a completion an endpoint served, kept as a sample of the target for online distillation;
- :class:`RolloutBatch`: what a rollout worker hands the learner: the batch's arrays, the draft version that sampled
  it, its source and, optionally, the target's distribution over it; with the checks a batch must pass;
- :class:`SampleBuffer`: the bookkeeping of the bounded buffer between them: a staleness bound and a ledger in which
  every batch offered ends in exactly one column, so ``produced == refused + dropped + consumed + held``:

  - *refused* at the door: malformed, oversized, or already older than ``max_policy_lag`` versions;
  - *dropped* later: it aged past ``max_policy_lag`` while waiting;
  - *consumed*: handed to the learner, once.

A draft's *version* is the number of optimizer steps that made it (-1 before the first publish). This module needs
torch and numpy alone: the buffer's process, which only reads batches, imports nothing heavier.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from distillspec.errors import DistillSpecError
from distillspec.training.divergences import TopKLogprobs, compress_topk


@dataclass
class Batch:
    """Prompts left-padded to one column, continuations after them, right-padded.

    ``loss_mask[b, t]`` is 1 where position t predicts a continuation token (the next token).
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    #: the target's top-k log-probs over :attr:`window`, where the sampler had them (target samples: speculative
    #: decoding scored each token it emitted); None: a scorer or the learner computes the target's distribution
    target: TopKLogprobs | None = None

    def to(self, device: str | torch.device) -> Batch:
        """The batch on ``device`` (itself where it is there already)."""
        tensors = (self.input_ids, self.attention_mask, self.loss_mask)
        return Batch(*(t.to(device) for t in tensors), None if self.target is None else self.target.to(device))

    @property
    def position_ids(self) -> Tensor:
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def window(self) -> int:
        """The first column where ``loss_mask`` can be 1 (the prompt's last): logits before it are never used."""
        return int(self.loss_mask.any(0).long().argmax())

    @property
    def window_mask(self) -> Tensor:
        """``loss_mask`` from :attr:`window` on, aligned with :func:`forward_logits`."""
        return self.loss_mask[:, self.window :]


def make_batch(prompt_ids: Tensor, prompt_mask: Tensor, continuation: Tensor, lengths: Tensor) -> Batch:
    cont_mask = (torch.arange(continuation.shape[1], device=lengths.device)[None, :] < lengths[:, None]).long()
    input_ids = torch.cat([prompt_ids, continuation], 1)
    attention_mask = torch.cat([prompt_mask, cont_mask], 1)
    loss_mask = torch.zeros_like(attention_mask)
    loss_mask[:, prompt_ids.shape[1] - 1 : -1] = cont_mask
    return Batch(input_ids, attention_mask, loss_mask)


class BatchHeader(NamedTuple):
    """What the buffer reads of a batch (:meth:`RolloutBatch.header`): made where the batch is made, beside it, so the
    arrays are checked there and the buffer holds only their reference."""

    version: int
    source: str | None
    problem: str | None  #: why the batch is unfit for training (:meth:`RolloutBatch.problem`), None when it is fit


@dataclass
class ServedSample:
    """A completion an endpoint served (``serve.record_samples``), kept as a sample of the target: its prompt's and its
    tokens (those its text keeps), the target's ``k`` likeliest tokens at each token's position with their
    log-probabilities (the raw distribution, at temperature 1, that speculative decoding verified the token with)
    and the temperature it was sampled at. Lists and arrays: it travels to the run's prompt log
    (:class:`actors.prompts.PromptLog`), and batches of them train the draft
    (:func:`distillspec.training.rollout.served_batch`)."""

    prompt: list[int]
    tokens: list[int]
    top_ids: np.ndarray  #: [len(tokens), k], int64
    top: np.ndarray  #: [len(tokens), k], float32
    temperature: float


@dataclass
class RolloutBatch:
    """One training batch on its way from a rollout worker to the learner, through Ray's object store (its numpy
    arrays are read zero-copy there).

    The target's distribution over the batch comes with it when a scorer computed it: full logits
    (``target_logits [rows, columns from Batch.window, vocab]``) or top-k log-probs (``target_topk_logprobs`` and
    ``target_topk_indices``, see :func:`~distillspec.training.divergences.compress_topk`); otherwise the learner
    computes it.
    """

    input_ids: np.ndarray  #: [rows, length] int
    attention_mask: np.ndarray  #: [rows, length]
    loss_mask: np.ndarray  #: [rows, length]: 1 where the position predicts a continuation token
    version: int  #: the draft version that sampled it
    source: str  #: "fixed", "draft" or "target"
    target_logits: np.ndarray | None = None
    target_topk_logprobs: np.ndarray | None = None
    target_topk_indices: np.ndarray | None = None

    @classmethod
    def from_batch(cls, batch: Batch, *, version: int, source: str) -> RolloutBatch:
        arrays = {k: getattr(batch, k).cpu().numpy() for k in ("input_ids", "attention_mask", "loss_mask")}
        made = cls(**arrays, version=version, source=source)
        if batch.target is not None:
            made.set_target_topk(batch.target)
        return made

    @property
    def scored(self) -> bool:
        """Whether the target's distribution comes with the batch already."""
        return self.target_logits is not None or self.target_topk_logprobs is not None

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        """Positions to learn from."""
        return int(np.asarray(self.loss_mask).sum())

    def batch(self, device: str | torch.device = "cpu") -> Batch:
        """The tokens as a :class:`Batch` on ``device``."""
        keys = ("input_ids", "attention_mask", "loss_mask")
        return Batch(*(torch.as_tensor(np.array(getattr(self, k)), device=device) for k in keys))

    def set_target(self, target_logits: Tensor, topk: int, temperature: float) -> None:
        """Attach the target's distribution: full logits (``topk=0``) or its top-k log-probs at ``temperature``."""
        if topk == 0:
            self.target_logits = target_logits.float().cpu().numpy()
            return
        self.set_target_topk(compress_topk(target_logits, min(topk, target_logits.shape[-1]), temperature))

    def set_target_topk(self, top: TopKLogprobs) -> None:
        self.target_topk_logprobs, self.target_topk_indices = top.logprobs.cpu().numpy(), top.indices.cpu().numpy()

    def target(self, temperature: float, device: str | torch.device = "cpu") -> Tensor | TopKLogprobs | None:
        """The attached target distribution, or None when the learner is to compute it."""
        if self.target_logits is not None:
            return torch.as_tensor(np.array(self.target_logits), device=device)
        if self.target_topk_logprobs is not None:
            return TopKLogprobs(
                torch.as_tensor(np.array(self.target_topk_logprobs), device=device),
                torch.as_tensor(np.array(self.target_topk_indices), device=device),
                temperature,
            )
        return None

    def header(self, *, max_tokens: int, vocab_size: int | None = None) -> BatchHeader:
        """The batch's :class:`BatchHeader`, checked against the buffer's limits (:meth:`problem`)."""
        return BatchHeader(self.version, self.source, self.problem(max_tokens=max_tokens, vocab_size=vocab_size))

    def problem(self, *, max_tokens: int, vocab_size: int | None = None) -> str | None:
        """Why the batch is unfit for training, or None when it is fit: integer token arrays of one shape
        ``[rows, length]``, at most ``max_tokens`` tokens in all, ids inside the vocabulary, and at least one
        position to learn from."""
        arrays = {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith(("_ids", "_mask"))}
        if not all(isinstance(a, np.ndarray | torch.Tensor) for a in arrays.values()):
            return "input_ids, attention_mask and loss_mask must be arrays"
        ids = np.asarray(self.input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            return "input_ids must be an integer array [rows, length]"
        for key in ("attention_mask", "loss_mask"):
            if tuple(arrays[key].shape) != ids.shape:
                return f"{key} must have the shape of input_ids {tuple(ids.shape)}"
        if ids.size > max_tokens:
            return f"{ids.size} tokens > max_tokens {max_tokens}"
        if self.tokens == 0:
            return "no position to learn from (loss_mask is all 0)"
        if ids.size and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
            return f"token ids outside [0, {vocab_size})"
        if self.source not in ("fixed", "draft", "target"):
            return f"unknown source {self.source!r}"
        return None


MAX_REFUSALS = 32  #: refusal reasons a buffer keeps: the ledger is read on every take, so it stays small


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
        #: the reasons of the latest refusals, oldest first (``ledger.refused`` counts them all)
        self.refusals: deque[str] = deque(maxlen=MAX_REFUSALS)

    def __len__(self) -> int:
        return len(self.items)

    def stale(self, version: int, current_version: int) -> bool:
        return current_version - version > self.max_policy_lag

    def put(self, item: Any, *, version: int, current_version: int, problem: str | None = None) -> str:
        """Offer ``item``; returns ``"ok"``, ``"full"`` (not counted: retry later) or ``"refused: <why>"``.

        ``problem`` is the caller's verdict on the item's content (e.g. :meth:`RolloutBatch.problem`).
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
