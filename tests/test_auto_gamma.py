"""Gamma chosen live (gamma="auto"): the expected-tokens formula, the cost model, the choice, and the Completer."""

import random

import pytest

from distillspec.decoding.auto_gamma import AutoGamma, StepCosts, StepGamma, acceptance_by_position, expected_tokens
from distillspec.serving.completer import Completer, CompletionJob, DecodingArgs

from .conftest import greedy_text

KEY = (-1, 1.0, None, 1.0)  # draft version, temperature, lenience, epsilon


def test_expected_tokens_per_block():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens([0.5] * 7, 3) == pytest.approx(1.875)  # by position: the same where all are alike
    assert expected_tokens([0.5, 1.0, 1.0, 0.0], 4) == pytest.approx(1 + 0.5 * 3)  # past the 1st, all or none


def test_acceptance_by_position_judges_each_row_up_to_its_first_rejection():
    accepted, judged = acceptance_by_position([3, 3, 3, 1], [0, 1, 3, 1])
    assert judged == [4, 2, 1] and accepted == [3, 1, 1]
    assert acceptance_by_position([0, 0], [0, 0]) == ([], [])


def iid(alpha: float, rows: float, gamma: int) -> tuple[list[float], list[float]]:
    """Draft tokens accepted and judged by position when ``rows`` rows draft ``gamma`` at i.i.d. rate ``alpha`` (the
    expected counts)."""
    return [rows * alpha ** (i + 1) for i in range(gamma)], [rows * alpha**i for i in range(gamma)]


def test_step_costs_own_average_where_measured_and_a_line_in_tokens_elsewhere():
    costs = StepCosts(trust=2)
    assert costs.predict(1, 1) is None
    costs.observe(2, 3, 0.5)
    assert costs.predict(16, 8) == 0.5  # one size measured: flat
    costs, line = StepCosts(trust=2), lambda rows, positions: 0.01 + 0.002 * rows * positions
    for rows, positions in [(1, 2), (4, 2), (8, 4), (2, 3)]:
        costs.observe(rows, positions, line(rows, positions))
    assert costs.predict(16, 8) == pytest.approx(line(16, 8))
    for _ in range(3):
        costs.observe(1, 1, 0.2)  # measured often: its own average, not the line
    assert costs.predict(1, 1) == pytest.approx(0.2)


def test_a_shape_cost_shrugs_off_a_spike_and_follows_a_change_of_speed():
    costs = StepCosts(trust=3)
    costs.observe(4, 2, 0.5)  # a shape's slow first run
    for _ in range(3):
        costs.observe(4, 2, 0.01)
    assert costs.predict(4, 2) == pytest.approx(0.01)
    for _ in range(20):
        costs.observe(4, 2, 0.01)
    costs.observe(4, 2, 0.3)  # other work on the machine during one step
    assert costs.predict(4, 2) == pytest.approx(0.01)
    for _ in range(4):
        costs.observe(4, 2, 0.02)  # the machine got slower
    assert costs.predict(4, 2) == pytest.approx(0.02)
    assert costs.table() == {"4x2": 20.0}


def test_one_slow_block_does_not_turn_the_choice():
    auto = AutoGamma(7, explore_every=10**9, prior_weight=1.0)
    feed(auto, 0.3, [16], blocks=8)
    before = auto.choose(KEY, 16)
    assert before == best_by_hand(0.3, 16, 7)
    verify = 0.010 + 0.0005 * 16 * (before + 1)
    auto.observe(KEY, 16, before, 0.001 * before, 10 * verify, *iid(0.3, 100, before), 16)
    assert auto.choose(KEY, 16) == before


def feed(auto: AutoGamma, alpha: float, batches: list[int], blocks: int = 4) -> None:
    """Blocks at every gamma and batch size: a draft step 1 ms, a verify 10 ms + 0.5 ms per token, acceptance alpha."""
    for batch in batches:
        for gamma in range(auto.max_gamma + 1):
            for _ in range(blocks):
                verify = 0.010 + 0.0005 * batch * (gamma + 1)
                auto.observe(KEY, batch, gamma, 0.001 * gamma, verify, *iid(alpha, 100, gamma), batch)


def best_by_hand(alpha: float, batch: int, max_gamma: int) -> int:
    rate = lambda g: batch * expected_tokens(alpha, g) / (0.001 * g + 0.010 + 0.0005 * batch * (g + 1))
    return max(range(max_gamma + 1), key=rate)


def test_the_choice_maximises_expected_tokens_per_second():
    auto = AutoGamma(7, explore_every=10**9, prior_weight=1.0)
    assert auto.choose(KEY, 1) == 5  # nothing measured yet: the start gamma
    feed(auto, 0.9, [1, 16])
    assert auto.alpha(KEY) == pytest.approx(0.9, abs=0.01)
    assert auto.choose(KEY, 1) == best_by_hand(0.9, 1, 7) == 7  # cheap verification: draft the most
    assert auto.choose(KEY, 16) == best_by_hand(0.9, 16, 7) < 7  # a verify step that grows with the batch
    feed(auto, 0.05, [1, 16], blocks=200)  # the draft got worse: alpha follows, speculation stops
    assert auto.alpha(KEY) == pytest.approx(0.05, abs=0.02)
    assert auto.choose(KEY, 16) == 0
    auto.explore_every = 1  # every block a candidate for exploring, but gamma 1 is a clear loser here: not tried
    assert [auto.choose(KEY, 16) for _ in range(4)] == [0, 0, 0, 0]
    plan = auto.plan(KEY, 16)
    assert plan.gamma == 0 and plan.tokens_per_s[0] == max(plan.tokens_per_s.values())


def test_a_new_version_is_drafted_for_until_it_was_measured():
    """Where the plan would not speculate (alpha 0.05), a new draft version is still drafted for, one token a block,
    until 128 of its draft tokens were judged (16 rows a block: 8 blocks): the choice never gives up on a version it
    has not measured, and a replica's rollback gets draft tokens to judge it on."""
    auto = AutoGamma(7, explore_every=10**9, prior_weight=1.0)
    feed(auto, 0.05, [16], blocks=200)
    assert auto.choose(KEY, 16) == 0
    new = (2, *KEY[1:])
    chosen = []
    for _ in range(12):
        chosen.append(g := auto.choose(new, 16))
        auto.observe(new, 16, g, 0.001 * g, 0.010 + 0.0005 * 16 * (g + 1), *iid(0.05, 16, g), 16)
    assert chosen == [1] * 8 + [0] * 4
    assert auto.choose((3, *KEY[1:]), 16, explore=False) == 0  # a block that must not explore does not probe either


def test_rows_near_their_budget_are_not_drafted_past_it():
    """A row with r tokens left emits at most r: drafts past its (r - 1)th cost a longer verify and add nothing."""
    auto = AutoGamma(7, explore_every=10**9, prior_weight=1.0)
    feed(auto, 0.9, [4])
    assert auto.choose(KEY, 4) == auto.choose(KEY, 4, left=[64] * 4) == best_by_hand(0.9, 4, 7) > 2
    assert auto.choose(KEY, 4, left=[3, 3, 2, 1]) == 2  # the longest row has 3 left: 2 drafts and its next token
    assert auto.choose(KEY, 4, left=[1] * 4) == 0  # one token each: plain decoding
    plan = auto.plan(KEY, 4, left=[2, 2, 2, 2])
    assert plan.tokens_per_s[1] == pytest.approx(4 * expected_tokens(auto.alpha(KEY), 1) / (0.001 + 0.010 + 0.0005 * 8))
    assert plan.tokens_per_s[7] < plan.tokens_per_s[1]  # the same two tokens, at a longer block's cost


def simulated_tokens_per_s(
    gamma: int | str, alpha: float | tuple[float, float], batch: int, seed: int, calls: int = 40, **kwargs
) -> float:
    """A replica on a simulated machine: calls of ``batch`` rows of 64 tokens each, i.i.d. acceptance ``alpha`` (a
    pair: streaks, each row's block easy or hard with even odds, its drafts accepted at the first or second rate), a
    draft step 1.2 ms + 0.06 ms per row and a verify step 8 ms + 0.4 ms per token, each timing off by a lognormal
    15%; rows leave as they end. Tokens per simulated second at a fixed gamma or with gamma chosen live
    (``kwargs``: :class:`AutoGamma`'s)."""
    rng, auto, clock, tokens = random.Random(seed), AutoGamma(7, **kwargs), 0.0, 0
    rates = alpha if isinstance(alpha, tuple) else (alpha, alpha)
    for _ in range(calls):
        left = [64] * batch
        while left:
            b = len(left)
            g = auto.choose(KEY, b, left=left) if gamma == "auto" else gamma
            draft_s = sum((0.0012 + 0.00006 * b) * rng.lognormvariate(0, 0.15) for _ in range(g))
            verify_s = (0.008 + 0.0004 * b * (g + 1)) * rng.lognormvariate(0, 0.15)
            row_rates = [rates[rng.random() < 0.5] for _ in left]
            accepted = [next((k for k in range(g) if rng.random() >= a), g) for a in row_rates]
            emitted = [min(n + 1, r) for n, r in zip(accepted, left, strict=True)]
            by_position = acceptance_by_position([g] * b, accepted)
            auto.observe(KEY, b, g, draft_s, verify_s, *by_position, sum(emitted), gamma == "auto")
            clock, tokens = clock + draft_s + verify_s, tokens + sum(emitted)
            left = [r - e for r, e in zip(left, emitted, strict=True) if r > e]
    return tokens / clock


@pytest.mark.parametrize(("alpha", "batch"), [(0.6, 1), (0.6, 16), (0.9, 1), (0.9, 16)])
def test_gamma_chosen_live_keeps_up_with_the_best_fixed_gamma_on_a_simulated_replica(alpha, batch):
    """No machine noise: the choice itself, learning costs and alpha from its own blocks from nothing, within 5% of
    the best fixed gamma in hindsight (rows that end at different blocks cost it a little: they are not planned)."""
    seeds = range(3)
    fixed = {g: sum(simulated_tokens_per_s(g, alpha, batch, seed) for seed in seeds) for g in range(8)}
    auto = sum(simulated_tokens_per_s("auto", alpha, batch, seed) for seed in seeds)
    assert auto >= 0.95 * max(fixed.values()), (auto / max(fixed.values()), max(fixed, key=fixed.get))


def test_acceptance_in_streaks_is_planned_by_draft_position():
    """A draft that either follows the target through a stretch (0.95) or loses it at once (0.1): a block that gets
    past its first draft token is likely an easy one, so later positions are accepted far more often than the pooled
    alpha says. Planned by position, gamma chosen live keeps up with the best fixed gamma (7) at batch 1; planned on
    the pooled alpha alone (the shape weighed as nothing) it drafts too little."""
    seeds, streaks = range(3), (0.95, 0.1)
    best = max(sum(simulated_tokens_per_s(g, streaks, 1, seed) for seed in seeds) for g in range(8))
    by_position = sum(simulated_tokens_per_s("auto", streaks, 1, seed) for seed in seeds)
    pooled = sum(simulated_tokens_per_s("auto", streaks, 1, seed, shape_weight=1e12) for seed in seeds)
    assert by_position >= 0.98 * best and pooled < 0.96 * best, (by_position / best, pooled / best)
    auto, rng = AutoGamma(7), random.Random(0)
    for _ in range(400):  # the true rates: a_1 = 0.525, a_2 = (0.95^2 + 0.1^2) / (0.95 + 0.1) = 0.87, ...
        n = [next((k for k in range(7) if rng.random() >= a), 7) for a in rng.choices(streaks, k=4)]
        auto.count(KEY, *acceptance_by_position([7] * 4, n))
    easy, hard = streaks
    true = [(easy ** (i + 1) + hard ** (i + 1)) / (easy**i + hard**i) for i in range(7)]
    assert auto.rates(KEY) == pytest.approx(true, abs=0.08)
    assert auto.summary()["alpha_by_position"]["T=1"] == pytest.approx(true, abs=0.08)


def test_a_new_version_starts_from_its_canary_alpha_and_neighbours_are_explored():
    auto = AutoGamma(7, explore_every=2)
    auto.start_version(3, 0.8)
    assert auto.alpha((3, 1.0, None, 1.0)) == pytest.approx(0.8)
    assert auto.alpha((4, 1.0, None, 1.0)) == pytest.approx(0.8)  # no canary alpha: the version before it's
    assert auto.alpha((4, 0.5, None, 1.0)) == pytest.approx(auto.prior_alpha)  # nothing seen at these settings
    feed(auto, 0.9, [1])
    chosen = [auto.choose(KEY, 1) for _ in range(6)]
    assert chosen.count(7) == 3 and chosen.count(6) == 3  # every second block a neighbour of the best
    summary = auto.summary()
    assert summary["chosen"] == {"6": 3, "7": 3}
    assert summary["step_ms"]["verify"]["1x8"] == pytest.approx(10.0 + 0.5 * 8) and summary["step_ms"]["draft"] == {
        "1x1": 1.0
    }
    assert [auto.choose(KEY, 1, explore=False) for _ in range(4)] == [7] * 4  # the draft has yet to read the prompt
    auto.forget({3})
    assert set(auto.counts) == {(3, 1.0, None, 1.0)}


def test_a_cost_measured_under_other_load_is_measured_again():
    """Other work on the machine slows the verify step of gamma 6 three-fold while it is measured; once the load
    is gone, gamma 6 (then a clear loser on its stale cost) must be tried and measured again, not written off."""
    auto = AutoGamma(7, explore_every=10, prior_weight=1.0)
    feed(auto, 0.9, [1])
    assert best_by_hand(0.9, 1, 7) == 7
    normal = lambda g: (0.001 * g, 0.010 + 0.0005 * (g + 1))
    for _ in range(20):  # gamma 6, measured under load
        draft_s, verify_s = normal(6)
        auto.observe(KEY, 1, 6, 3 * draft_s, 3 * verify_s, *iid(0.9, 100, 6), 6)
    assert auto.plan(KEY, 1).tokens_per_s[6] < auto.explore_within * auto.plan(KEY, 1).tokens_per_s[7]
    chosen = []
    for _ in range(400):  # the load is gone: every block runs at the normal speed
        g = auto.choose(KEY, 1)
        chosen.append(g)
        auto.observe(KEY, 1, g, *normal(g), *iid(0.9, 100, g), 1)
    assert 6 in chosen[200:] and chosen.count(7) > 0.8 * len(chosen)
    assert auto.verify_costs.predict(1, 7) == pytest.approx(normal(6)[1], rel=0.2)


def run_engine(live: StepGamma, rows: int, steps: int, alpha: float, clock: list[float]) -> list[int]:
    """Steps of an engine that batches continuously, as vLLM runs them: each step verifies the drafts the step before
    it proposed (each accepted with probability ``alpha``) and drafts the gamma its schedule (``live[rows]``) gives. A
    step costs 10 ms + 0.5 ms per token it verifies + 1 ms per draft token it proposes."""
    chosen, verified, rng = [], 0, random.Random(round(clock[0] * 1e6))
    for _ in range(steps):
        drafted = live[rows]
        chosen.append(drafted)
        n = [next((i for i in range(verified) if rng.random() >= alpha), verified) for _ in range(rows)]
        clock[0] += 0.010 + 0.0005 * rows * (verified + 1) + 0.001 * drafted
        live.step_done(clock[0], rows, [verified] * rows, drafted, n, sum(n) + rows, decoding=True)
        verified = drafted
    return chosen


def test_engine_steps_choose_gamma_by_batch_size_and_follow_a_new_version():
    """vLLM's batch-size schedule, chosen live: a step's cost counts only where it verified and drafted one gamma,
    the choice holds two steps so that every gamma chosen is measured, and it differs by batch size."""
    live, clock = StepGamma(7, explore_every=10), [0.0]
    assert live[1] == 5  # nothing measured yet: the start gamma
    for _ in range(40):  # traffic at batch 1 and 16 in turn
        run_engine(live, 1, 20, 0.9, clock)
        run_engine(live, 16, 20, 0.9, clock)
    assert live.auto.alpha(live.key) == pytest.approx(0.9, abs=0.05)
    costs = live.auto.verify_costs
    assert costs.predict(1, 8) == pytest.approx(0.010 + 0.0005 * 8 + 0.007, rel=0.05)  # a whole step's seconds
    best = lambda rows: max(
        range(8), key=lambda g: rows * expected_tokens(0.9, g) / (0.010 + 0.0005 * rows * (g + 1) + 0.001 * g)
    )
    plan = live.auto.plan(live.key, 1)
    assert plan.gamma == best(1) == 7 and live.auto.plan(live.key, 16).gamma == best(16) < 7
    live.new_version(3, 0.05)  # a version whose canary measured alpha 0.05: no speculation pays
    assert live.key == (3, None, None, 1.0) and live.auto.alpha(live.key) == pytest.approx(0.05)
    chosen = run_engine(live, 16, 20, 0.05, clock)  # measured on 128 draft tokens first, then no speculation
    assert chosen[:8] == [1] * 8 and chosen[-8:] == [0] * 8
    assert "v3" in live.auto.summary()["alpha"]


def test_completer_with_auto_gamma(text_pair, tokenizer):
    target, draft = text_pair
    completer = Completer(target, draft, tokenizer, max_prompt_tokens=16, max_gamma=4)
    args = DecodingArgs(gamma="auto", temperature=0.0)
    prompts = ["12+7=", "3*4=", "100-1="]
    for _ in range(2):  # the second call chooses from what the first measured
        done = completer.complete([CompletionJob(p, 12, args) for p in prompts])
    for prompt, c in zip(prompts, done, strict=True):
        assert c.text == greedy_text(target, tokenizer, prompt, 12)  # exact, whatever gamma each block drafted
        assert c.stats["gamma"] == "auto" and c.stats["drafted"] <= 4 * c.stats["target_calls"]
    summary = completer.auto.summary()
    assert summary["chosen"] and set(summary["chosen"]) <= set("01234")
    assert summary["measured_tokens_per_s"] > 0 and summary["expected_tokens_per_s"] > 0


def test_clients_settings_never_grow_the_statistics_unbounded():
    from distillspec.serving.completer import MAX_SETTINGS, LiveAcceptance

    auto, live = AutoGamma(7), LiveAcceptance(window=16, margin=0.1)
    stats = {"accepted": 3, "rejected": 1}
    for i in range(1000):  # a client that sends a new temperature each time
        auto.alpha((0, i / 1000, None, 1.0))
        live.record(0, stats, DecodingArgs(gamma=3, temperature=i / 1000))
    assert len(auto.counts) <= 256 and len(live.recent) <= MAX_SETTINGS
