"""The data half of DistillSpec's Algorithm A.2: :class:`Sampler` draws each batch's source and prompts and makes
the batch: the fixed data set, or continuations sampled from the draft (on-policy) or from the target (made with
speculative decoding, which samples the target's distribution exactly). How a batch travels to the learner is
:mod:`distillspec.training.batches`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.config import Models, Recipe, resolve_recipe
from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
from distillspec.errors import DistillSpecError
from distillspec.models.loading import encode_prompts, load_decoding_draft, load_model, pad_prompts, resolve_dtype
from distillspec.tasks.data import Example
from distillspec.training.batches import Batch, ServedSample, make_batch
from distillspec.training.divergences import TopKLogprobs


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
    topk: int = 0,
    eos_token_id: int | list[int] | None = None,
) -> Batch:
    """Continuations of the prompts (their last ``max_prompt_tokens`` tokens) sampled from the draft (on-policy) or
    the target (via SD), each ending at ``eos_token_id`` (default: the tokenizer's; ``[]``: none). ``topk``: target
    samples at temperature 1 come with the target's top-k log-probs of each position (:attr:`Batch.target`), which
    speculative decoding computed to verify them: a scorer then has nothing left to do."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in examples], max_len=max_prompt_tokens)
    prompt_ids, prompt_mask = prompt_ids.to(draft.device), prompt_mask.to(draft.device)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_id=tokenizer.eos_token_id if eos_token_id is None else eos_token_id,
        attention_mask=prompt_mask,
        generator=generator,
        pad_token_id=tokenizer.pad_token_id,
    )
    if source == "draft":
        out = autoregressive_generate(draft, prompt_ids, **kwargs)
    else:  # the emitted tokens' scores are the target's raw distribution: the divergence's at temperature 1
        scored = topk if topk and temperature == 1.0 else None
        out = speculative_generate(target, draft, prompt_ids, gamma=gamma, logprobs=scored, **kwargs)
    # Inference tensors cannot enter autograd: clone them out.
    continuation = out.sequences[:, prompt_ids.shape[1] :].clone()
    batch = make_batch(prompt_ids.clone(), prompt_mask.clone(), continuation, out.num_new_tokens.clone())
    if out.logprobs is not None:
        batch.target = window_topk(out.logprobs.top_ids, out.logprobs.top, out.num_new_tokens)
    return batch


def window_topk(top_ids: Tensor, top: Tensor, lengths: Tensor) -> TopKLogprobs:
    """The top-k of the target's distribution that sampled each continuation token (``top_ids`` and their log-probs
    ``top``, [B, C, k]), laid out as a scorer lays out its top-k over :attr:`Batch.window` ([B, C + 1, k]: column j
    predicts continuation token j). Past a row's end, and in the last column (which predicts nothing), a uniform
    stand-in that the loss masks out."""
    rows, width, k = top.shape
    valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    logprobs = torch.full((rows, width + 1, k), -math.log(k), device=lengths.device)
    indices = torch.arange(k, device=lengths.device).expand(rows, width + 1, k).clone()
    logprobs[:, :width][valid] = top[valid].float()
    indices[:, :width][valid] = top_ids[valid]
    return TopKLogprobs(logprobs, indices, 1.0)


def served_batch(
    samples: list[ServedSample], pad_token_id: int, max_prompt_tokens: int | None, max_new_tokens: int
) -> Batch:
    """A batch of the target's samples from completions an endpoint served (online distillation,
    ``rollout.online_samples``): each prompt's last ``max_prompt_tokens`` tokens, its first ``max_new_tokens``
    tokens, and the target's top-k that speculative decoding verified each with (:attr:`Batch.target`, as
    :func:`generate_batch` attaches them: k the fewest any sample kept). Nothing is sampled or scored again."""
    if not samples:
        raise DistillSpecError("a batch of served samples needs at least one")
    prompts = [s.prompt[-max_prompt_tokens:] if max_prompt_tokens else s.prompt for s in samples]
    prompt_ids, prompt_mask = pad_prompts(prompts, pad_token_id)
    tokens = [s.tokens[:max_new_tokens] for s in samples]
    lengths = torch.tensor([len(t) for t in tokens])
    width, k = int(lengths.max()), min(s.top.shape[1] for s in samples)
    continuation = torch.full((len(samples), width), pad_token_id)
    top_ids = torch.zeros(len(samples), width, k, dtype=torch.long)
    top = torch.zeros(len(samples), width, k)
    for row, (s, t) in enumerate(zip(samples, tokens, strict=True)):
        continuation[row, : len(t)] = torch.tensor(t)
        top_ids[row, : len(t)] = torch.from_numpy(s.top_ids[: len(t), :k])
        top[row, : len(t)] = torch.from_numpy(s.top[: len(t), :k])
    batch = make_batch(prompt_ids, prompt_mask, continuation, lengths)
    batch.target = window_topk(top_ids, top, lengths)
    return batch


def draw_source(rng: random.Random, recipe: Recipe) -> str:
    """``"fixed"``, ``"draft"`` or ``"target"``, as in Algorithm A.2."""
    if rng.random() < recipe.lambda1:
        return "fixed"
    return "draft" if rng.random() < recipe.lambda2 else "target"


def online_rows(batch_size: int, mix: float) -> tuple[int, int]:
    """Online distillation: how many of a batch's prompts are served ones and how many the data set's, ``mix`` of
    them (``rollout.online_mix``) but at least one served."""
    data = min(round(mix * batch_size), batch_size - 1)
    return batch_size - data, data


def load_rollout_draft(
    models: Models, bf16: bool | None, decoding_copy: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The draft a rollout samples with (new versions load into it: :func:`~distillspec.models.loading.load_arrays`).
    With ``decoding_copy`` (``rollout.decoding_copy``), its decoding copy: the pair's dtype, int8 as
    ``models.draft_int8`` says (:func:`~distillspec.models.loading.load_decoding_draft`). Else the weights it trains,
    in bfloat16 where the learner trains under bfloat16 autocast (``bf16``, ``distill.bf16``; None: where the pair
    runs in bfloat16), which casts each weight as it is used: the learner's draft's samples, for half the memory of
    float32 weights."""
    m = models
    if decoding_copy:
        dtype = getattr(torch, resolve_dtype(m.dtype, m.target, m.device)[0])
        return load_decoding_draft(m.draft, device=m.device, dtype=dtype, int8=m.draft_int8)
    autocast = bf16 if bf16 is not None else m.dtype == "bfloat16"
    return load_model(m.draft, device=m.device, dtype=torch.bfloat16 if autocast else torch.float32)


#: A sampler backend: the continuations of a batch of ``examples`` from ``source`` ("draft" or "target").
Generate = Callable[[str, list[Example]], Batch]


class HFGenerator:
    """The transformers/torch backend of :class:`Sampler`: the draft samples on-policy continuations, and
    speculative decoding with the draft samples the target's (``distillspec.serving.vllm_backend.VLLMGenerator`` is the
    vLLM one)."""

    def __init__(
        self,
        target: PreTrainedModel | None,
        draft: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_new_tokens: int,
        temperature: float,
        gamma: int = 5,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
        topk: int = 0,
    ) -> None:
        self.target, self.draft, self.tokenizer, self.gamma = target, draft, tokenizer, gamma
        self.max_new_tokens, self.temperature, self.max_prompt_tokens = max_new_tokens, temperature, max_prompt_tokens
        self.topk = topk
        self.generator = torch.Generator(device=draft.device).manual_seed(seed)

    def __call__(self, source: str, examples: list[Example]) -> Batch:
        self.draft.eval()
        return generate_batch(
            source,
            self.target,
            self.draft,
            self.tokenizer,
            examples,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            gamma=self.gamma,
            generator=self.generator,
            max_prompt_tokens=self.max_prompt_tokens,
            topk=self.topk,
        )


class Sampler:
    """The data half of Algorithm A.2: draw the source, draw prompts, produce the batch.

    Used by the single-process :class:`Distiller` and by each rollout actor of the Ray pipeline. Continuations come
    from ``generate`` (default: :class:`HFGenerator` over ``target`` and ``draft``, target samples with the target's
    top ``topk`` log-probs where it is not 0). Online distillation: with ``prompts``, each sampled batch's prompts
    are ``prompts()`` (served ones), not a draw from ``train``; with ``served`` (``rollout.online_samples``), a batch
    drawn from the target's samples is ``served()`` (completions the endpoint served and scored), and no target is
    needed. ``target`` may be None when the recipe never asks for target-generated data, and both may be None when
    ``generate`` is given.
    """

    def __init__(
        self,
        target: PreTrainedModel | None,
        draft: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase,
        train: list[Example],
        cfg,
        *,
        seed: int = 0,
        max_len: int = 256,
        generate: Generate | None = None,
        topk: int = 0,
        prompts: Callable[[], list[Example]] | None = None,
        served: Callable[[], Batch] | None = None,
    ) -> None:
        if not train:
            raise DistillSpecError("the distillation data set is empty: give a dataset with training examples")
        self.recipe = resolve_recipe(cfg)
        if generate is None:
            if target is None and self.recipe.draws_target_samples and served is None:
                raise DistillSpecError(f"recipe {cfg.recipe!r} samples from the target: a target model is needed")
            generate = HFGenerator(
                target,
                draft,
                tokenizer,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                gamma=cfg.sample_gamma,
                seed=seed,
                max_prompt_tokens=cfg.max_prompt_tokens,
                topk=topk,
            )
        self.generate, self.tokenizer, self.train, self.cfg = generate, tokenizer, train, cfg
        self.prompts, self.served = prompts, served
        self.max_len = max_len
        self.rng = random.Random(seed)

    def __call__(self) -> tuple[str, Batch]:
        source = draw_source(self.rng, self.recipe)
        if source == "target" and self.served is not None:
            return source, self.served()
        if self.prompts is not None:
            examples = self.prompts()
        else:
            examples = self.rng.sample(self.train, min(self.cfg.batch_size, len(self.train)))
        if source == "fixed":
            return source, encode_examples(self.tokenizer, examples, self.max_len)
        return source, self.generate(source, examples)
