"""Sampling controls (top-p, top-k, min-p, penalties, logit bias, stop token ids): the processing against vLLM's
own sampler functions, and speculative decoding exact for the processed target (chi-square at T = 1, greedy equality
at T = 0, seeds)."""

import math

import pytest
import torch

from distillspec import DistillSpecError, autoregressive_generate, speculative_generate
from distillspec.decoding.sampling import History, SamplingControls, penalise, truncate
from distillspec.models.draft_vocab import restrict_head

from .conftest import perturbed, tiny_llama
from .test_speculative import V, left_padded_prompts

CONTROLS = {
    "top_p": SamplingControls(top_p=0.8),
    "top_k": SamplingControls(top_k=3),
    "min_p": SamplingControls(min_p=0.3),
    "presence_penalty": SamplingControls(presence_penalty=1.5),
    "frequency_penalty": SamplingControls(frequency_penalty=-1.0),
    "repetition_penalty": SamplingControls(repetition_penalty=1.8),
    "logit_bias": SamplingControls(logit_bias=((2, 3.0), (5, -100.0))),
    "all": SamplingControls(top_p=0.9, top_k=5, min_p=0.02, presence_penalty=0.5, repetition_penalty=1.3),
}


@pytest.fixture(scope="module")
def flat_pair():
    """A target and draft over 8 tokens whose distributions are spread enough for truncation to bite."""
    return tiny_llama(V, d=16, seed=3, sharpness=8.0), tiny_llama(V, d=16, seed=4, sharpness=8.0)


PROMPT = torch.tensor([[1, 2, 3]])


def two_tokens(target, draft, controls: SamplingControls, **kw):
    """12,000 rows of SD at gamma 3, two new tokens each, after :data:`PROMPT`."""
    return speculative_generate(
        target, draft, PROMPT.repeat(12_000, 1), gamma=3, max_new_tokens=2, controls=controls, **kw
    )


def processed_joint(target, prompt, controls: SamplingControls, temperature: float = 1.0) -> torch.Tensor:
    """The processed target's exact distribution of the next two tokens, flattened [V*V]."""
    with torch.no_grad():
        first = History(controls, prompt, torch.ones_like(prompt), V)
        logits = first.process(target(prompt).logits[:, -1:], torch.tensor([0]), temperature)
        p1 = torch.softmax(logits[0, 0].double() / temperature, -1)
        ext = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        second = History(controls, prompt.repeat(V, 1), torch.ones(V, 3, dtype=torch.long), V)
        second.observe(torch.arange(V)[:, None], torch.ones(V, dtype=torch.long))
        logits = second.process(target(ext).logits[:, -1:], torch.arange(V), temperature)
        p2 = torch.softmax(logits[:, 0].double() / temperature, -1)
    return (p1[:, None] * p2).flatten()


def fit(out, expected: torch.Tensor) -> float:
    from scipy.stats import chisquare

    observed = torch.bincount(out.sequences[:, 3] * V + out.sequences[:, 4], minlength=V * V).double()
    support = expected > 0
    assert observed[~support].sum() == 0, "a sample the processed target gives no probability"
    exp = expected[support] * observed.sum() / expected[support].sum()
    p = chisquare(observed[support].numpy(), exp.numpy()).pvalue
    print(f"chi-square over {int(observed.sum())} samples, {int(support.sum())} outcomes: p = {p:.4f}")  # pytest -rP
    return p


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_sd_follows_the_processed_target(flat_pair, name):
    """Chi-square over 12,000 two-token samples of SD at gamma 3 against the processed target's exact joint, which
    the control moves away from the plain target's."""
    target, draft = flat_pair
    prompt, controls = PROMPT, CONTROLS[name]
    out = two_tokens(target, draft, controls, generator=torch.Generator().manual_seed(1))
    assert 0.0 < out.stats.alpha < 1.0
    assert fit(out, processed_joint(target, prompt, controls)) > 1e-3
    assert (
        processed_joint(target, prompt, controls) - processed_joint(target, prompt, SamplingControls())
    ).abs().max() > 0.01


def test_seeded_sd_and_a_draft_vocabulary_follow_the_processed_target(flat_pair):
    """Seeded rows (coupled verification) and a draft restricted to 5 of the 8 tokens stay exact with controls."""
    target, draft = flat_pair
    controls = CONTROLS["all"]
    expected = processed_joint(target, PROMPT, controls)
    assert fit(two_tokens(target, draft, controls, seeds=range(12_000)), expected) > 1e-3
    restricted = restrict_head(perturbed(draft, 0.0), torch.tensor([0, 1, 2, 4, 6]))
    out = two_tokens(target, restricted, controls, generator=torch.Generator().manual_seed(2))
    assert 0.0 < out.stats.alpha < 1.0
    assert fit(out, expected) > 1e-3


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_sd_equals_greedy_decoding_with_the_same_controls(gamma):
    """At T = 0 the penalties and the bias change the text, and SD emits what plain decoding emits."""
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    draft = perturbed(target, 0.01)
    ids, mask = left_padded_prompts()
    controls = SamplingControls(frequency_penalty=2.0, repetition_penalty=1.5, logit_bias=((7, 5.0),))
    kw = dict(max_new_tokens=24, temperature=0, attention_mask=mask)
    plain = autoregressive_generate(target, ids, **kw, controls=controls)
    sd = speculative_generate(target, draft, ids, gamma=gamma, **kw, controls=controls)
    assert torch.equal(sd.sequences, plain.sequences)
    assert 0.0 < sd.stats.alpha < 1.0
    assert not torch.equal(plain.sequences, autoregressive_generate(target, ids, **kw).sequences)


def test_repetition_penalty_matches_transformers_generate():
    """Greedy decoding with ``repetition_penalty`` emits what ``generate`` does with its own (same definition)."""
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    prompt = torch.tensor([[5, 9, 12, 5, 40]])
    ours = autoregressive_generate(
        target, prompt, max_new_tokens=16, temperature=0, controls=SamplingControls(repetition_penalty=1.7)
    )
    theirs = target.generate(prompt, max_new_tokens=16, do_sample=False, repetition_penalty=1.7, pad_token_id=0)
    assert torch.equal(ours.sequences, theirs)


def test_stop_token_ids_end_rows_like_eos(flat_pair):
    target, draft = flat_pair
    out = speculative_generate(
        target, draft, torch.tensor([[1, 2, 3]]).repeat(64, 1), gamma=3, max_new_tokens=12, eos_token_id=[6, 2],
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    for row in range(64):
        new = out.sequences[row, 3 : 3 + int(out.num_new_tokens[row])].tolist()
        assert all(t not in (6, 2) for t in new[:-1])
        assert len(new) == 12 or new[-1] in (6, 2)


def test_processing_matches_vllm_sampler_functions():
    """Penalties, top-k and top-p as vLLM's own functions compute them, on random logits and histories."""
    vllm_utils = pytest.importorskip("vllm.model_executor.layers.utils")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(0)
    vocab, rows = 50, 4
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (rows, 6), generator=g)
    output = torch.randint(0, vocab, (rows, 9), generator=g)
    c = SamplingControls(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6, top_k=7, top_p=0.6)
    history = History(c, prompt, torch.ones_like(prompt), vocab)
    history.observe(output, torch.full((rows,), 9))
    ours = history.process(logits[:, None], torch.arange(rows), 0.8)[:, 0]
    theirs = vllm_utils.apply_penalties(
        logits.clone(), prompt, output, *(torch.full((rows,), v) for v in (0.7, 0.4, 1.6))
    )
    k, p = torch.full((rows,), 7), torch.full((rows,), 0.6)
    theirs = apply_top_k_top_p_pytorch(theirs / 0.8, k, p) * 0.8
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])


@pytest.mark.parametrize(
    "scale, temperature, top_p", [(8.0, 1.0, 0.95), (3.0, 1.0, 0.9), (3.0, 0.5, 0.5), (0.5, 1.0, 0.5)]
)
def test_top_p_keeps_the_nucleus_of_a_large_vocabulary(scale, temperature, top_p):
    """top-p on 151,936 tokens, peaked rows (the nucleus among the first candidates) and flat ones (searched among
    more, up to every token), against the rule in float64: a token stays where its likelier tokens hold less than
    top_p. The floor is found in float32, so a token whose likelier mass lies within 1e-5 of top_p may go either way."""
    from distillspec.decoding.sampling import NUCLEUS_CANDIDATES

    logits = torch.randn(3, 151_936, generator=torch.Generator().manual_seed(0)) * scale
    kept = ~torch.isinf(truncate(logits, temperature, SamplingControls(top_p=top_p)))
    probs = torch.softmax(logits.double() / temperature, -1)
    ordered, order = probs.sort(-1, descending=True)
    likelier = torch.zeros_like(probs).scatter(-1, order, ordered.cumsum(-1) - ordered)
    clear = (likelier - top_p).abs() > 1e-5
    assert torch.equal(kept[clear], (likelier < top_p)[clear])
    assert kept.any(-1).all() and not kept.all()
    if scale == 8.0:
        assert kept.sum(-1).max() < NUCLEUS_CANDIDATES  # the first search held the nucleus
    if scale == 0.5:
        assert kept.sum(-1).min() > 16 * NUCLEUS_CANDIDATES  # the last searched every token


@pytest.mark.parametrize("k, m", [(1, 0), (1, 3), (3, 5), (6, 5)])
def test_penalties_after_a_blocks_drafts_are_those_of_counting_every_position(k, m):
    """History.process recomputes only the drafts' tokens after the drafts each position sees: the same logits,
    bit for bit, as counting each position's tokens and penalising the whole vocabulary there (drafts repeating each
    other and the tokens so far; rows in another order than the call's)."""
    g = torch.Generator().manual_seed(k * 10 + m)
    vocab, rows = 40, 3
    c = SamplingControls(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6, logit_bias=((3, 2.0),))
    prompt = torch.randint(0, vocab, (rows, 6), generator=g)
    history = History(c, prompt, torch.ones_like(prompt), vocab)
    output = torch.randint(0, 8, (rows, 9), generator=g)
    history.observe(output, torch.tensor([9, 4, 0]))
    order = torch.tensor([2, 0])
    drafts = torch.randint(0, 8, (len(order), m), generator=g)
    logits = torch.randn(len(order), k, vocab, generator=g) * 3
    got = history.process(logits, order, 0.0, drafts)
    for r, row in enumerate(order.tolist()):
        for i in range(k):
            seen = drafts[r, : m - k + 1 + i]
            counts = history.counts[row] + torch.bincount(seen, minlength=vocab)
            want = penalise(logits[r, i] + history.bias, counts, history.prompt[row], c)
            assert torch.equal(got[r, i], want), (row, i)


def test_truncation_by_hand():
    logits = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.1)]])
    kept = lambda **kw: (~torch.isinf(truncate(logits, 1.0, SamplingControls(**kw)))).nonzero()[:, 1].tolist()
    assert kept(top_p=0.5) == [0]
    assert kept(top_p=0.7) == [0, 1]
    assert kept(top_k=2) == [0, 1]
    assert kept(min_p=0.4) == [0, 1]
    assert kept(min_p=0.1) == [0, 1, 2]
    counts = torch.tensor([[2.0, 0.0, 1.0]])
    out = penalise(torch.tensor([[1.0, 1.0, -1.0]]), counts, None, SamplingControls(repetition_penalty=2.0))
    assert out.tolist() == [[0.5, 1.0, -2.0]]
    out = penalise(torch.zeros(1, 3), counts, None, SamplingControls(frequency_penalty=0.5, presence_penalty=1.0))
    assert out.tolist() == [[-2.0, 0.0, -1.5]]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"70": 1.0}}, "outside the vocabulary"),
        ({"logit_bias": {"x": 1.0}}, "token ids"),
        ({"logit_bias": {"3": 200.0}}, r"\[-100, 100\]"),
        ({"stop_token_ids": [64]}, "outside the vocabulary"),
    ],
)
def test_bad_controls_are_refused_naming_the_field(kw, match):
    with pytest.raises(DistillSpecError, match=match):
        SamplingControls.of(**kw).check(64)
