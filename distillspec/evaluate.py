"""Measure a target/draft pair: alpha and tau from SD runs and from TVD, task score, wall-clock speedup."""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.batches import make_batch
from distillspec.data import score
from distillspec.draft_vocab import d2t, expand_logits, vocab_size
from distillspec.losses import forward_logits
from distillspec.metrics import alpha_from_tvd, expected_tau, measure_cost_ratio, predicted_speedup
from distillspec.models import decode_new, encode_prompts
from distillspec.speculative import autoregressive_generate, speculative_generate


@torch.inference_mode()
def evaluate_sd(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int = 32,
    seed: int = 0,
    references: list[str] | None = None,
    metric: str | None = None,
    lenience: str | None = None,
    epsilon: float = 1.0,
) -> dict:
    """Speculative decoding over ``prompts``: empirical alpha/tau, alpha from TVD (Eq. 3), task score."""
    generator = torch.Generator(device=target.device).manual_seed(seed)
    accepted = rejected = blocks = new_tokens = 0
    tvd_sum = tvd_count = 0.0
    predictions: list[str] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ids, mask = (t.to(target.device) for t in encode_prompts(tokenizer, prompts[i : i + batch_size]))
        out = speculative_generate(
            target,
            draft,
            ids,
            gamma=gamma,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            lenience=lenience,
            epsilon=epsilon,
            eos_token_id=tokenizer.eos_token_id,
            attention_mask=mask,
            generator=generator,
            pad_token_id=tokenizer.pad_token_id,
        )
        s = out.stats
        accepted += int(s.accepted.sum())
        rejected += int(s.rejected.sum())
        blocks += int(s.blocks.sum())
        new_tokens += int(s.new_tokens.sum())
        predictions += decode_new(tokenizer, out.sequences, ids.shape[1], out.num_new_tokens)
        # Eq. 3 on these samples (target samples when lossless): alpha = 1 - E[TVD(p, q)].
        batch = make_batch(ids, mask, out.sequences[:, ids.shape[1] :], out.num_new_tokens)
        n = batch.loss_mask.sum().item()
        if n:
            a = alpha_from_tvd(
                expand_logits(forward_logits(draft, batch), d2t(draft), vocab_size(target)),
                forward_logits(target, batch),
                batch.window_mask,
                temperature,
            )
            tvd_sum += (1.0 - a) * n
            tvd_count += n
    seconds = time.perf_counter() - start
    alpha = accepted / (accepted + rejected) if accepted + rejected else float("nan")
    alpha_tvd = 1.0 - tvd_sum / tvd_count if tvd_count else float("nan")
    record = {
        "gamma": gamma,
        "temperature": temperature,
        "lenience": lenience,
        "epsilon": epsilon,
        "alpha": alpha,
        "tau": (accepted + blocks) / blocks if blocks else float("nan"),
        "alpha_tvd": alpha_tvd,
        "tau_theory": expected_tau(alpha_tvd, gamma),
        "drafted": blocks * gamma,
        "accepted": accepted,
        "rejected": rejected,
        "target_calls": blocks,
        "new_tokens": new_tokens,
        "prompts": len(prompts),
        "seconds": seconds,
    }
    if references is not None and metric is not None:
        record.update(score(metric, predictions, references[: len(predictions)]))
    return record


@torch.inference_mode()
def measure_speedup(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    compile: bool = False,
) -> dict:
    """Wall-clock tokens/s of SD vs target-only decoding, one prompt at a time, with the same cache code
    (``compile``: both decoders' steps compiled, see :func:`distillspec.speculative.cached_lm`; compiling happens
    in an untimed pass over the prompts first).

    Also returns the measured cost ratio ``c`` and the predicted speedup ``tau / (c * gamma + 1)``.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids0, _ = encode_prompts(tokenizer, prompts[:1])
    cost = measure_cost_ratio(target, draft, ids0.to(target.device), gamma=gamma, compile=compile)
    common = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos, pad_token_id=pad)
    for prompt in prompts if compile else []:  # each shape compiles once, outside the clock
        ids = encode_prompts(tokenizer, [prompt])[0].to(target.device)
        autoregressive_generate(target, ids, compile=True, **common)
        speculative_generate(target, draft, ids, gamma=gamma, compile=True, **common)
    g_ar = torch.Generator(device=target.device).manual_seed(seed)
    g_sd = torch.Generator(device=target.device).manual_seed(seed)
    t_ar = t_sd = 0.0
    n_ar = n_sd = accepted = blocks = 0
    for prompt in prompts:  # interleaved, so drifts in machine speed hit both alike
        ids, _ = encode_prompts(tokenizer, [prompt])
        ids = ids.to(target.device)
        start = time.perf_counter()
        ar = autoregressive_generate(target, ids, generator=g_ar, compile=compile, **common)
        t_ar += time.perf_counter() - start
        start = time.perf_counter()
        sd = speculative_generate(target, draft, ids, gamma=gamma, generator=g_sd, compile=compile, **common)
        t_sd += time.perf_counter() - start
        n_ar += int(ar.num_new_tokens.sum())
        n_sd += int(sd.num_new_tokens.sum())
        accepted += int(sd.stats.accepted.sum())
        blocks += int(sd.stats.blocks.sum())
    tau = (accepted + blocks) / blocks
    measured = (n_sd / t_sd) / (n_ar / t_ar)
    predicted = predicted_speedup(tau, cost.c, gamma)
    predicted_v = predicted_speedup(tau, cost.c, gamma, cost.v)
    return {
        "c": cost.c,
        "v": cost.v,
        "target_ms": cost.target_ms,
        "draft_ms": cost.draft_ms,
        "verify_ms": cost.verify_ms,
        "predicted_speedup_with_v": predicted_v,
        "measured_over_predicted_with_v": measured / predicted_v,
        "target_tokens_per_s": n_ar / t_ar,
        "sd_tokens_per_s": n_sd / t_sd,
        "speedup_tau": tau,
        "measured_speedup": measured,
        "predicted_speedup": predicted,
        "measured_over_predicted": measured / predicted,
    }
