"""Speculative-decoding metrics: alpha, tau, the cost ratio c, predicted and measured speedups."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from distillspec.divergences import tvd
from distillspec.speculative import CachedLM, probs_from_logits


def alpha_from_tvd(
    draft_logits: Tensor, target_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> float:
    """alpha = 1 - E[TVD(p, q)] over the positions of target samples (Eq. 3).

    At ``temperature == 0`` both distributions are one-hot argmaxes, so alpha is the argmax agreement.
    """
    if temperature == 0:
        p = probs_from_logits(target_logits.float(), 0)
        q = probs_from_logits(draft_logits.float(), 0)
        values = 0.5 * (p - q).abs().sum(-1)
        m = torch.ones_like(values) if mask is None else mask.to(values.dtype)
        return 1.0 - float((values * m).sum() / m.sum().clamp(min=1))
    return 1.0 - float(tvd(draft_logits, target_logits, mask, temperature=temperature, reduction="token"))


def expected_tau(alpha: float, gamma: int) -> float:
    """Theoretical block efficiency (1 - alpha^(gamma+1)) / (1 - alpha), which is gamma + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(tau: float, c: float, gamma: int) -> float:
    """Expected wall-clock speedup over target-only decoding: tau / (c * gamma + 1)."""
    return tau / (c * gamma + 1.0)


@dataclass
class CostRatio:
    c: float  # draft call time / target call time
    target_ms: float
    draft_ms: float


@torch.inference_mode()
def measure_cost_ratio(
    target: PreTrainedModel, draft: PreTrainedModel, input_ids: Tensor, *, steps: int = 64, warmup: int = 8
) -> CostRatio:
    """Median time of one-token decoding calls (KV cache, after a prefill), target and draft interleaved."""
    lms = [CachedLM(target), CachedLM(draft)]
    for lm in lms:
        lm.prefill(input_ids, torch.ones_like(input_ids))
    token = input_ids[:, -1:]
    times: list[list[float]] = [[], []]
    for i in range(warmup + steps):
        for lm, t in zip(lms, times):
            start = time.perf_counter()
            lm.step(token)
            if i >= warmup:
                t.append(time.perf_counter() - start)
    target_ms, draft_ms = (statistics.median(t) * 1e3 for t in times)
    return CostRatio(c=draft_ms / target_ms, target_ms=target_ms, draft_ms=draft_ms)
