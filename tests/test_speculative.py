import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distillspec import DistillSpecError, autoregressive_generate, speculative_generate

from .conftest import exact_joint, perturbed, pooled_chisquare, tiny_llama

V = 8


@pytest.fixture(scope="module")
def small_vocab_pair():
    return tiny_llama(V, d=16, seed=3, sharpness=30.0), tiny_llama(V, d=16, seed=4, sharpness=30.0)


def fit_to_target(out, target, prompt) -> float:
    """Chi-square p-value of the two tokens each row sampled after ``prompt`` against the target's exact joint."""
    observed = torch.bincount(out.sequences[:, 3] * V + out.sequences[:, 4], minlength=V * V).double()
    return pooled_chisquare(observed, exact_joint(target, prompt))


@pytest.mark.parametrize("gamma", [1, 3])
def test_sd_samples_follow_target_distribution(small_vocab_pair, gamma):
    """Chi-square over 12,000 two-token samples (64 cells), each row of one batch its own chain."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3]])
    n = 12_000
    out = speculative_generate(
        target,
        draft,
        prompt.repeat(n, 1),
        gamma=gamma,
        max_new_tokens=2,
        temperature=1.0,
        generator=torch.Generator().manual_seed(gamma),
    )
    assert 0.0 < out.stats.alpha < 1.0  # the test exercises both acceptance and rejection
    assert fit_to_target(out, target, prompt) > 1e-3


def test_chi_square_detects_a_wrong_distribution(small_vocab_pair):
    """The exactness test has power: the draft's own samples fail it."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3]])
    out = autoregressive_generate(
        draft, prompt.repeat(12_000, 1), max_new_tokens=2, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert fit_to_target(out, target, prompt) < 1e-6


@pytest.fixture(scope="module")
def close_pair():
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    return target, perturbed(target, 0.01)


def left_padded_prompts():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (5, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def assert_greedy_sd_is_target_greedy(decoder, draft, gamma: int, reference=None, through_cache: bool = False):
    """Greedy SD of ``decoder`` (the target, or a copy laid out otherwise) with ``draft`` over left-padded prompts
    equals ``reference``'s (default: the decoder's) own greedy ``generate`` of each unpadded prompt (``through_cache``:
    its greedy decoding through the project's cache, :func:`autoregressive_generate`), with partial acceptance
    (rejected positions became cache holes); returns the SD output."""
    reference = decoder if reference is None else reference
    ids, mask = left_padded_prompts()
    sd = speculative_generate(decoder, draft, ids, gamma=gamma, max_new_tokens=24, temperature=0, attention_mask=mask)
    for row in range(len(ids)):
        prompt = ids[row : row + 1, mask[row].bool()]
        if through_cache:
            own = autoregressive_generate(reference, prompt, max_new_tokens=24, temperature=0).sequences
        else:
            own = reference.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert torch.equal(sd.sequences[row, ids.shape[1] :], own[0, prompt.shape[1] :])
    assert 0.0 < sd.stats.alpha < 1.0
    return sd


@pytest.mark.parametrize("gamma", [1, 3, 5, 7])
def test_greedy_equals_target_greedy(close_pair, gamma):
    target, draft = close_pair
    sd = assert_greedy_sd_is_target_greedy(target, draft, gamma)
    assert 1.0 <= sd.stats.tau <= gamma + 1


@pytest.mark.parametrize("context", [1, 3, 7])
def test_a_draft_that_reads_the_prompts_last_tokens_keeps_the_targets_output(close_pair, context):
    """draft_context: the draft reads each left-padded prompt's last tokens alone (the target all of it); greedy SD is
    still the target's greedy text, and the draft, knowing less, agrees less often than with the whole prompt; a
    context of no tokens is refused."""
    target, draft = close_pair
    ids, mask = left_padded_prompts()
    whole = speculative_generate(target, draft, ids, gamma=3, max_new_tokens=24, temperature=0, attention_mask=mask)
    cut = speculative_generate(
        target, draft, ids, gamma=3, max_new_tokens=24, temperature=0, attention_mask=mask, draft_context=context
    )
    assert torch.equal(cut.sequences, whole.sequences)
    if context == 1:
        assert cut.stats.alpha < whole.stats.alpha
    with pytest.raises(
        DistillSpecError, match="draft_context must be a positive number of tokens, auto or None, not 0"
    ):
        speculative_generate(target, draft, ids, gamma=3, max_new_tokens=4, draft_context=0)


def test_draft_context_auto_reads_a_cpus_long_prompts_last_tokens(close_pair, monkeypatch):
    """draft_context="auto": on a CPU the draft reads a prompt's last max(512, 5 x max_new_tokens) tokens (shorter
    prompts whole), elsewhere all of it; the output stays the target's."""
    from distillspec.decoding import speculative
    from distillspec.decoding.speculative import AUTO_CONTEXT_MIN, AUTO_CONTEXT_PER_TOKEN, auto_draft_context

    target, draft = close_pair
    assert auto_draft_context(draft, 24) == AUTO_CONTEXT_MIN
    assert auto_draft_context(draft, [24, 200]) == AUTO_CONTEXT_PER_TOKEN * 200
    monkeypatch.setattr(type(draft), "device", property(lambda self: torch.device("cuda")), raising=False)
    assert auto_draft_context(draft, 24) is None
    monkeypatch.undo()
    monkeypatch.setattr(speculative, "AUTO_CONTEXT_MIN", 3)
    monkeypatch.setattr(speculative, "AUTO_CONTEXT_PER_TOKEN", 0)
    ids, mask = left_padded_prompts()
    read = []  # the widest call of the draft, per speculative call: its reading of the prompt and a first token
    step = speculative.CachedLM.step

    def counted(lm, tokens, *args, **kwargs):
        if lm.model is draft:
            read[-1] = max(read[-1], tokens.shape[1])
        return step(lm, tokens, *args, **kwargs)

    monkeypatch.setattr(speculative.CachedLM, "step", counted)
    kw = dict(gamma=3, max_new_tokens=24, temperature=0, attention_mask=mask)
    outs = []
    for context in ("auto", 3, None):
        read.append(0)
        outs.append(speculative_generate(target, draft, ids, draft_context=context, **kw))
    assert read == [3 + 1, 3 + 1, ids.shape[1] + 1]
    assert torch.equal(outs[0].sequences, outs[2].sequences) and outs[0].stats.alpha == outs[1].stats.alpha


def test_plain_decoding_equals_hf_generate(close_pair):
    target, _ = close_pair
    ids, mask = left_padded_prompts()
    ours = autoregressive_generate(target, ids, max_new_tokens=16, temperature=0, attention_mask=mask)
    hf = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.sequences, hf)


def test_identical_draft_is_always_accepted(close_pair):
    target, _ = close_pair
    ids, mask = left_padded_prompts()
    out = speculative_generate(
        target,
        target,
        ids,
        gamma=4,
        max_new_tokens=30,
        temperature=1.0,
        attention_mask=mask,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.stats.alpha == pytest.approx(1.0)
    assert out.stats.tau == pytest.approx(5.0)


def test_eos_stops_each_row_and_pads_after(close_pair):
    target, draft = close_pair
    ids, mask = left_padded_prompts()
    free = speculative_generate(target, draft, ids, gamma=3, max_new_tokens=20, temperature=0, attention_mask=mask)
    eos = int(free.sequences[1, 7 + 4])  # row 1 emits it as its 5th new token
    out = speculative_generate(
        target,
        draft,
        ids,
        gamma=3,
        max_new_tokens=20,
        temperature=0,
        attention_mask=mask,
        eos_token_id=eos,
        pad_token_id=63,
    )
    new = out.sequences[:, 7:]
    for row, n in enumerate(out.num_new_tokens.tolist()):
        assert n <= 20
        assert (new[row, n:] == 63).all()
        hits = (new[row, :n] == eos).nonzero()
        if n < 20:
            assert len(hits) == 1 and int(hits[0]) == n - 1  # stopped right after its first EOS
    assert out.num_new_tokens[1] <= 5


def test_lossy_raises_acceptance_and_epsilon_one_is_lossless(small_vocab_pair):
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3]]).repeat(2000, 1)

    def run(**kw):
        return speculative_generate(
            target,
            draft,
            prompt,
            gamma=3,
            max_new_tokens=4,
            temperature=1.0,
            generator=torch.Generator().manual_seed(0),
            **kw,
        )

    lossless = run()
    assert torch.equal(run(lenience="lin", epsilon=1.0).sequences, lossless.sequences)
    for lenience in ("lin", "sq", "exp"):
        assert run(lenience=lenience, epsilon=0.2).stats.alpha > lossless.stats.alpha + 0.05


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gamma": 0}, "gamma"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"epsilon": 0.0, "lenience": "lin"}, "epsilon"),
        ({"epsilon": 1.5}, "epsilon"),
        ({"lenience": "cubic"}, "lenience"),
    ],
)
def test_bad_arguments(close_pair, kwargs, match):
    target, draft = close_pair
    args = {"gamma": 3, "max_new_tokens": 4, **kwargs}
    with pytest.raises(DistillSpecError, match=match):
        speculative_generate(target, draft, torch.tensor([[1, 2]]), **args)


def test_vocab_mismatch_is_refused():
    target = tiny_llama(64)
    cfg = LlamaConfig(
        vocab_size=65,
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    with pytest.raises(DistillSpecError, match="vocab 65 != target vocab 64"):
        speculative_generate(target, LlamaForCausalLM(cfg), torch.tensor([[1, 2]]), gamma=2, max_new_tokens=2)


def test_one_token_prompt(close_pair):
    """With nothing to prefill, both caches start empty."""
    target, draft = close_pair
    ids = torch.tensor([[5], [9]])
    sd = speculative_generate(target, draft, ids, gamma=3, max_new_tokens=12, temperature=0)
    assert torch.equal(sd.sequences, target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("speculative", [True, False])
def test_per_row_budgets_and_streaming_callback(close_pair, speculative):
    """Each row stops at its own max_new_tokens; the callback sees tokens grow block by block, as returned;
    returning True from it stops the batch early."""
    target, draft = close_pair
    ids, mask = left_padded_prompts()
    limits = [3, 9, 1, 17, 12]
    seen = []

    def on_block(tokens, counts, scores):
        seen.append(counts.clone())

    def run(**kw):
        common = dict(max_new_tokens=limits, temperature=0, attention_mask=mask, **kw)
        if speculative:
            return speculative_generate(target, draft, ids, gamma=3, **common)
        return autoregressive_generate(target, ids, **common)

    out = run(on_block=on_block)
    assert out.num_new_tokens.tolist() == limits
    full = speculative_generate(target, draft, ids, gamma=3, max_new_tokens=17, temperature=0, attention_mask=mask)
    for row, n in enumerate(limits):  # a budget truncates the same greedy output
        assert torch.equal(out.sequences[row, 7 : 7 + n], full.sequences[row, 7 : 7 + n])
    assert len(seen) > 1 and all((b >= a).all() for a, b in zip(seen, seen[1:], strict=False))
    assert (seen[-1] <= out.num_new_tokens).all()
    stopped = run(on_block=lambda tokens, counts, scores: bool(counts[3] >= 4))
    assert 4 <= int(stopped.num_new_tokens[3]) < 17


@pytest.mark.parametrize("speculative", [True, False])
def test_eos_and_padding_default_from_the_generation_config(close_pair, speculative):
    """As ``generate`` does: with no ``eos_token_id``/``pad_token_id`` the decoders take the target's
    ``generation_config`` (one EOS id or a list of them)."""
    target, draft = copy.deepcopy(close_pair[0]), close_pair[1]
    ids, mask = left_padded_prompts()

    def decode(**kw):
        if speculative:
            return speculative_generate(target, draft, ids, gamma=3, max_new_tokens=20, temperature=0, **kw)
        return autoregressive_generate(target, ids, max_new_tokens=20, temperature=0, **kw)

    target.generation_config.eos_token_id, target.generation_config.pad_token_id = None, None
    free = decode(attention_mask=mask)
    assert (free.num_new_tokens == 20).all()
    eos = int(free.sequences[1, 7 + 4])
    explicit = decode(attention_mask=mask, eos_token_id=[eos, 99], pad_token_id=63)
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = [eos, 99], 63
    default = decode(attention_mask=mask)
    assert int(default.num_new_tokens[1]) <= 5
    assert torch.equal(default.sequences, explicit.sequences)
    assert torch.equal(default.num_new_tokens, explicit.num_new_tokens)


class Cycle:
    """A gamma schedule that drafts the given numbers of tokens in turn and records what it was told."""

    def __init__(self, gammas: list[int]) -> None:
        self.gammas, self.i, self.seen, self.timed, self.explore, self.left = gammas, 0, [], [], [], []

    def choose(self, batch: int, explore: bool = True, left: list[int] | None = None) -> int:
        assert left is not None and len(left) == batch and min(left) >= 1
        self.explore.append(explore)
        self.left.append(left)
        self.i += 1
        return self.gammas[(self.i - 1) % len(self.gammas)]

    def observe(self, batch, gamma, draft_s, verify_s, accepted, judged, tokens) -> None:
        self.seen.append((batch, gamma, accepted, judged, tokens))
        self.timed.append(draft_s is not None)
        assert (draft_s is None) == (verify_s is None)
        assert draft_s is None or (draft_s >= 0 and verify_s > 0)
        assert len(accepted) == len(judged) == gamma  # by draft position: every row judges its first draft
        assert all(0 <= a <= j <= batch for a, j in zip(accepted, judged, strict=True)) and judged[:1] in ([], [batch])
        assert all(judged[i + 1] <= accepted[i] for i in range(gamma - 1))  # judged only after the one before passed


def test_steps_on_one_cpu_thread_are_timed_by_the_work_they_do():
    """Gamma chosen live times a block's steps by the calling thread's CPU time when torch runs one thread on a CPU:
    time the thread spends waiting (another process holding the core; here, a sleep) is not a step's cost."""
    import time

    from distillspec.decoding.speculative import step_clock

    cpu, x, threads = torch.device("cpu"), torch.randn(256, 256), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = step_clock(cpu)
        time.sleep(0.3)
        waiting = step_clock(cpu) - start
        start, wall = step_clock(cpu), time.perf_counter()
        while time.perf_counter() - wall < 0.3:
            x @ x
        working = step_clock(cpu) - start
    finally:
        torch.set_num_threads(threads)
    assert waiting < 0.05 < working


def test_gamma_per_block_stays_exact_greedy(close_pair):
    """Blocks of 0 to 3 drafts in turn (0: the target alone; the draft catches up at its next block)."""
    target, draft = close_pair
    ids, mask = left_padded_prompts()
    schedule = Cycle([0, 0, 3, 1, 0, 2])
    sd = speculative_generate(
        target, draft, ids, gamma=3, max_new_tokens=24, temperature=0, attention_mask=mask, schedule=schedule
    )
    own = autoregressive_generate(target, ids, max_new_tokens=24, temperature=0, attention_mask=mask)
    assert torch.equal(sd.sequences, own.sequences)
    assert sd.stats.gammas == [schedule.gammas[i % 6] for i in range(len(sd.stats.gammas))]
    assert int(sd.stats.drafted.sum()) == sum(b * g for b, g, *_ in schedule.seen)
    assert int(sd.stats.accepted.sum()) == sum(sum(a) for _, _, a, _, _ in schedule.seen) > 0
    # The first token comes from the prompt's logits, before the schedule chooses; costs of a shape come from every
    # block it chose but the third (the draft reads the prompt), each a target call.
    assert schedule.timed[:4] == [True, True, False, True] and all(schedule.timed[4:])
    assert schedule.explore[:4] == [False, False, False, True] and all(schedule.explore[3:])  # once the draft has read
    assert sd.stats.target_calls == len(sd.stats.gammas) == int(sd.stats.blocks.max())


def test_the_first_token_comes_from_the_prompt_alone(close_pair):
    """As the target alone's: the first block emits one token, from the target's prefill, before the draft runs or
    the target is called again; the stats count target calls (blocks) after it."""
    target, draft = close_pair
    ids, mask = left_padded_prompts()
    calls = {"draft": 0}
    hook = draft.register_forward_hook(lambda *_: calls.__setitem__("draft", calls["draft"] + 1))
    seen = []
    try:
        sd = speculative_generate(
            target, draft, ids, gamma=3, max_new_tokens=10, temperature=0, attention_mask=mask,
            on_block=lambda tokens, counts, scores: seen.append((counts.clone(), calls["draft"])),
        )  # fmt: skip
    finally:
        hook.remove()
    assert seen[0][0].tolist() == [1] * len(ids) and seen[0][1] == 0
    stats = sd.stats
    assert (stats.new_tokens <= stats.blocks + stats.accepted.sum(1) + 1).all()  # the last block may overshoot
    assert stats.target_calls == len(stats.gammas) and set(stats.gammas) == {3}
    one = speculative_generate(target, draft, ids, gamma=3, max_new_tokens=1, temperature=0, attention_mask=mask)
    assert one.stats.target_calls == one.stats.draft_calls == 0 and one.num_new_tokens.tolist() == [1] * len(ids)


def test_rows_leave_before_the_draft_has_read_anything(close_pair):
    """Blocks without drafts first, and rows whose budgets end during them: they leave the batch while the draft's
    cache is still empty; the rest decode on, drafting later, to the target's own tokens."""
    target, draft = close_pair
    ids, mask = left_padded_prompts()
    budgets = [1, 3, 9, 2, 7]
    schedule = Cycle([0, 0, 0, 2])
    sd = speculative_generate(
        target, draft, ids, gamma=2, max_new_tokens=budgets, temperature=0, attention_mask=mask, schedule=schedule
    )
    own = autoregressive_generate(target, ids, max_new_tokens=budgets, temperature=0, attention_mask=mask)
    assert torch.equal(sd.sequences, own.sequences) and sd.num_new_tokens.tolist() == budgets
    # The first token comes before the schedule chooses: the row of budget 1 has left by then.
    assert [b for b, *_ in schedule.seen][:3] == [4, 3, 2] and int(sd.stats.drafted.sum()) > 0
    assert schedule.left[:3] == [[2, 8, 1, 6], [1, 7, 5], [6, 4]]  # the schedule is told what each row has left


@pytest.mark.parametrize("gammas", [[0, 2], [2, 0], [1, 0, 3]])
def test_gamma_per_block_samples_follow_target_distribution(small_vocab_pair, gammas):
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3]])
    n = 12_000
    out = speculative_generate(
        target,
        draft,
        prompt.repeat(n, 1),
        gamma=3,
        max_new_tokens=2,
        temperature=1.0,
        generator=torch.Generator().manual_seed(len(gammas)),
        schedule=Cycle(gammas),
    )
    assert fit_to_target(out, target, prompt) > 1e-3


def test_the_drafting_step_alone(small_vocab_pair):
    """Greedy drafts are the draft's own greedy continuation; sampled drafts come with their distributions q."""
    from distillspec.decoding.kvcache import CachedLM
    from distillspec.decoding.speculative import draft_tokens

    _, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def fresh() -> CachedLM:
        lm = CachedLM(draft)
        lm.mask, lm.next_pos = prompt.new_zeros(2, 0), prompt.new_zeros(2)  # nothing read yet
        return lm

    drafts, q = draft_tokens(fresh(), prompt, torch.ones_like(prompt), 4, 0.0)
    greedy = autoregressive_generate(draft, prompt, max_new_tokens=4, temperature=0.0, eos_token_id=[])
    assert q is None and torch.equal(drafts, greedy.sequences[:, 3:])
    drafts, q = draft_tokens(fresh(), prompt, torch.ones_like(prompt), 3, 1.0, torch.Generator().manual_seed(0))
    assert drafts.shape == (2, 3) and q.shape == (2, 3, V)
    assert torch.allclose(q.sum(-1), torch.ones(2, 3)) and bool((q.gather(-1, drafts[..., None]) > 0).all())
    none, q = draft_tokens(fresh(), prompt, torch.ones_like(prompt), 0, 1.0)
    assert none.shape == (2, 0) and q is None


def test_the_verify_step_alone():
    """Greedy: accept while the argmaxes agree, then the target's argmax. Sampled: a draft q equal to p is always
    accepted (the bonus token comes after); a draft token p gives no mass is rejected and replaced from p - q."""
    from distillspec.decoding.speculative import verify

    logits = torch.tensor([[[0.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])  # argmaxes 1, 0, 2
    n, new = verify(logits, torch.tensor([[1, 2]]), None, 0.0)
    assert n.tolist() == [1] and new.tolist() == [0]
    p = torch.softmax(logits, -1)
    n, new = verify(logits, torch.tensor([[1, 0]]), p[:, :2], 1.0, generator=torch.Generator().manual_seed(0))
    assert n.tolist() == [2]
    blocked = logits.clone()
    blocked[0, 0, 1] = -float("inf")  # the target never emits token 1 first
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    for seed in range(20):
        n, new = verify(blocked[:, :2], torch.tensor([[1]]), q, 1.0, generator=torch.Generator().manual_seed(seed))
        assert n.tolist() == [0] and new.item() != 1


def test_sampling_follows_the_probabilities_and_never_draws_a_token_of_no_mass():
    """The unseeded sampler (inverse transform over the float64 cumulative mass): frequencies match the
    probabilities, unnormalised rows included; tokens of mass 0 (first, last and between) are never drawn; any
    leading shape; one generator seed gives one draw."""
    from scipy.stats import chisquare

    from distillspec.decoding.speculative import sample

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    rows = torch.stack([probs, probs * 3]).repeat(20_000, 1).view(20_000, 2, 6)  # [20000, 2, V], one row unnormalised
    drawn = sample(rows, torch.Generator().manual_seed(0))
    assert drawn.shape == (20_000, 2)
    counts = torch.bincount(drawn.flatten(), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    kept = probs > 0
    assert chisquare(counts[kept].numpy(), (probs[kept] * drawn.numel()).numpy()).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 0.0, 1.0])).item() == 2
    again = [sample(rows[:50], torch.Generator().manual_seed(7)).tolist() for _ in range(2)]
    assert again[0] == again[1]


class _RandomGammas:
    """A gamma schedule that drafts 0 to 4 tokens per block at random (a stand-in for gamma=auto)."""

    def __init__(self, seed: int) -> None:
        self.rng = torch.Generator().manual_seed(seed)

    def choose(self, batch, explore=True, left=None) -> int:
        return int(torch.randint(0, 5, (1,), generator=self.rng))

    def observe(self, *args) -> None:
        pass


def test_a_seed_gives_one_text_whatever_the_gamma_the_schedule_or_the_batch():
    """Seeded rows (random numbers keyed by seed and position, blocks verified by coupling): the target alone, SD at
    gamma 1, 3 and 5, a random gamma per block, the rows reordered or alone, all emit the same tokens."""
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=3.0)
    draft = perturbed(target, 0.3)
    ids, mask = left_padded_prompts()
    seeds = [11, 12, 13, 14, 15]
    kw = dict(max_new_tokens=20, temperature=1.0, attention_mask=mask, seeds=seeds)
    reference = autoregressive_generate(target, ids, **kw).sequences
    runs = [speculative_generate(target, draft, ids, gamma=g, **kw) for g in (1, 3, 5)]
    runs.append(speculative_generate(target, draft, ids, gamma=4, schedule=_RandomGammas(0), **kw))
    for out in runs:
        assert torch.equal(out.sequences, reference)
    assert 0.0 < runs[1].stats.alpha < 1.0
    order = [3, 0, 4, 1, 2]
    shuffled = speculative_generate(
        target,
        draft,
        ids[order],
        gamma=3,
        max_new_tokens=20,
        attention_mask=mask[order],
        seeds=[seeds[i] for i in order],
    )
    assert torch.equal(shuffled.sequences, reference[order])
    alone = speculative_generate(target, draft, ids[4:5], gamma=2, max_new_tokens=20, seeds=[15])
    assert torch.equal(alone.sequences[0], reference[4])  # row 4 has no padding; every row emits 20 tokens
    other = autoregressive_generate(target, ids, **(kw | {"seeds": [s + 100 for s in seeds]})).sequences
    assert not torch.equal(other, reference)  # another seed, another sample


def test_seeded_sd_follows_the_target_distribution(small_vocab_pair):
    """Chi-square over 12,000 two-token samples, one seed per row, verified by coupling."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 2, 3]])
    out = speculative_generate(
        target, draft, prompt.repeat(12_000, 1), gamma=3, max_new_tokens=2, temperature=1.0, seeds=range(12_000)
    )
    assert 0.0 < out.stats.alpha < 1.0
    assert fit_to_target(out, target, prompt) > 1e-3


def test_a_seeded_rows_draws_are_made_once_per_position(monkeypatch):
    """A block's drafts that were not accepted are drafted again at the same positions with the same draws, kept
    from the block before, not drawn anew: one draw per row and position over a call (the draws that speculative
    decoding at T > 0 costs with seeds), and each is Exp(1)."""
    from distillspec.decoding.speculative import SeededNoise

    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=3.0)
    draft = perturbed(target, 0.3)
    ids, mask = left_padded_prompts()
    made = []
    draw = SeededNoise.draw
    monkeypatch.setattr(SeededNoise, "draw", lambda self, seed, t: made.append((seed, t)) or draw(self, seed, t))
    out = speculative_generate(
        target, draft, ids, gamma=5, max_new_tokens=20, temperature=1.0, attention_mask=mask, seeds=range(len(ids))
    )
    assert out.stats.rejected.sum() > 0  # blocks drafted positions again
    assert len(made) == len(set(made))  # (the last block's may reach past the budget)
    assert {t for _, t in made} >= set(range(20)) and max(t for _, t in made) < 20 + 5 + 1
    noise = SeededNoise([7], 50_000)
    again = noise.draws(torch.tensor([0]), torch.tensor([[3, 4, 5]]))
    assert torch.equal(noise.draws(torch.tensor([0]), torch.tensor([[4, 5]])), again[:, 1:])
    assert torch.equal(again[0, 0], SeededNoise([7], 50_000).draw(7, 3))
    assert abs(float(again.double().mean()) - 1) < 0.02 and float(again.min()) >= 0


def test_seeds_are_lossless_only(small_vocab_pair):
    target, draft = small_vocab_pair
    with pytest.raises(DistillSpecError, match="lossless only"):
        speculative_generate(target, draft, torch.tensor([[1, 2]]), gamma=2, max_new_tokens=2, lenience="lin",
                             epsilon=0.5, seeds=[1])  # fmt: skip


@pytest.mark.parametrize("speculative", [True, False])
def test_logprobs_are_the_targets_own(close_pair, speculative):
    """The scores of the new tokens and of the prompt's are the target's log-softmax over the whole sequence (one
    forward pass), the top-k its k likeliest, whatever was drafted, accepted or processed."""
    from distillspec.decoding.sampling import SamplingControls

    target, draft = close_pair
    ids, mask = left_padded_prompts()
    kw = dict(max_new_tokens=10, temperature=1.0, attention_mask=mask, generator=torch.Generator().manual_seed(0))
    kw |= dict(logprobs=3, prompt_logprobs=True, controls=SamplingControls(top_k=5, presence_penalty=1.0))
    out = (
        speculative_generate(target, draft, ids, gamma=3, **kw)
        if speculative
        else autoregressive_generate(target, ids, **kw)
    )
    seq = out.sequences
    full = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1] :])], 1)
    with torch.no_grad():
        logits = target(seq, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits
    expected = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, seq[:, 1:, None]).squeeze(-1)
    p = ids.shape[1]
    for row in range(len(ids)):
        n = int(out.num_new_tokens[row])
        torch.testing.assert_close(out.logprobs.token[row, :n], expected[row, p - 1 : p - 1 + n], atol=1e-4, rtol=0)
        real = int(mask[row].sum())  # the prompt's real columns, after its first
        torch.testing.assert_close(out.prompt_logprobs.token[row, p - real :], expected[row, p - real : p - 1])
    top = torch.log_softmax(logits.float(), -1)[:, p - 1].topk(3)
    torch.testing.assert_close(out.logprobs.top[:, 0], top.values, atol=1e-4, rtol=0)
    assert torch.equal(out.logprobs.top_ids[:, 0], top.indices)
