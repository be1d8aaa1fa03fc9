"""Token-level divergences D(p || q_theta) between the target p and the draft q (paper Sec. 4.1, A.3).

Every function takes logits ``[B, T, V]`` of the draft (q, differentiable) and the target (p), an
optional ``mask`` ``[B, T]`` of positions to count, a ``temperature`` applied to both, and returns the
loss reduced as asked: ``"seq"`` is the sequence-level loss of Eq. 2 (mean over each sequence's tokens,
then over sequences), ``"token"`` the mean over all counted tokens, ``"none"`` the ``[B, T]`` values.
All but TVD are computed from log-probabilities.

For large vocabularies the target may instead be given as :class:`TopKLogprobs` (its top-k
log-probabilities and their ids; see :func:`compress_topk`). The divergence is then taken between the
two distributions lumped into k + 1 outcomes: the target's top-k tokens and "any other token" (the
leftover mass). By the data-processing inequality this is a lower bound on the full divergence,
equal to it when k = V.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from distillspec.config import DIVERGENCE_NAMES, Divergence, check_choice
from distillspec.errors import DistillSpecError

REDUCTIONS = ("seq", "token", "none")


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    return F.log_softmax(logits.float() / temperature, dim=-1)


@dataclass
class TopKLogprobs:
    """A target distribution compressed for shipping: top-k log-probabilities and their token ids.

    ``logprobs`` ``[B, T, k]`` were taken at ``temperature``; 1 - sum(exp(logprobs)) is the mass of all
    other tokens.
    """

    logprobs: Tensor
    indices: Tensor
    temperature: float = 1.0

    def to(self, device: str | torch.device) -> TopKLogprobs:
        return TopKLogprobs(self.logprobs.to(device), self.indices.to(device), self.temperature)


def compress_topk(target_logits: Tensor, k: int, temperature: float = 1.0) -> TopKLogprobs:
    """Keep the ``k`` most likely tokens of each position (at ``temperature``) of ``target_logits``."""
    if not 1 <= k <= target_logits.shape[-1]:
        raise DistillSpecError(f"top-k k={k}: must be in [1, vocab size {target_logits.shape[-1]}]")
    logprobs, indices = _log_probs(target_logits, temperature).topk(k, dim=-1)
    return TopKLogprobs(logprobs, indices, temperature)


LOG_REST_FLOOR = math.log(1e-8)  #: leftover mass floor: keeps KL finite when the top-k hold (nearly) all mass


def _log_probs_pair(draft_logits: Tensor, target: Tensor | TopKLogprobs, temperature: float) -> tuple[Tensor, Tensor]:
    """(log q, log p) over the vocabulary, or over the k + 1 lumped outcomes of a top-k target."""
    log_q = _log_probs(draft_logits, temperature)
    if not isinstance(target, TopKLogprobs):
        return log_q, _log_probs(target, temperature)
    if target.temperature != temperature:
        raise DistillSpecError(
            f"top-k target was compressed at temperature {target.temperature}, the loss asks for {temperature}: "
            "compress at the training temperature"
        )
    log_p = target.logprobs.float()
    scored = log_p > -math.inf  # entries of -inf are no outcome (a draft vocabulary dropped them)
    log_q_top = log_q.gather(-1, target.indices).masked_fill(~scored, -math.inf)
    # The draft's leftover mass summed exactly over the other tokens; the target's is 1 - sum(top-k).
    other = torch.ones_like(log_q).scatter_reduce(-1, target.indices, (~scored).to(log_q.dtype), "amin")
    log_q_rest = torch.logsumexp(log_q.masked_fill(other == 0, -math.inf), dim=-1, keepdim=True)
    log_p_rest = torch.log((-torch.expm1(torch.logsumexp(log_p, dim=-1, keepdim=True))).clamp(min=0.0))
    return (
        torch.cat([log_q_top, log_q_rest.clamp(min=LOG_REST_FLOOR)], -1),
        torch.cat([log_p, log_p_rest.clamp(min=LOG_REST_FLOOR)], -1),
    )


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) over the last axis, from log-probabilities (0 log 0 = 0)."""
    return torch.where(log_a > -math.inf, log_a.exp() * (log_a - log_b), 0.0).sum(-1)


def reduce(values: Tensor, mask: Tensor | None, reduction: str = "seq") -> Tensor:
    """Reduce token-level values ``[B, T]`` over the positions ``mask`` marks."""
    if reduction not in REDUCTIONS:
        raise DistillSpecError(f"reduction={reduction!r}: choose one of {REDUCTIONS}")
    mask = torch.ones_like(values) if mask is None else mask.to(values.dtype)
    values = values * mask
    if reduction == "none":
        return values
    if reduction == "token":
        return values.sum() / mask.sum().clamp(min=1)
    per_seq = values.sum(-1) / mask.sum(-1).clamp(min=1)
    has_tokens = (mask.sum(-1) > 0).to(values.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def forward_kl(
    draft_logits: Tensor,
    target_logits: Tensor | TopKLogprobs,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: str = "seq",
) -> Tensor:
    """FKL = KL(p || q): mode-covering; the divergence of SupKD, SeqKD and ImitKD."""
    log_q, log_p = _log_probs_pair(draft_logits, target_logits, temperature)
    return reduce(_kl(log_p, log_q), mask, reduction)


def reverse_kl(
    draft_logits: Tensor,
    target_logits: Tensor | TopKLogprobs,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: str = "seq",
) -> Tensor:
    """RKL = KL(q || p): mode-seeking."""
    log_q, log_p = _log_probs_pair(draft_logits, target_logits, temperature)
    return reduce(_kl(log_q, log_p), mask, reduction)


def jsd(
    draft_logits: Tensor,
    target_logits: Tensor | TopKLogprobs,
    mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "seq",
) -> Tensor:
    """Generalised JSD[beta] (Eq. A.3): beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q.

    JSD[beta] / beta tends to FKL as beta -> 0 (and to RKL up to scale as beta -> 1).
    """
    if not 0.0 < beta < 1.0:
        raise DistillSpecError(f"beta={beta!r}: the generalised JSD needs beta in (0, 1)")
    log_q, log_p = _log_probs_pair(draft_logits, target_logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]), dim=0)
    values = beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    return reduce(values, mask, reduction)


def tvd(
    draft_logits: Tensor,
    target_logits: Tensor | TopKLogprobs,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    reduction: str = "seq",
) -> Tensor:
    """Total variation distance 0.5 * sum |p - q|, in [0, 1]; 1 - E[TVD] is the acceptance rate alpha."""
    log_q, log_p = _log_probs_pair(draft_logits, target_logits, temperature)
    q, p = log_q.exp(), log_p.exp()
    return reduce(0.5 * (p - q).abs().sum(-1), mask, reduction)


DIVERGENCES: dict[Divergence, Callable[..., Tensor]] = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": tvd}
assert tuple(DIVERGENCES) == DIVERGENCE_NAMES


def check_divergence(name: str) -> None:
    check_choice("divergence", name, DIVERGENCE_NAMES)


def divergence(
    name: str,
    draft_logits: Tensor,
    target_logits: Tensor | TopKLogprobs,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    reduction: str = "seq",
) -> Tensor:
    """Dispatch by name: ``"fkl"``, ``"rkl"``, ``"jsd"`` (uses ``beta``) or ``"tvd"``."""
    check_divergence(name)
    kwargs = {"temperature": temperature, "reduction": reduction}
    if name == "jsd":
        kwargs["beta"] = beta
    return DIVERGENCES[name](draft_logits, target_logits, mask, **kwargs)
