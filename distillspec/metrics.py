"""Speculative-decoding metrics: alpha, tau, the cost ratio c, predicted and measured speedups."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from distillspec.divergences import tvd
from distillspec.speculative import CachedLM, probs_from_logits


def alpha_from_tvd(draft_logits: Tensor, target_logits: Tensor, mask: Tensor | None = None, temperature: float = 1.0) -> float:
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
    target: PreTrainedModel, draft: PreTrainedModel, input_ids: Tensor, *, steps: int = 32, warmup: int = 4
) -> CostRatio:
    """Time one-token decoding calls of each model (with a KV cache, after a prefill of ``input_ids``)."""
    ms = []
    for model in (target, draft):
        lm = CachedLM(model)
        lm.prefill(input_ids, torch.ones_like(input_ids))
        token = input_ids[:, -1:]
        for i in range(warmup + steps):
            if i == warmup:
                start = time.perf_counter()
            lm.step(token)
        ms.append((time.perf_counter() - start) / steps * 1e3)
    return CostRatio(c=ms[1] / ms[0], target_ms=ms[0], draft_ms=ms[1])
