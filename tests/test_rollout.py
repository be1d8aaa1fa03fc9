"""The data half of Algorithm A.2 (distillspec/training/rollout.py): target samples that come scored, and the prompts
of an online batch."""

import pytest
import torch

from distillspec.config import DistillConfig, resolve_recipe
from distillspec.training.batches import RolloutBatch
from distillspec.training.divergences import compress_topk, divergence
from distillspec.training.losses import forward_logits, kd_loss
from distillspec.training.rollout import generate_batch, online_rows, served_batch


def _target_samples(text_pair, tokenizer, task, **kw):
    target, draft = text_pair
    generator = torch.Generator().manual_seed(0)
    return generate_batch(
        "target", target, draft, tokenizer, task.train[:6], max_new_tokens=10, generator=generator, **kw
    )


def test_target_samples_come_with_the_top_k_a_scorer_computes(text_pair, tokenizer, task):
    target, draft = text_pair
    batch = _target_samples(text_pair, tokenizer, task, temperature=1.0, topk=8)
    assert batch.target is not None
    with torch.no_grad():
        scorer = compress_topk(forward_logits(target, batch), 8, 1.0)
    mask = batch.window_mask.bool()
    assert mask.sum() >= 30 and (~mask).any()
    assert batch.target.logprobs.shape == scorer.logprobs.shape
    torch.testing.assert_close(batch.target.logprobs[mask], scorer.logprobs[mask], rtol=1e-4, atol=1e-4)
    assert torch.equal(batch.target.indices[mask], scorer.indices[mask])
    # where the loss reads nothing: a distribution all the same (no NaN in a divergence)
    assert torch.allclose(batch.target.logprobs[~mask].exp().sum(-1), torch.ones(1))
    recipe = resolve_recipe(DistillConfig(recipe="seqkd", divergence="rkl"))
    carried = RolloutBatch.from_batch(batch, version=0, source="target")
    assert carried.scored
    with torch.no_grad():
        shipped = kd_loss(draft, target, carried.batch(), recipe, target_logits=carried.target(1.0))
        scored = kd_loss(draft, target, batch, recipe, target_logits=scorer)
    torch.testing.assert_close(shipped, scored, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(divergence("tvd", forward_logits(draft, batch), batch.target, batch.window_mask))


@pytest.mark.parametrize("kw", [{"temperature": 0.7, "topk": 8}, {"temperature": 1.0, "topk": 0}])
def test_otherwise_the_scorer_scores(text_pair, tokenizer, task, kw):
    """At another temperature the divergence's distribution is not the one that sampled; topk=0: none asked."""
    batch = _target_samples(text_pair, tokenizer, task, **kw)
    assert batch.target is None
    assert not RolloutBatch.from_batch(batch, version=0, source="target").scored


@pytest.mark.parametrize(
    ("batch_size", "mix", "rows"),
    [(8, 0.0, (8, 0)), (8, 0.5, (4, 4)), (8, 0.3, (6, 2)), (8, 0.99, (1, 7)), (1, 0.5, (1, 0))],
)
def test_an_online_batch_mixes_the_data_sets_prompts_but_keeps_a_served_one(batch_size, mix, rows):
    assert online_rows(batch_size, mix) == rows


def test_served_samples_batch_with_the_scores_a_scorer_computes(text_pair, tokenizer, task):
    """Completions the endpoint recorded (serve.record_samples) become a batch of the target's samples whose top-k are
    those a scorer computes over it, and whose loss is the scorer's: nothing to sample or score again."""
    from distillspec.serving.completer import Completer, CompletionJob, DecodingArgs

    target, draft = text_pair
    completer = Completer(target, draft, tokenizer, max_prompt_tokens=64)
    jobs = [
        CompletionJob(e.prompt, 10, DecodingArgs(gamma=3, temperature=1.0), seed=i, record=8)
        for i, e in enumerate(task.train[:5])
    ]
    samples = [d.sample for d in completer.complete(jobs)]
    batch = served_batch(samples, tokenizer.pad_token_id, max_prompt_tokens=None, max_new_tokens=10)
    assert batch.tokens == sum(len(s.tokens) for s in samples) >= 30
    with torch.no_grad():
        scorer = compress_topk(forward_logits(target, batch), 8, 1.0)
    mask = batch.window_mask.bool()
    torch.testing.assert_close(batch.target.logprobs[mask], scorer.logprobs[mask], rtol=1e-4, atol=1e-4)
    assert torch.equal(batch.target.indices[mask], scorer.indices[mask])
    recipe = resolve_recipe(DistillConfig(recipe="seqkd"))
    with torch.no_grad():
        served = kd_loss(draft, target, batch, recipe, target_logits=batch.target)
        scored = kd_loss(draft, target, batch, recipe, target_logits=scorer)
    torch.testing.assert_close(served, scored, rtol=1e-4, atol=1e-5)
    short = served_batch(samples, tokenizer.pad_token_id, max_prompt_tokens=4, max_new_tokens=3)
    assert short.input_ids.shape[1] <= 4 + 3 and short.tokens == sum(min(3, len(s.tokens)) for s in samples)
    assert short.target.logprobs.shape[1] == short.window_mask.shape[1]
