"""The endpoint's decoding core, without Ray: batching, budgets, seeds, stop strings, draft swaps, statistics."""

import asyncio
import random
import time

import pytest
import torch

from distillspec import DistillSpecError
from distillspec.serving.completer import (
    Completer,
    CompletionJob,
    DecodingArgs,
    LiveAcceptance,
    RequestBatcher,
    canary_refusal,
    cut_at_stop,
    merge_stats,
    ratio_variance,
)

from .conftest import greedy_text, needs_compiler

PROMPTS = ["12+7=", "3*4=", "100-1=", "9+9+9="]


@pytest.fixture(scope="module")
def completer(text_pair, tokenizer):
    target, draft = text_pair
    return Completer(target, draft, tokenizer, max_prompt_tokens=16)


def test_batched_greedy_equals_the_targets_own(completer, text_pair, tokenizer):
    args = DecodingArgs(gamma=3, temperature=0.0)
    jobs = [CompletionJob(p, n, args) for p, n in zip(PROMPTS, [5, 12, 1, 8], strict=True)]
    done = completer.complete(jobs)
    for job, c in zip(jobs, done, strict=True):
        assert c.text == greedy_text(text_pair[0], tokenizer, job.prompt, job.max_new_tokens)
        assert c.completion_tokens <= job.max_new_tokens
        assert c.stats["gamma"] == 3 and c.stats["drafted"] == 3 * c.stats["target_calls"]
        assert c.version == -1
    off = completer.complete([CompletionJob(p, 12, DecodingArgs(gamma=0, temperature=0.0)) for p in PROMPTS])
    assert [c.text for c in off][1] == done[1].text  # speculation off: the same greedy text
    assert off[0].stats["drafted"] == 0 and off[0].stats["alpha"] is None


def test_a_server_whose_draft_reads_the_prompts_last_tokens_serves_the_targets_greedy_text(text_pair, tokenizer):
    """serve.draft_context: the draft reads each prompt's last 2 tokens alone, and a batch of prompts of unequal
    lengths still gets the target's greedy texts."""
    target, draft = text_pair
    server = Completer(target, draft, tokenizer, max_prompt_tokens=16, draft_context=2)
    args = DecodingArgs(gamma=3, temperature=0.0)
    for c, prompt in zip(server.complete([CompletionJob(p, 10, args) for p in PROMPTS]), PROMPTS, strict=True):
        assert c.text == greedy_text(target, tokenizer, prompt, 10)


def test_a_recorded_completion_is_a_sample_of_the_target_with_its_own_scores(completer, text_pair, tokenizer):
    """A recorded job keeps its tokens with the target's top-k at each (its log-softmax there), whatever the client
    asked for: a client's logprobs keep their own k; a job not recorded keeps nothing."""
    target, _ = text_pair
    args = DecodingArgs(gamma=3, temperature=1.0)
    jobs = [
        CompletionJob(PROMPTS[0], 12, args, seed=5, record=6),
        CompletionJob(PROMPTS[1], 12, args, seed=6, logprobs=2, record=6),
        CompletionJob(PROMPTS[2], 12, args, seed=7),
    ]
    plain, scored, unrecorded = done = completer.complete(jobs)
    assert plain.logprobs is None and unrecorded.sample is None
    assert all(len(top) == 2 for top in scored.logprobs.top)  # the client's k, not the recorded one
    for job, d in zip(jobs[:2], done[:2], strict=False):
        sample = d.sample
        assert sample.temperature == 1.0 and sample.prompt == job.ids(tokenizer)
        assert len(sample.tokens) == d.completion_tokens and sample.top.shape == sample.top_ids.shape == (
            d.completion_tokens,
            6,
        )
        with torch.no_grad():
            logits = target(torch.tensor([sample.prompt + sample.tokens])).logits[0, len(sample.prompt) - 1 : -1]
        top = torch.log_softmax(logits.float(), -1).topk(6, -1)
        torch.testing.assert_close(torch.from_numpy(sample.top), top.values, rtol=1e-4, atol=1e-4)
        assert torch.equal(torch.from_numpy(sample.top_ids), top.indices)
    assert scored.sample.tokens[: len(scored.logprobs.tokens)] == scored.logprobs.tokens
    best = [max(top.values()) for top in scored.logprobs.top]
    assert best == pytest.approx(scored.sample.top[: len(best), 0].tolist(), abs=1e-6)


def test_only_samples_of_the_target_are_recorded():
    from distillspec.decoding.sampling import SamplingControls
    from distillspec.serving.completer import recordable

    assert recordable(CompletionJob("x", 4, DecodingArgs(temperature=1.0)))
    assert recordable(CompletionJob("x", 4, DecodingArgs(temperature=0.0)))
    assert not recordable(CompletionJob("x", 4, DecodingArgs(temperature=0.7)))
    assert not recordable(CompletionJob("x", 4, DecodingArgs(temperature=1.0, lenience="lin", epsilon=0.5)))
    assert not recordable(CompletionJob("x", 4, DecodingArgs(controls=SamplingControls(top_p=0.9))))
    assert not recordable(CompletionJob("x", 0, DecodingArgs(), echo=True, logprobs=1))


def test_one_bad_job_fails_alone_not_its_batch(completer, caplog):
    """A job that breaks the batched call it shares (here a prompt with a lone surrogate, which no tokenizer can
    encode; a seed torch refuses breaks its own call) gets its error in its own place; the seven jobs batched with
    it get their completions, as they would have alone."""
    args = DecodingArgs(gamma=2, temperature=0.0)
    good = [CompletionJob(PROMPTS[i % 4], 6, args) for i in range(7)]
    done = completer.complete([*good[:3], CompletionJob("1+\ud800=", 6, args), *good[3:]])
    assert isinstance(done[3], Exception)
    assert "a call of 8 jobs failed" in caplog.text  # the operator sees why a call ran slower
    alone = [completer.complete([job])[0].text for job in good]
    assert [d.text for d in done[:3] + done[4:]] == alone
    lossy = DecodingArgs(gamma=2, temperature=1.0, lenience="lin", epsilon=0.5)  # seeded: its own torch stream
    seeded = completer.complete([CompletionJob(PROMPTS[0], 6, lossy, seed=2**70), *good])
    assert isinstance(seeded[0], Exception) and [d.text for d in seeded[1:]] == alone
    with pytest.raises(DistillSpecError, match="cannot be tokenized"):
        completer.check(CompletionJob("1+\ud800=", 6, args))


def test_a_warm_up_leaves_no_trace(text_pair, tokenizer):
    """A server's warm-up decodes, but what it measured and drew does not stay: gamma=auto has chosen nothing and
    measured no cost, and a seedless sample after it is the one a server without a warm-up draws."""
    target, draft = text_pair
    warm, cold = (Completer(target, draft, tokenizer, max_prompt_tokens=16, seed=3) for _ in range(2))
    assert warm.warm_up(rows=4) > 0
    summary = warm.gamma_summary()
    assert summary["chosen"] == {} and summary["alpha"] == {} and summary["expected_tokens_per_s"] is None
    assert warm.auto.verify_costs.measured == 0 and warm.auto.draft_costs.measured == 0
    # A fixed gamma: gamma=auto's choices follow measured seconds, which differ between two servers.
    jobs = [CompletionJob(p, 8, DecodingArgs(gamma=3, temperature=1.0)) for p in PROMPTS]
    assert [c.text for c in warm.complete(jobs)] == [c.text for c in cold.complete(jobs)]


def test_seeded_jobs_repeat_and_unseeded_ones_vary(completer):
    args = DecodingArgs(gamma=2, temperature=1.0)
    a = completer.complete([CompletionJob(PROMPTS[0], 16, args, seed=5), CompletionJob(PROMPTS[1], 16, args)])
    b = completer.complete([CompletionJob(PROMPTS[0], 16, args, seed=5)])
    assert a[0].text == b[0].text
    texts = {completer.complete([CompletionJob(PROMPTS[0], 16, args)])[0].text for _ in range(6)}
    assert len(texts) > 1


def test_a_seeded_job_gives_one_text_at_gamma_auto_whatever_shares_its_batch(completer):
    """Seeded jobs batch together, their random numbers keyed by seed and position: the same text at gamma auto (as
    its choice moves between calls), at a fixed gamma, with speculation off, alone or beside other seeded and
    unseeded jobs; another seed gives another text."""
    auto, fixed, off = (DecodingArgs(gamma=g, temperature=1.0) for g in ("auto", 3, 0))
    job = CompletionJob(PROMPTS[2], 16, auto, seed=7)
    alone = completer.complete([job])[0]
    assert alone.stats["coupled"] is True
    crowd = [CompletionJob(PROMPTS[i % 4], 16, auto, seed=None if i % 2 else 100 + i) for i in range(7)]
    for others in ([], crowd, crowd[:3]):
        done = completer.complete([*others, job, *others])
        assert done[len(others)].text == alone.text
    for args in (fixed, off):
        assert completer.complete([CompletionJob(PROMPTS[2], 16, args, seed=7)])[0].text == alone.text
    texts = {completer.complete([CompletionJob(PROMPTS[2], 16, auto, seed=s)])[0].text for s in range(8, 14)}
    assert len(texts) > 1


def test_stop_strings_cut_the_text():
    assert cut_at_stop("12 + 7 = 19\nnext", ["\n"]) == ("12 + 7 = 19", True)
    assert cut_at_stop("abcabc", ["c", "b"]) == ("a", True)
    assert cut_at_stop("abc", ["x", ""]) == ("abc", False)


def test_refusals_name_the_field(completer):
    for job, field in [(CompletionJob("", 4), "prompt"), (CompletionJob("1+1=" * 40, 4), "prompt")]:
        with pytest.raises(DistillSpecError, match=field):
            completer.check(job)
    for bad, field in [
        ({"epsilon": 0.0}, "epsilon"),
        ({"lenience": "cubic"}, "lenience"),
        ({"temperature": -1.0}, "temperature"),
        ({"gamma": -1}, "gamma"),
        ({"gamma": "most"}, "gamma"),
    ]:
        with pytest.raises(DistillSpecError, match=field):
            DecodingArgs(**bad)  # decoding arguments are checked where they are made


def test_swap_keeps_a_running_call_on_its_draft(text_pair, tokenizer):
    target, draft = text_pair
    completer = Completer(target, draft, tokenizer)
    seen = []

    def on_block(tokens, counts, scores):
        if not seen:  # mid-call: a new version arrives
            completer.swap_draft(lambda m: (torch.nn.init.zeros_(m.lm_head.weight), 3)[1])
        seen.append(completer.version)

    done = completer.complete([CompletionJob(PROMPTS[0], 12, DecodingArgs(gamma=2, temperature=0.0))], on_block)
    assert done[0].version == -1 and seen[-1] == 3  # the call finished on the draft it started with
    assert completer.draft is not draft and bool((draft.lm_head.weight != 0).any())
    assert completer.complete([CompletionJob(PROMPTS[0], 4, DecodingArgs(gamma=2))])[0].version == 3
    assert completer.roll_back() == -1 and completer.draft is draft  # the draft the swap replaced, again
    assert completer.roll_back() == -1  # one step back only


@needs_compiler
def test_a_compiled_draft_serves_the_eager_texts_and_a_new_version_reuses_its_steps(text_pair, tokenizer):
    """serve.compile=draft: after the warm-up, batches of every size up to the largest and prompts of every length
    compile nothing more and give the eager completer's greedy texts (the target's); a new draft version, a copy of
    the draft, decodes without compiling anything again either."""
    target, draft = text_pair
    eager = Completer(target, draft, tokenizer, max_prompt_tokens=16)
    compiled = Completer(target, draft, tokenizer, max_prompt_tokens=16, compile="draft")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled.warm_up(rows=4) > 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > before  # the draft's steps were compiled
    args = DecodingArgs(gamma=3, temperature=0.0)
    for batch in ([PROMPTS[3]], PROMPTS[:3], PROMPTS, [PROMPTS[0] * 3, PROMPTS[1]]):
        jobs = [CompletionJob(p, 10, args) for p in batch]
        assert [c.text for c in compiled.complete(jobs)] == [c.text for c in eager.complete(jobs)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    compiled.swap_draft(lambda m: (torch.nn.init.normal_(m.lm_head.weight, std=0.02), 1)[1])
    with torch.no_grad():
        eager.swap_draft(lambda m: (m.lm_head.weight.copy_(compiled.draft.lm_head.weight), 1)[1])
    for batch in ([PROMPTS[3]], PROMPTS):
        jobs = [CompletionJob(p, 10, args) for p in batch]
        done = compiled.complete(jobs)
        assert [c.text for c in done] == [c.text for c in eager.complete(jobs)] and done[0].version == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_live_acceptance_judges_a_new_version_once_like_with_like():
    greedy, sampled = DecodingArgs(gamma=3, temperature=0.0), DecodingArgs(gamma=3, temperature=1.0)
    live = LiveAcceptance(window=4, margin=0.1)
    for _ in range(4):  # version 1 served both kinds of traffic: 0.8 greedy, 0.3 sampled
        live.record(1, {"accepted": 8, "rejected": 2}, greedy)
        live.record(1, {"accepted": 3, "rejected": 7}, sampled)
    assert live.alpha(1) == pytest.approx(0.55) and live.alpha(1, greedy) == pytest.approx(0.8)
    # Version 2 gets only sampled traffic, as good as version 1's there: kept (pooled over all traffic, version 1's
    # 0.55 against 0.3 would have rolled it back).
    for _ in range(4):
        assert live.verdict(2, 1) is None  # fewer than `window` completions: not judged yet
        live.record(2, {"accepted": 3, "rejected": 7}, sampled)
    assert live.verdict(2, 1) is None and 2 in live.judged
    # Version 3 collapses on greedy traffic: rolled back, once.
    for _ in range(4):
        live.record(3, {"accepted": 1, "rejected": 9}, greedy)
    reason = live.verdict(3, 1)
    assert reason.startswith("rollback: live alpha 0.100 of version 3 < 0.800 of version 1"), reason
    assert live.verdict(3, 1) is None
    # Settings the previous version never served give no reference: nothing is judged on them.
    lossy = DecodingArgs(gamma=3, temperature=1.0, lenience="lin", epsilon=0.5)
    for _ in range(8):
        live.record(4, {"accepted": 0, "rejected": 10}, lossy)
    assert live.verdict(4, 1) is None and 4 not in live.judged
    live.record(5, {"accepted": 0, "rejected": 0}, greedy)  # plain decoding: nothing to count
    assert live.alpha(5) is None
    live.forget({1})
    assert live.versions() == [1]
    off = LiveAcceptance(window=0, margin=0.1)
    off.record(1, {"accepted": 8, "rejected": 2}, greedy), off.record(2, {"accepted": 0, "rejected": 9}, greedy)
    assert off.verdict(2, 1) is None


def test_live_acceptance_keeps_a_version_whose_window_drew_harder_prompts():
    """Same draft, two windows of 16 greedy completions: one prompt has alpha 7/15, the others 12/12 (the tiny
    garden's). Version 1's window drew it once, version 2's six times: pooled 0.959 against 0.771, more than the margin
    apart but within sampling noise, so version 2 stays; a draft that accepts nothing is still rolled back."""
    greedy = DecodingArgs(gamma=3, temperature=0.0)
    live = LiveAcceptance(window=16, margin=0.15)
    for i in range(16):
        live.record(1, {"accepted": 7, "rejected": 8} if i == 0 else {"accepted": 12, "rejected": 0}, greedy)
        live.record(2, {"accepted": 7, "rejected": 8} if i < 6 else {"accepted": 12, "rejected": 0}, greedy)
        live.record(3, {"accepted": 0, "rejected": 16}, greedy)
    assert live.alpha(1) - live.alpha(2) > 0.15
    assert live.verdict(2, 1) is None and 2 not in live.judged  # too close to tell yet: judged on what follows
    assert live.verdict(3, 1).startswith("rollback: live alpha 0.000 of version 3 < 0.959 of version 1")
    for _ in range(16):  # the draft's usual mix: version 2 passes
        live.record(2, {"accepted": 12, "rejected": 0}, greedy)
    assert live.verdict(2, 1) is None and 2 in live.judged
    alpha, var = ratio_variance([(12, 12)] * 10 + [(7, 15)] * 6)
    assert alpha == pytest.approx(162 / 210) and var == pytest.approx(0.00486, rel=0.01)
    assert ratio_variance([(3, 4)]) == (0.75, 0.0)


def test_live_acceptance_judges_a_version_gamma_auto_stopped_speculating_with():
    """gamma=auto drafts nothing soon after a version collapses: its completions still fill the window, and the few
    draft tokens judged (an exploring block) decide; a window without any waits."""
    auto = DecodingArgs(gamma="auto", temperature=0.0)
    live = LiveAcceptance(window=8, margin=0.15)
    for _ in range(8):
        live.record(1, {"accepted": 6, "rejected": 2}, auto)
        live.record(2, {"accepted": 0, "rejected": 0}, auto)
    assert live.alpha(2) is None and live.verdict(2, 1) is None and 2 not in live.judged
    live.record(2, {"accepted": 0, "rejected": 3}, auto)
    assert live.verdict(2, 1).startswith("rollback: live alpha 0.000 of version 2 < 0.750 of version 1")
    live.record(3, {"accepted": 0, "rejected": 0}, DecodingArgs(gamma=3))  # a fixed gamma that judged nothing
    assert live.versions() == [1, 2]


def test_live_acceptance_waits_to_tell_a_weak_draft_from_a_collapse():
    """Against a previous version at alpha 0.3, a window that judged 3 draft tokens and accepted none is what the
    same draft does a third of the time (0.7^3): not rolled back, although no completion in it accepted anything (the
    window's own spread is 0), nor passed: it is judged again as tokens come, and passes on the draft's usual rate.
    120 judged and none accepted is a collapse: rolled back. A version that stays undecided passes after four
    windows."""
    auto = DecodingArgs(gamma="auto", temperature=0.0)
    live = LiveAcceptance(window=16, margin=0.1)
    for i in range(16):
        live.record(1, {"accepted": 3, "rejected": 7}, auto)
        live.record(2, {"accepted": 0, "rejected": int(i < 3)}, auto)  # the choice drafted in 3 blocks only
        live.record(3, {"accepted": 0, "rejected": 8 if i < 15 else 0}, auto)
        live.record(4, {"accepted": 0, "rejected": int(i < 3)}, auto)
    assert live.verdict(2, 1) is None and 2 not in live.judged
    assert live.verdict(3, 1).startswith("rollback: live alpha 0.000 of version 3 < 0.300 of version 1")
    for _ in range(8):
        live.record(2, {"accepted": 3, "rejected": 7}, auto)
    assert live.verdict(2, 1) is None and 2 in live.judged
    for _ in range(47):  # nothing more judged: undecided
        live.record(4, {"accepted": 0, "rejected": 0}, auto)
        assert live.verdict(4, 1) is None and 4 not in live.judged
    live.record(4, {"accepted": 0, "rejected": 0}, auto)
    assert live.verdict(4, 1) is None and 4 in live.judged


def test_merge_stats_pools_counts():
    a = {"gamma": 4, "drafted": 8, "accepted": 6, "rejected": 1, "target_calls": 2}
    b = {"gamma": 4, "drafted": 4, "accepted": 0, "rejected": 1, "target_calls": 1}
    m = merge_stats([a, b])
    assert m["alpha"] == pytest.approx(6 / 8) and m["tau"] == pytest.approx((6 + 3) / 3)


def test_the_canary_refuses_a_worse_version_and_one_nothing_was_judged_for():
    assert canary_refusal(0.70, None, 0.02) is None  # the first version serves
    assert canary_refusal(0.69, 0.70, 0.02) is None  # within the margin
    assert canary_refusal(0.60, 0.70, 0.02).startswith("canary: alpha 0.600 < serving 0.700")
    for alpha in (float("nan"), float("inf")):  # no draft token judged, or an engine's counters missing
        assert "nothing judged" in canary_refusal(alpha, None, 0.02)
        assert "nothing judged" in canary_refusal(alpha, 0.70, 0.02)


def closed_loop(batcher_wait_s: float, clients: int, requests: int, max_size: int = 16) -> list[int]:
    """``clients`` that each send their next request a random 0-15 ms after the last one returns, to a replica
    whose batches take 20 ms: the size of every batch it decoded."""
    sizes, rng = [], random.Random(0)

    async def run(jobs: list) -> list:
        sizes.append(len(jobs))
        await asyncio.sleep(0.02)
        return [f"done {j}" for j in jobs]

    async def main() -> None:
        batcher = RequestBatcher(run, max_size, batcher_wait_s)

        async def client(c: int) -> None:
            for i in range(requests):
                assert await batcher.submit((c, i)) == f"done {(c, i)}"
                await asyncio.sleep(rng.uniform(0, 0.015))

        await asyncio.gather(*(client(c) for c in range(clients)))

    asyncio.run(main())
    return sizes


def test_clients_that_come_back_together_are_batched_together():
    """Batches sealed as soon as the decoder is free split 8 clients that return a few ms apart, batch after batch;
    waiting (at most 50 ms) for as many as the replica held lately keeps every batch full."""
    split = closed_loop(0.0, clients=8, requests=12)
    full = closed_loop(0.05, clients=8, requests=12)
    assert sum(split) == sum(full) == 96
    assert 96 / len(split) < 6 < 96 / len(full)  # requests per batch: split about 4, full 8 (12 batches of 8)


def test_a_lone_client_never_waits_and_batches_keep_to_their_size():
    start = time.perf_counter()
    assert closed_loop(5.0, clients=1, requests=5) == [1] * 5
    assert time.perf_counter() - start < 1.0  # 5 batches of 20 ms and the client's pauses, no 5 s waits
    sizes = closed_loop(0.05, clients=10, requests=3, max_size=4)
    assert sum(sizes) == 30 and max(sizes) == 4


def test_a_failed_batch_answers_each_request_and_a_request_whose_client_left_is_not_decoded():
    decoded = []

    async def run(jobs: list) -> list:
        decoded.append(list(jobs))
        await asyncio.sleep(0.01)
        if "bad" in jobs:
            raise RuntimeError("the decoder failed")
        return [ValueError(j) if j == "own" else j for j in jobs]

    async def main() -> list:
        batcher = RequestBatcher(run, 8, 0.0)
        first = await asyncio.gather(batcher.submit("bad"), batcher.submit("x"))
        left = asyncio.ensure_future(batcher.submit("gone"))
        blocker = asyncio.ensure_future(batcher.submit("busy"))  # decodes while "gone" waits in the queue
        await asyncio.sleep(0)
        left.cancel()
        return [*first, await blocker, await batcher.submit("own")]

    bad, x, busy, own = asyncio.run(main())
    assert isinstance(bad, RuntimeError) and x is bad  # each request of the failed batch gets its exception
    assert busy == "busy" and isinstance(own, ValueError)  # a job's own failure is its own
    assert all("gone" not in jobs for jobs in decoded)


def test_a_request_is_checked_and_tokenised_once_per_prompt_whatever_n(completer):
    from cluster.openai_api import CompletionRequest, completion_jobs
    from distillspec.config import ServeConfig

    checked = []

    def check(job: CompletionJob) -> None:
        checked.append(job)
        completer.check(job)

    body = CompletionRequest(prompt=PROMPTS[:2], max_tokens=4, n=3, seed=7)
    jobs = completion_jobs(body, PROMPTS[:2], ServeConfig(), check)
    assert len(checked) == 2 and len(jobs) == 6
    assert [j.prompt for j in jobs] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert [j.seed for j in jobs] == [7, 8, 9] * 2  # sample i of a prompt: seed + i, as vLLM derives it
    for first, rest in ((jobs[0], jobs[1:3]), (jobs[3], jobs[4:])):
        assert all(j.prompt_ids is first.prompt_ids for j in rest)  # the one tokenisation, shared
    done = completer.complete(jobs[:1])[0]
    assert done.prompt_tokens == len(jobs[0].prompt_ids) and done.completion_tokens > 0


def test_a_server_reads_a_prompts_held_blocks_once_but_for_seeded_requests(text_pair, tokenizer):
    """serve.prompt_cache_mb: a prompt that starts as an earlier one did is read after the blocks held of it, by the
    target and by the draft, to the same greedy text; a seeded request reads its prompt whole."""
    from cluster.openai_api import usage

    target, draft = text_pair
    server = Completer(target, draft, tokenizer, max_prompt_tokens=128, prompt_cache_bytes=16 << 20)
    preamble = "12+7=19 3*4=12 100-1=99 9+9+9=27 " * 2
    args = DecodingArgs(gamma=3, temperature=0.0)
    first = server.complete([CompletionJob(preamble + p, 8, args) for p in PROMPTS[:2]])
    assert server.prompts.hits == 0 and len(server.prompts) > 0
    again = server.complete([CompletionJob(preamble + p, 8, args) for p in PROMPTS[2:]])
    held = server.prompts.hits
    assert held >= 2 * 2 * 16  # both rows, both models, at least a block each
    assert [c.cached_prompt_tokens for c in first] == [0, 0] and min(c.cached_prompt_tokens for c in again) >= 16
    assert usage(again)["prompt_tokens_details"]["cached_tokens"] == sum(c.cached_prompt_tokens for c in again)
    for c, prompt in zip(first + again, PROMPTS, strict=True):
        assert c.text == greedy_text(target, tokenizer, preamble + prompt, 8)
    server.complete([CompletionJob(preamble + PROMPTS[0], 8, DecodingArgs(gamma=3, temperature=1.0), seed=3)])
    assert server.prompts.hits == held
