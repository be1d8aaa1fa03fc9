"""Speculative-decoding metrics: alpha, tau, the cost ratio c, predicted and measured speedups."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from distillspec.config import Compile
from distillspec.decoding.kvcache import CachedLM, bucketed_capacity
from distillspec.training.divergences import reduce, tvd


def position_tvd(draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """TVD(p, q) at each position ``[B, T]``: the probability that a draft token proposed there is rejected.

    At ``temperature == 0`` both distributions are one-hot argmaxes, so it is 1 where the argmaxes differ, else 0;
    there the target may come as its argmax token ids alone (an integer tensor without the vocabulary axis).
    """
    if temperature == 0:
        target_ids = target_logits if not target_logits.is_floating_point() else target_logits.argmax(-1)
        return (draft_logits.argmax(-1) != target_ids).float()
    return tvd(draft_logits, target_logits, temperature=temperature, reduction="none")


def alpha_from_tvd(
    draft_logits: Tensor, target_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> float:
    """alpha = 1 - E[TVD(p, q)] over the positions of target samples (Eq. 3; :func:`position_tvd`); at
    ``temperature == 0`` the argmax agreement."""
    return 1.0 - float(reduce(position_tvd(draft_logits, target_logits, temperature), mask, "token"))


@dataclass(frozen=True)
class AcceptanceCounts:
    """The counts alpha and tau are computed from, whichever engine decoded (this project's or vLLM's).

    ``blocks``: draft-and-verify blocks (target calls); ``accepted``: draft tokens the target accepted;
    ``rejected``: blocks that ended in a rejection (each judges one token more than it accepts).
    """

    blocks: int
    accepted: int
    rejected: int

    @property
    def alpha(self) -> float:
        """Accepted / judged draft tokens: the estimate of alpha = 1 - E[TVD(p, q)]."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else float("nan")

    @property
    def tau(self) -> float:
        """Tokens per target call: accepted + 1 per block."""
        return (self.accepted + self.blocks) / self.blocks if self.blocks else float("nan")

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(
            self.blocks + other.blocks, self.accepted + other.accepted, self.rejected + other.rejected
        )

    def __sub__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(
            self.blocks - other.blocks, self.accepted - other.accepted, self.rejected - other.rejected
        )

    @classmethod
    def from_vllm(cls, num_drafts: int, num_accepted: int, accepted_per_pos: list[int]) -> AcceptanceCounts:
        """From vLLM's counters (``vllm:spec_decode_num_drafts``, ``..._num_accepted_tokens``,
        ``..._num_accepted_tokens_per_pos``): a block ends in a rejection unless its last draft token is accepted."""
        full = accepted_per_pos[-1] if accepted_per_pos else 0
        return cls(blocks=int(num_drafts), accepted=int(num_accepted), rejected=int(num_drafts - full))

    @classmethod
    def from_histogram(cls, histogram: list[int]) -> AcceptanceCounts:
        """From one request's histogram of accepted draft tokens per block (vLLM's per-request
        ``acceptance_histogram``: entry j counts the blocks that accepted j of the gamma draft tokens)."""
        blocks = sum(histogram)
        accepted = sum(j * n for j, n in enumerate(histogram))
        return cls(blocks=blocks, accepted=accepted, rejected=blocks - (histogram[-1] if histogram else 0))


def expected_tau(alpha: float, gamma: int) -> float:
    """Theoretical block efficiency (1 - alpha^(gamma+1)) / (1 - alpha), which is gamma + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(tau: float, c: float, gamma: int, v: float = 1.0) -> float:
    """Expected wall-clock speedup over target-only decoding: tau / (c * gamma + v).

    ``v = 1`` is the paper's formula (a gamma+1-token verify call costs one 1-token call); pass the
    measured verify ratio to account for hardware where it costs more (small models on a CPU).
    """
    return tau / (c * gamma + v)


@dataclass
class CostRatio:
    c: float  # draft call time / target call time
    target_ms: float
    draft_ms: float
    v: float = 1.0  # target time for gamma+1 tokens / target time for 1 token
    verify_ms: float = 0.0


@torch.inference_mode()
def step_times(
    models: Sequence[PreTrainedModel],
    widths: Sequence[Sequence[int]],
    input_ids: Tensor,
    *,
    steps: int = 64,
    warmup: int = 8,
    compile: bool | Sequence[bool] = False,
) -> list[dict[int, float]]:
    """Median milliseconds of one cached decoding call of ``k`` new tokens, for each model ``models[i]`` and each
    ``k`` in ``widths[i]``, after a prefill of ``input_ids`` [1, L]: the calls run in turn, a round of every (model,
    k) per step, so that a drift in the machine's speed hits them all alike; each call's tokens are then rolled back,
    so every call sees the same cache length. ``compile``: the calls run compiled (see :class:`CachedLM`; one flag
    for every model, or one per model); the warm-up rounds compile them. Returns ``[{k: ms}]``, one dict per model."""
    capacity = bucketed_capacity(input_ids.shape[1] + max(max(ks) for ks in widths) + 1)
    compiled = [compile] * len(models) if isinstance(compile, bool) else list(compile)
    lms = [CachedLM(model, compile=c, capacity=capacity) for model, c in zip(models, compiled, strict=True)]
    for lm in lms:
        lm.prefill(input_ids, torch.ones_like(input_ids))
    times: dict[tuple[int, int], list[float]] = {(i, k): [] for i, ks in enumerate(widths) for k in ks}
    for step in range(warmup + steps):
        for (i, k), samples in times.items():
            start = time.perf_counter()
            lms[i].step(input_ids[:, -1:].expand(-1, k))
            if step >= warmup:
                samples.append(time.perf_counter() - start)
            lms[i].reject_tail(torch.full_like(lms[i].next_pos, k))
    return [{k: statistics.median(times[(i, k)]) * 1e3 for k in ks} for i, ks in enumerate(widths)]


def measure_cost_ratio(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: Tensor,
    *,
    gamma: int = 5,
    steps: int = 64,
    warmup: int = 8,
    compile: Compile = False,
) -> CostRatio:
    """The costs of a pair (:func:`step_times`, interleaved): a 1-token target call, a 1-token draft call and a
    (gamma+1)-token target (verify) call; ``compile``: both models' steps compiled, or the draft's alone."""
    compiled = [compile is True, bool(compile)]
    target_ms, draft_ms = step_times(
        [target, draft], [[1, gamma + 1], [1]], input_ids, steps=steps, warmup=warmup, compile=compiled
    )
    verify_ms = target_ms[gamma + 1]
    return CostRatio(
        c=draft_ms[1] / target_ms[1],
        target_ms=target_ms[1],
        draft_ms=draft_ms[1],
        v=verify_ms / target_ms[1],
        verify_ms=verify_ms,
    )
