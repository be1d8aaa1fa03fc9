"""The losses of distillation (DistillSpec Eq. 2, Table 1 recipes): the draft is moved toward the target by the
sequence-level divergence over a batch's continuation tokens (:func:`kd_loss`), or trained on the data alone
(:func:`lm_loss`); where each batch comes from is :mod:`distillspec.training.rollout`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from distillspec.config import Recipe
from distillspec.models.draft_vocab import d2t, restrict_target
from distillspec.training.batches import Batch
from distillspec.training.divergences import TopKLogprobs, divergence


def forward_logits(model: PreTrainedModel, batch: Batch, start: int | None = None) -> Tensor:
    """Logits [B, T - start, V] of columns ``start:`` (default :attr:`Batch.window`: the prompt's logits but its
    last are never used, so the LM head and the divergence skip them)."""
    start = batch.window if start is None else start
    return model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=batch.input_ids.shape[1] - start,
    ).logits


def lm_loss(model: PreTrainedModel, batch: Batch, mask: Tensor | None = None) -> Tensor:
    """Next-token cross-entropy at the positions of ``mask`` (default: the continuation)."""
    mask = batch.loss_mask if mask is None else mask
    logits = forward_logits(model, batch, start=0)[:, :-1]
    labels = batch.input_ids[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    m = mask[:, :-1].flatten().float()
    return (nll * m).sum() / m.sum().clamp(min=1)


def kd_loss(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    batch: Batch,
    recipe: Recipe,
    *,
    temperature: float = 1.0,
    beta: float = 0.5,
    target_logits: Tensor | TopKLogprobs | None = None,
) -> Tensor:
    """The sequence-level divergence D(p || q_theta) of Eq. 2 over the continuation.

    ``target_logits`` may come precomputed (full logits or top-k log-probs from a scoring actor);
    otherwise the target model scores the batch here. A draft with a draft vocabulary is moved toward the target's
    distribution conditioned on it (:func:`~distillspec.models.draft_vocab.restrict_target`).
    """
    if target_logits is None:
        with torch.no_grad():
            target_logits = forward_logits(target, batch)
    draft_logits = forward_logits(draft, batch)
    return divergence(
        recipe.divergence,
        draft_logits,
        restrict_target(target_logits, d2t(getattr(draft, "module", draft))),
        batch.window_mask,
        temperature=train_temperature(temperature),
        beta=beta,
        reduction="seq",
    )


def train_temperature(temperature: float) -> float:
    """The divergence temperature: the sampling temperature, or 1 for greedy (T = 0) samples."""
    return temperature if temperature > 0 else 1.0
