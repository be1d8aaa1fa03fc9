"""The draft vocabulary (distillspec/models/draft_vocab.py): exact speculative decoding with a draft that proposes from
part of the vocabulary, its training target, and its round trip through save_pretrained."""

import copy
import math

import pytest
import torch

from distillspec import DistillSpecError, autoregressive_generate, speculative_generate
from distillspec.models.draft_vocab import (
    d2t,
    expand_logits,
    frequent_tokens,
    restrict_head,
    restrict_target,
    whole_head,
)
from distillspec.models.loading import check_pair_sources, load_model
from distillspec.training.divergences import compress_topk, divergence

from .conftest import perturbed, tiny_llama
from .test_speculative import V, assert_greedy_sd_is_target_greedy, fit_to_target

#: The draft proposes 5 of the 8 tokens: the target's mass on the other 3 can only come from the residual.
KEPT = torch.tensor([0, 2, 3, 5, 6])


@pytest.fixture(scope="module")
def restricted_pair():
    target = tiny_llama(V, d=16, seed=3, sharpness=30.0)
    draft = restrict_head(tiny_llama(V, d=16, seed=4, sharpness=30.0), KEPT)
    return target, draft


@pytest.mark.parametrize("gamma", [1, 3])
def test_sd_with_a_draft_vocabulary_follows_the_target_distribution(restricted_pair, gamma):
    """Chi-square over 12,000 two-token samples: exact, though the draft never proposes 3 of the 8 tokens."""
    target, draft = restricted_pair
    prompt = torch.tensor([[1, 2, 3]])
    out = speculative_generate(
        target,
        draft,
        prompt.repeat(12_000, 1),
        gamma=gamma,
        max_new_tokens=2,
        temperature=1.0,
        generator=torch.Generator().manual_seed(gamma),
    )
    assert 0.0 < out.stats.alpha < 1.0
    assert not bool(torch.isin(out.sequences[:, 3:], KEPT).all())  # tokens outside the draft's vocabulary came
    assert fit_to_target(out, target, prompt) > 1e-3


def test_the_restricted_draft_samples_only_inside_its_vocabulary(restricted_pair):
    _, draft = restricted_pair
    out = autoregressive_generate(
        draft, torch.tensor([[1, 2, 3]]).repeat(500, 1), max_new_tokens=3, generator=torch.Generator().manual_seed(0)
    )
    assert bool(torch.isin(out.sequences[:, 3:], KEPT).all())
    assert len(torch.unique(out.sequences[:, 3:])) == len(KEPT)


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_sd_with_a_draft_vocabulary_equals_target_greedy(gamma):
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    draft = restrict_head(perturbed(target, 0.01), torch.arange(0, 64, 2))  # the even ids only
    assert_greedy_sd_is_target_greedy(target, draft, gamma)


def test_the_head_restricted_keeps_the_rows_and_untie():
    model = tiny_llama(64, d=32, seed=0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    full = model(torch.tensor([[1, 2, 3]])).logits
    keep = torch.tensor([1, 5, 9, 63])
    restrict_head(model, keep)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.allclose(model(torch.tensor([[1, 2, 3]])).logits, full[..., keep], atol=1e-6)
    assert torch.equal(d2t(model), keep)
    expanded = expand_logits(full[..., keep], keep, 64)
    assert torch.isinf(expanded[..., 0]).all() and torch.equal(expanded[..., keep], full[..., keep])


def test_a_restricted_draft_round_trips_through_save_pretrained(tmp_path, tokenizer):
    model = restrict_head(tiny_llama(len(tokenizer), d=32, seed=0), torch.arange(0, len(tokenizer), 3))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path))
    assert torch.equal(d2t(loaded), d2t(model))
    x = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded(x).logits, model(x).logits)


def test_frequent_tokens_counts_and_keeps_the_special_ones():
    ids = frequent_tokens([[5, 5, 5, 7, 7, 9], [7, 5, 1]], 3, 16, always=[15])
    assert ids.tolist() == [5, 7, 15]
    assert frequent_tokens([[3]], 4, 8).tolist() == [0, 1, 2, 3]  # unseen ids fill the rest
    with pytest.raises(DistillSpecError, match="must be in"):
        frequent_tokens([[1]], 0, 8)


def test_bad_ids_are_refused():
    model = tiny_llama(16, d=16)
    for ids, match in (([3, 3], "distinct"), ([0, 16], r"\[0, 16\)"), ([], "ids")):
        with pytest.raises(DistillSpecError, match=match):
            restrict_head(copy.deepcopy(model), torch.tensor(ids, dtype=torch.long))


def test_the_training_target_is_the_target_conditioned_on_the_draft_vocabulary():
    """Full logits and top-k log-probs give the same loss where the top-k hold the kept tokens; the optimum of every
    divergence is the conditioned target, whose TVD over the whole vocabulary is the mass outside it."""
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(2, 3, 10, generator=g) * 3
    keep = torch.tensor([0, 1, 4, 7])
    conditioned = target_logits[..., keep]  # the draft that matches the target inside its vocabulary
    for name in ("fkl", "rkl", "jsd", "tvd"):
        loss = divergence(name, conditioned, restrict_target(target_logits, keep), reduction="token")
        assert float(loss) == pytest.approx(0.0, abs=1e-6)
        other = torch.randn(2, 3, 4, generator=g)
        assert float(divergence(name, other, restrict_target(target_logits, keep), reduction="token")) > 1e-3
    topk = compress_topk(target_logits, 10)  # every token scored: the same conditioned target
    draft = torch.randn(2, 3, 4, generator=g)
    full = divergence("fkl", draft, restrict_target(target_logits, keep), reduction="token")
    assert float(divergence("fkl", draft, restrict_target(topk, keep), reduction="token")) == pytest.approx(
        float(full), rel=1e-4
    )
    p = torch.softmax(target_logits, -1)
    outside = 1 - p[..., keep].sum(-1).mean()
    tvd = divergence("tvd", expand_logits(conditioned, keep, 10), target_logits, reduction="token")
    assert float(tvd) == pytest.approx(float(outside), rel=1e-4)
    assert math.isfinite(float(divergence("rkl", draft, restrict_target(compress_topk(target_logits, 3), keep))))


def test_a_draft_vocabulary_and_a_pruned_draft_made_from_a_draft_folder(tmp_path, tokenizer, task):
    """``draft=model@spread:K`` keeps K of that model's own layers; ``draft_vocab=V`` keeps the V most frequent
    tokens of the task's data in its head, EOS among them; both cached folders that load as they were made."""
    from distillspec.models.pretrained import resolve_pair, split_draft, task_vocab, vocab_draft

    for name, layers in (("target", 3), ("draft", 4)):
        model = tiny_llama(len(tokenizer), d=32, layers=layers, seed=layers)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    draft_spec = f"{tmp_path / 'draft'}@spread:2"
    assert split_draft(draft_spec) == (str(tmp_path / "draft"), "spread:2")
    assert split_draft("first:2") == (None, "first:2") and split_draft("org/m") == ("org/m", None)
    _, pruned = resolve_pair(str(tmp_path / "target"), draft_spec, log=lambda _: None)
    small, _ = load_model(pruned)
    assert small.config.num_hidden_layers == 2
    ids = task_vocab(task, tokenizer, 64)
    assert len(ids) == 64 and tokenizer.eos_token_id in ids.tolist()
    folder = vocab_draft(pruned, ids, log=lambda _: None)
    restricted, _ = load_model(str(folder))
    assert torch.equal(d2t(restricted), ids) and restricted.config.num_hidden_layers == 2
    assert vocab_draft(pruned, ids, log=lambda _: None) == folder  # cached
    check_pair_sources(str(tmp_path / "target"), str(folder))
    with pytest.raises(DistillSpecError, match="vLLM's draft_model drafts take none"):
        check_pair_sources(str(tmp_path / "target"), str(folder), vllm=True)


def test_a_draft_vocabulary_gets_a_whole_head_back_for_vllm(tmp_path, tokenizer):
    """vLLM's draft_model takes no draft vocabulary: a draft with one is saved again with a whole head, its own rows
    and the others of the head it was cut from. A frozen head decodes as the model it was cut from; a trained one
    keeps its rows; a base head of the wrong shape is refused; a draft without a draft vocabulary is its own folder."""
    from distillspec.models.pretrained import whole_vocab_draft

    model = tiny_llama(len(tokenizer), d=32, seed=0)
    x, keep = torch.tensor([[1, 2, 3, 4]]), torch.arange(0, len(tokenizer), 3)
    full = model(x).logits
    trained = restrict_head(copy.deepcopy(model), keep)
    with torch.no_grad():
        trained.lm_head.weight.mul_(2.0)
    for name, m in (("whole", model), ("cut", restrict_head(copy.deepcopy(model), keep)), ("trained", trained)):
        m.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    base = str(tmp_path / "whole")
    folder = whole_vocab_draft(str(tmp_path / "cut"), base, log=lambda _: None)
    assert whole_vocab_draft(str(tmp_path / "cut"), base, log=lambda _: None) == folder  # cached
    restored, _ = load_model(str(folder))
    assert d2t(restored) is None and torch.equal(restored(x).logits, full)
    check_pair_sources(base, str(folder), vllm=True)
    other, _ = load_model(str(whole_vocab_draft(str(tmp_path / "trained"), base, log=lambda _: None)))
    assert torch.equal(other.lm_head.weight[keep], 2.0 * model.lm_head.weight[keep])
    rest = torch.ones(len(tokenizer), dtype=torch.bool)
    rest[keep] = False
    assert torch.equal(other.lm_head.weight[rest], model.lm_head.weight[rest])
    assert whole_vocab_draft(base, base, log=lambda _: None) == tmp_path / "whole"
    with pytest.raises(DistillSpecError, match="the base head must be the whole head"):
        whole_head(restrict_head(copy.deepcopy(model), keep), model.lm_head.weight[keep])


def test_a_draft_vocabulary_with_a_vllm_backend_is_refused_before_any_work():
    from distillspec.config import load_config

    with pytest.raises(DistillSpecError, match="vLLM's draft_model drafts take no draft vocabulary"):
        load_config(None, ["draft_vocab=256", "serve.backend=vllm"])


def test_a_draft_vocabulary_counts_the_drafts_own_samples(tmp_path, tokenizer, task):
    """``draft_vocab_samples``: the tokens of the draft's own samples are kept beside the data set's, however rare
    in the text; the samples are drawn once (cached) and are the same again."""
    from distillspec.models.pretrained import draft_samples, draft_vocab_ids

    model = tiny_llama(len(tokenizer), d=32, seed=5)  # random: it writes tokens the arithmetic text never holds
    model.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    draft, logs = str(tmp_path / "draft"), []
    samples = draft_samples(draft, task, 4, log=logs.append)
    assert len(samples) == 4 and all(0 < len(s) <= 128 for s in samples) and logs
    logs.clear()
    assert draft_samples(draft, task, 4, log=logs.append) == samples and logs == []  # cached
    text = {t for e in task.train for t in tokenizer(e.prompt + e.reference, add_special_tokens=False)["input_ids"]}
    written = {t for s in samples for t in s} - text
    assert written, "the random draft wrote no token the text lacks"
    size = len(text | written | set(tokenizer.all_special_ids))
    assert size < len(tokenizer)
    both = set(draft_vocab_ids(draft, task, tokenizer, size, samples=4, log=logs.append).tolist())
    alone = set(draft_vocab_ids(draft, task, tokenizer, size, samples=0, log=logs.append).tolist())
    assert written | text <= both and text <= alone and not written <= alone
