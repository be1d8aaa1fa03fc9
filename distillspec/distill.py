"""Distillation of the draft toward the target (DistillSpec Algorithm A.2, Table 1 recipes): how a batch's
continuations are generated, and the loss.

The draft is moved toward the target by the sequence-level divergence of Eq. 2 over the continuation tokens
(:func:`kd_loss`); where each batch comes from is :mod:`distillspec.rollout`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.batches import Batch, make_batch
from distillspec.config import Recipe
from distillspec.data import Example
from distillspec.divergences import TopKLogprobs, divergence
from distillspec.models import encode_prompts
from distillspec.speculative import autoregressive_generate, speculative_generate


def encode_examples(tokenizer: PreTrainedTokenizerBase, examples: list[Example], max_len: int) -> Batch:
    """Fixed-data batch: prompt + reference + EOS, cut to ``max_len`` tokens (the prompt's start goes first)."""
    conts = [tokenizer(e.reference, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for e in examples]
    conts = [c[: max_len - 1] for c in conts]
    prompt_ids, prompt_mask = encode_prompts(
        tokenizer, [e.prompt for e in examples], max_len=max_len - max(len(c) for c in conts)
    )
    width = max(len(c) for c in conts)
    continuation = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in conts])
    return make_batch(prompt_ids, prompt_mask, continuation, torch.tensor([len(c) for c in conts]))


def generate_batch(
    source: str,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[Example],
    *,
    max_new_tokens: int,
    temperature: float,
    gamma: int = 5,
    generator: torch.Generator | None = None,
    max_prompt_tokens: int | None = None,
) -> Batch:
    """Continuations of the prompts (their last ``max_prompt_tokens`` tokens) sampled from the draft (on-policy) or
    the target (via SD)."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in examples], max_len=max_prompt_tokens)
    prompt_ids, prompt_mask = prompt_ids.to(draft.device), prompt_mask.to(draft.device)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_id=tokenizer.eos_token_id,
        attention_mask=prompt_mask,
        generator=generator,
        pad_token_id=tokenizer.pad_token_id,
    )
    if source == "draft":
        out = autoregressive_generate(draft, prompt_ids, **kwargs)
    else:
        out = speculative_generate(target, draft, prompt_ids, gamma=gamma, **kwargs)
    # Inference tensors cannot enter autograd: clone them out.
    continuation = out.sequences[:, prompt_ids.shape[1] :].clone()
    return make_batch(prompt_ids.clone(), prompt_mask.clone(), continuation, out.num_new_tokens.clone())


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
    otherwise the target model scores the batch here.
    """
    if target_logits is None:
        with torch.no_grad():
            target_logits = forward_logits(target, batch)
    draft_logits = forward_logits(draft, batch)
    return divergence(
        recipe.divergence,
        draft_logits,
        target_logits,
        batch.window_mask,
        temperature=train_temperature(temperature),
        beta=beta,
        reduction="seq",
    )


def train_temperature(temperature: float) -> float:
    """The divergence temperature: the sampling temperature, or 1 for greedy (T = 0) samples."""
    return temperature if temperature > 0 else 1.0
