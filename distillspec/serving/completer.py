"""Serving completions with speculative decoding, free of Ray and HTTP: the Serve deployment calls these.

A :class:`Completer` holds a target, a draft and its version, and turns :class:`CompletionJob` s into
:class:`Completion` s. Concurrent jobs with the same decoding settings (gamma, temperature, lenience, epsilon)
share one batched :func:`speculative_generate` call, each row with its own token budget. Seeded jobs share calls of
their own, each row's random numbers keyed by its seed and the token's position (blocks verified by coupling:
:class:`~distillspec.decoding.speculative.SeededNoise`), so a seed gives one text whatever gamma is chosen and whoever
shares the batch; a seeded lossy job (lenience) runs alone at a fixed gamma. Every completion carries its SD
statistics and the draft version it was made with: a swap of the draft (:meth:`Completer.swap_draft`) never touches a
call already running.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.config import Compile, DraftContext, Lenience
from distillspec.decoding.auto_gamma import AutoGamma
from distillspec.decoding.kvcache import CachedLM
from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.decoding.prompt_cache import PromptCache
from distillspec.decoding.sampling import SamplingControls
from distillspec.decoding.speculative import (
    GenerationOutput,
    Logprobs,
    autoregressive_generate,
    check_decoding_args,
    score_prompts,
    speculative_generate,
)
from distillspec.errors import DistillSpecError
from distillspec.models.draft_vocab import vocab_size
from distillspec.models.loading import load_arrays, pad_prompts, prompt_ids
from distillspec.training.batches import ServedSample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodingArgs:
    """What a batch must share, checked where it is made (a bad value raises :class:`DistillSpecError` naming it):
    ``gamma=0`` turns speculation off (plain decoding with the target); ``"auto"`` chooses it per block
    (:class:`distillspec.decoding.auto_gamma.AutoGamma`); ``controls``: top-p, penalties and the rest
    (:mod:`distillspec.decoding.sampling`), checked against the vocabulary where it is known
    (:meth:`SamplingControls.check`)."""

    gamma: int | Literal["auto"] = 5
    temperature: float = 1.0
    lenience: Lenience | None = None
    epsilon: float = 1.0
    controls: SamplingControls = field(default_factory=SamplingControls)

    def __post_init__(self) -> None:
        check_decoding_args(
            gamma=1 if self.gamma in ("auto", 0) else self.gamma,  # both valid here: chosen per block, or no drafts
            max_new_tokens=1,
            temperature=self.temperature,
            lenience=self.lenience,
            epsilon=self.epsilon,
        )


@dataclass
class CompletionJob:
    """One completion to make. ``logprobs``: score its tokens under the target, with that many likeliest tokens at
    each position; ``echo``: its prompt's tokens too (``max_new_tokens=0`` only scores the prompt)."""

    prompt: str
    max_new_tokens: int
    args: DecodingArgs = field(default_factory=DecodingArgs)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    #: keep the completion's tokens with the target's ``record`` likeliest tokens at each (:attr:`Completion.sample`),
    #: whatever the client asked for: online distillation on served samples (``serve.record_samples``); 0: none
    record: int = 0
    prompt_ids: list[int] | None = field(default=None, repr=False)  #: the prompt tokenised (once: :meth:`ids`)

    def ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The prompt's token ids (:func:`~distillspec.models.loading.prompt_ids`), tokenised on the first call."""
        if self.prompt_ids is None:
            self.prompt_ids = prompt_ids(tokenizer, self.prompt)
        return self.prompt_ids


@dataclass
class TokenLogprobs:
    """The target's log-probabilities of a completion's tokens (the prompt's first, with ``echo``; the first
    prompt token has none) and, at each position, of its likeliest tokens (token id -> log-probability)."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[dict[int, float] | None]

    @classmethod
    def of(cls, scores: Logprobs, row: int, tokens: list[int], start: int, k: int | None = None) -> TokenLogprobs:
        """``tokens``, scored in row ``row`` of ``scores`` from column ``start`` on, with the ``k`` likeliest tokens
        of each position (default: all ``scores`` has)."""
        columns = slice(start, start + len(tokens))
        ids, top = scores.top_ids[row, columns, :k].tolist(), scores.top[row, columns, :k].tolist()
        top = [dict(zip(i, v, strict=True)) for i, v in zip(ids, top, strict=True)]
        return cls(tokens, scores.token[row, columns].tolist(), top)

    def __add__(self, other: TokenLogprobs) -> TokenLogprobs:
        return TokenLogprobs(self.tokens + other.tokens, self.logprobs + other.logprobs, self.top + other.top)

    def after(self, n: int) -> TokenLogprobs:
        """The scores of the tokens after the first ``n``."""
        return TokenLogprobs(self.tokens[n:], self.logprobs[n:], self.top[n:])


@dataclass
class ScoredDelta:
    """A stream's text delta with the log-probabilities of the tokens it completes (a request with ``logprobs``)."""

    text: str
    logprobs: TokenLogprobs

    def __bool__(self) -> bool:
        return bool(self.text or self.logprobs.tokens)


def recordable(job: CompletionJob) -> bool:
    """Whether a job's completion is a sample of the target as a distillation run trains on it: lossless, at
    temperature 1 or greedy, without sampling controls that change the target's distribution, some tokens asked
    for."""
    args = job.args
    return (
        args.temperature in (0.0, 1.0) and args.lenience is None and not args.controls.active and job.max_new_tokens > 0
    )


@dataclass
class Completion:
    text: str
    finish_reason: str  #: stop (EOS or a stop string) | length
    prompt_tokens: int
    completion_tokens: int
    version: int  #: draft weight version that made it (-1: the draft loaded at start)
    stats: dict  #: gamma, drafted, accepted, alpha, tau, target_calls (per request)
    seconds: float
    args: DecodingArgs = field(default_factory=DecodingArgs)  #: the decoding settings it was made with
    logprobs: TokenLogprobs | None = None  #: with the job's ``logprobs`` (its text starts with the prompt: ``echo``)
    sample: ServedSample | None = None  #: with the job's ``record``
    cached_prompt_tokens: int = 0  #: prompt tokens the target took from a prompt cache (vLLM's: its prefix cache)


def tokens_within(tokenizer: PreTrainedTokenizerBase, tokens: list[int], text: str) -> int:
    """How many of ``tokens`` a completion ``text`` cut from their decoding keeps: not those wholly past its end (a
    stop string cut them)."""
    kept = len(tokens)
    while kept and len(tokenizer.decode(tokens[: kept - 1], skip_special_tokens=True)) >= len(text):
        kept -= 1
    return kept


def cut_at_stop(text: str, stop: Iterable[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (excluded), and whether one was found."""
    hits = [i for s in stop if s and (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class StreamText:
    """The text of a growing completion, released as deltas that are final: held back while a stop string may
    still be forming or a multi-byte character is incomplete, and cut at the first stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.scored = 0  #: tokens whose log-probs went out with a delta (:meth:`scored_delta`)

    def scored_delta(self, delta: str, token_ids: list[int], score: Callable[[int, int], TokenLogprobs]) -> ScoredDelta:
        """``delta`` with the scores of the tokens it completes, those now wholly within the text released:
        ``score(start, end)`` scores ``token_ids[start:end]``."""
        start, end, decode = self.scored, self.scored, self.tokenizer.decode
        while end < len(token_ids) and len(decode(token_ids[: end + 1], skip_special_tokens=True)) <= self.sent:
            end += 1
        self.scored = end
        return ScoredDelta(delta, score(start, end))

    def rest(self, done: Completion) -> str | ScoredDelta:
        """What the stream has yet to send of ``done``: its text past the deltas, with the scores not sent yet (of
        the tokens it kept: a stop string cuts them)."""
        text = done.text[self.sent :]
        return text if done.logprobs is None else ScoredDelta(text, done.logprobs.after(self.scored))

    def update(self, token_ids: list[int]) -> tuple[str, bool]:
        """The new final text given all tokens so far, and whether a stop string was reached."""
        text, hit = cut_at_stop(self.tokenizer.decode(token_ids, skip_special_tokens=True), self.stop)
        safe = len(text) if hit else max(self.sent, len(text) - self.hold)
        while safe > self.sent and text[safe - 1] == "\ufffd":  # a multi-byte character not yet complete
            safe -= 1
        delta = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta, hit


def counts_stats(counts: AcceptanceCounts, gamma: int | str, drafted: int | None = None) -> dict:
    """The SD statistics of a completion (the keys :func:`merge_stats` pools) from its acceptance counts (``drafted``:
    draft tokens proposed, when blocks did not all propose ``gamma``)."""
    return {
        "gamma": gamma,
        "drafted": counts.blocks * gamma if drafted is None else drafted,
        "accepted": counts.accepted,
        "rejected": counts.rejected,
        "alpha": _measured(counts.alpha),
        "tau": _measured(counts.tau),
        "target_calls": counts.blocks,
    }


def _measured(value: float) -> float | None:
    """A ratio of counts, None (JSON null) where there was nothing to count."""
    return None if math.isnan(value) else value


def row_stats(out: GenerationOutput, row: int, gamma: int | str) -> dict:
    """SD statistics of one row of a batched call (``gamma=0``: plain decoding)."""
    if out.stats is None:
        n = int(out.num_new_tokens[row])
        return {"gamma": 0, "drafted": 0, "accepted": 0, "rejected": 0, "alpha": None, "tau": 1.0, "target_calls": n}
    s = out.stats
    counts = AcceptanceCounts(int(s.blocks[row]), int(s.accepted[row].sum()), int(s.rejected[row]))
    return counts_stats(counts, gamma, int(s.drafted[row]))


def merge_stats(stats: list[dict]) -> dict:
    """The SD statistics of several completions together (pooled counts, not a mean of ratios)."""
    total = {k: sum(s[k] for s in stats) for k in ("drafted", "accepted", "rejected", "target_calls")}
    counts = AcceptanceCounts(total["target_calls"], total["accepted"], total["rejected"])
    plain = total["drafted"] == 0 and counts.blocks  # the target alone: one token a call
    tau = 1.0 if plain else _measured(counts.tau)
    return {"gamma": stats[0]["gamma"], **total, "alpha": _measured(counts.alpha), "tau": tau}


def check_prompt(tokenizer: PreTrainedTokenizerBase, job: CompletionJob, max_prompt_tokens: int) -> int:
    """The number of tokens the job's prompt encodes to (tokenised here, once: :meth:`CompletionJob.ids`);
    :class:`DistillSpecError` (a 400 at the endpoint) for a prompt a server refuses: empty, not encodable (e.g. a lone
    surrogate, which no UTF-8 tokenizer takes), encoding to no tokens, or longer than ``max_prompt_tokens``."""
    if not job.prompt:
        raise DistillSpecError("prompt: must not be empty")
    try:
        n = len(job.ids(tokenizer))
    except Exception as exc:
        raise DistillSpecError(f"prompt: cannot be tokenized ({type(exc).__name__})") from None
    if n == 0:
        raise DistillSpecError("prompt: encodes to no tokens")
    if n > max_prompt_tokens:
        raise DistillSpecError(f"prompt: {n} tokens, more than this server's limit of {max_prompt_tokens}")
    return n


class DraftServer(Protocol):
    """What a Serve replica needs of its decoding backend, beside decoding itself (batched calls for
    :class:`Completer`, continuous batching for :class:`distillspec.serving.vllm_backend.VLLMCompleter`)."""

    tokenizer: PreTrainedTokenizerBase
    version: int  #: the draft version served now
    previous: tuple[object, int] | None  #: the draft the last swap replaced, and its version (None: no swap yet)

    def check(self, job: CompletionJob) -> None:
        """Raise :class:`DistillSpecError` for a job this backend refuses (a 400 at the endpoint)."""

    def check_health(self) -> None:
        """Raise when the backend cannot serve any more (Serve replaces the replica)."""

    def load_draft(self, state: Mapping[str, np.ndarray], version: int, alpha: float | None = None) -> int:
        """Serve draft ``version`` (its weights ``state``; ``alpha``: its canary's) from the next call on."""

    def roll_back(self) -> int:
        """Serve the draft the last :meth:`load_draft` replaced again; returns the version served now."""

    def gamma_summary(self) -> dict | None:
        """gamma=auto's choices (None: the backend drafts a fixed gamma)."""

    def stream(self, job: CompletionJob) -> AsyncIterator[str | Completion]:
        """Text deltas as tokens are accepted, then the :class:`Completion`."""


class Completer:
    """Completions from a target and a swappable draft (a :class:`DraftServer`). ``compile``: the decoding steps
    through ``torch.compile`` (see :func:`~distillspec.decoding.speculative.speculative_generate`; ``"draft"``: the
    draft's alone), the draft's compiled as the server warms up (:meth:`compile_draft_steps`); a new draft version is a
    copy of the draft and reuses them. ``draft_context``: the draft reads each prompt's last tokens alone (see
    :func:`~distillspec.decoding.speculative.speculative_generate`). ``prompt_cache_bytes``: the keys and values of
    prompts' blocks kept for later prompts that start the same way (:class:`PromptCache`; 0: none); a seeded call
    reads its prompts whole, so that its text depends on its seed alone and not on what the cache held."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_prompt_tokens: int = 512,
        version: int = -1,
        seed: int = 0,
        max_gamma: int = 7,
        compile: Compile = False,
        draft_context: DraftContext = None,
        prompt_cache_bytes: int = 0,
    ) -> None:
        self.target, self.draft, self.tokenizer, self.version = target.eval(), draft.eval(), tokenizer, version
        self.compile = compile
        self.draft_context = draft_context  #: the prompt's last tokens the draft reads (auto; None: all of it)
        self.max_prompt_tokens = max_prompt_tokens
        self.auto = AutoGamma(max_gamma)  #: chooses gamma per block for jobs with ``gamma="auto"``
        self.generator = torch.Generator(device=target.device).manual_seed(seed)
        self.previous: tuple[PreTrainedModel, int] | None = None  #: the draft the last swap replaced
        #: prompts' blocks, the target's and each draft version's (a version's go when its model object does)
        self.prompts = PromptCache(prompt_cache_bytes) if prompt_cache_bytes else None

    def check(self, job: CompletionJob) -> None:
        """Raise :class:`DistillSpecError` for a job this server refuses (the endpoint turns it into a 400)."""
        check_prompt(self.tokenizer, job, self.max_prompt_tokens)
        job.args.controls.check(vocab_size(self.target))

    def warm_up(self, rows: int, max_new_tokens: int = 4, prompt: str = "Hello") -> float:
        """Decode ``rows`` copies of a short prompt for a few tokens, with gamma chosen live and without
        speculation, greedily, and forget what gamma=auto measured meanwhile (a cold call's costs are not a warm
        one's). A server's first calls pay one-time costs (thread pools, allocations the allocator then keeps, lazy
        initialisation); paid here, its first requests cost what later ones do and its memory is taken before it
        serves. With ``compile``, it also compiles the draft's decoding steps (:meth:`compile_draft_steps`). Returns
        the seconds it took."""
        start, auto = time.perf_counter(), self.auto
        self.auto = AutoGamma(auto.max_gamma)
        try:
            for gamma in ("auto", 0):
                job = CompletionJob(prompt, max_new_tokens, DecodingArgs(gamma=gamma, temperature=0.0))
                for done in self.complete([job] * rows):
                    if isinstance(done, Exception):
                        raise done
        finally:
            self.auto = auto
        if self.compile:
            self.compile_draft_steps(rows, prompt)
        return time.perf_counter() - start

    @torch.inference_mode()
    def compile_draft_steps(self, rows: int, prompt: str = "Hello") -> None:
        """Compile the draft's decoding steps before any request waits on them: a step of one new token and of two
        (after a block whose drafts were all accepted), for one row and, if ``rows`` > 1, for two. On a CPU a compiled
        step takes any cache length, and one of 2 rows any batch from 2 on, so a server's later calls compile nothing
        more (a copy of the draft, a new version, reuses them); on a GPU each batch size compiles when it comes."""
        ids = torch.tensor([prompt_ids(self.tokenizer, prompt)], device=self.draft.device)
        for batch in sorted({1, min(rows, 2)}):
            lm, x = CachedLM(self.draft, compile=True), ids.repeat(batch, 1)
            lm.prefill(x, torch.ones_like(x))
            for k in (1, 2):
                lm.step(x[:, -k:])

    def check_health(self) -> None:
        """Nothing to probe: the models live in this process."""

    def swap_draft(self, load: Callable[[PreTrainedModel], int], alpha: float | None = None) -> int:
        """Load new weights into a copy of the draft (``load(model) -> version``), then make it current; the draft
        it replaces is kept for :meth:`roll_back`. Calls already running keep the draft object they started with.
        ``alpha`` (the version's canary alpha) is where gamma's choice starts for it."""
        fresh = copy.deepcopy(self.draft)
        version = load(fresh)
        if version != self.version:
            self.auto.start_version(version, alpha)
            self.previous = (self.draft, self.version)
            self.draft, self.version = fresh.eval(), version
            self.auto.forget({self.previous[1], version})
        return self.version

    def load_draft(self, state: Mapping[str, np.ndarray], version: int, alpha: float | None = None) -> int:
        """:meth:`swap_draft` to the weights ``state`` of ``version``; returns the version served now."""

        def load(model: PreTrainedModel) -> int:
            load_arrays(model, state)
            return version

        return self.swap_draft(load, alpha)

    def roll_back(self) -> int:
        """Serve the draft the last swap replaced again; returns the version served now."""
        if self.previous is not None:
            (self.draft, self.version), self.previous = self.previous, None
        return self.version

    def gamma_summary(self) -> dict:
        """gamma=auto's choices, alpha and tokens/s (:meth:`distillspec.decoding.auto_gamma.AutoGamma.summary`)."""
        return self.auto.summary()

    async def stream(self, job: CompletionJob) -> AsyncIterator[str | ScoredDelta | Completion]:
        """Text deltas block by block as the decoder (in a thread) accepts tokens (final text only: see
        :class:`StreamText`), then the completion. With the job's ``logprobs``, each delta is a :class:`ScoredDelta`
        with the scores of the tokens whose text it completes. A client that leaves stops the decoding at the next
        block."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        text, state = StreamText(self.tokenizer, job.stop), {"cancel": False}

        def on_block(tokens: torch.Tensor, counts: torch.Tensor, scores: Logprobs | None) -> bool:
            ids = tokens[0, : int(counts[0])].tolist()
            delta, hit = text.update(ids)
            if delta and job.logprobs is not None:
                delta = text.scored_delta(
                    delta, ids, lambda a, b: TokenLogprobs.of(scores, 0, ids[a:b], a, job.logprobs)
                )
            if delta:
                loop.call_soon_threadsafe(queue.put_nowait, delta)
            return hit or state["cancel"]

        def work() -> Completion:
            try:
                done = self.complete([job], on_block=on_block)[0]
                if isinstance(done, Exception):
                    raise done
                return done
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        task = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            while (delta := await queue.get()) is not None:
                yield delta
            done = await task
            if rest := text.rest(done):
                yield rest
            yield done
        finally:
            state["cancel"] = True

    def complete(self, jobs: list[CompletionJob], on_block: Callable | None = None) -> list[Completion | Exception]:
        """Run ``jobs``; those sharing decoding settings (and no seed) share one batched call.

        One job's failure is its own: when a batched call fails, its jobs run again one at a time, and a job that
        fails alone gets its exception in its place of the result (its neighbours, other clients' requests
        batched with it, get their completions)."""
        groups: dict[tuple, list[int]] = {}
        for i, job in enumerate(jobs):
            scoring = (job.logprobs, job.echo, job.max_new_tokens == 0, job.record)
            groups.setdefault((job.args, seed_group(job, i), *scoring), []).append(i)
        results: list[Completion | Exception | None] = [None] * len(jobs)
        for (args, group, *_), rows in groups.items():
            seeded = group != UNSEEDED
            try:
                for i, done in zip(rows, self._run([jobs[i] for i in rows], args, seeded, on_block), strict=True):
                    results[i] = done
            except Exception as exc:
                if len(rows) == 1:
                    results[rows[0]] = exc
                    continue
                log.warning(
                    "a call of %d jobs failed (%s: %s): they run one at a time", len(rows), type(exc).__name__, exc
                )
                for i in rows:
                    results[i] = self.complete([jobs[i]], on_block)[0]
        return results  # type: ignore[return-value]

    def _run(
        self, jobs: list[CompletionJob], args: DecodingArgs, seeded: bool, on_block: Callable | None
    ) -> list[Completion]:
        start = time.perf_counter()
        draft, version = self.draft, self.version  # fixed for this call, whatever a swap does meanwhile
        ids, mask = pad_prompts([j.ids(self.tokenizer) for j in jobs], self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.target.device), mask.to(self.target.device)
        generator, seeds, gamma = self.generator, None, args.gamma
        if seeded and args.lenience is None:  # keyed random numbers: any gamma, any batch
            seeds = [j.seed for j in jobs]
        elif seeded:  # a lossy seeded job, alone: its own stream, consumed alike at a fixed gamma
            generator = torch.Generator(device=self.target.device).manual_seed(jobs[0].seed)
            gamma = self.auto.start_gamma if gamma == "auto" else gamma
        common = dict(
            max_new_tokens=[j.max_new_tokens for j in jobs],
            temperature=args.temperature,
            eos_token_id=[self.tokenizer.eos_token_id, *args.controls.stop_token_ids],
            pad_token_id=self.tokenizer.pad_token_id,
            attention_mask=mask,
            generator=generator,
            on_block=on_block,
            seeds=seeds,
            controls=args.controls,
            logprobs=scored(jobs[0]),
            prompt_logprobs=jobs[0].echo,
            prompt_cache=None if seeded else self.prompts,
        )
        if all(j.max_new_tokens == 0 for j in jobs):  # echo alone: the prompts scored, nothing generated
            prompt = score_prompts(self.target, ids, mask, jobs[0].logprobs or 0)
            out = GenerationOutput(ids, torch.zeros(len(jobs), dtype=torch.long), prompt_logprobs=prompt)
        elif gamma == 0:
            out = autoregressive_generate(self.target, ids, compile=self.compile is True, **common)
        else:
            auto = gamma == "auto"  # a fixed gamma's blocks are measured too: every call teaches the costs
            # Coupled verification (seeded rows) accepts at its own rate: its acceptance is learnt apart.
            key = (version, args.temperature, args.lenience, args.epsilon, *(("coupled",) if seeds else ()))
            key += (args.controls,) if args.controls.active else ()
            out = speculative_generate(
                self.target,
                draft,
                ids,
                gamma=self.auto.max_gamma if auto else gamma,
                schedule=self.auto.for_call(key, None if auto else gamma),
                lenience=args.lenience,
                epsilon=args.epsilon,
                compile=self.compile,
                draft_context=self.draft_context,
                **common,
            )
        seconds = time.perf_counter() - start
        done = []
        for row, job in enumerate(jobs):
            n = int(out.num_new_tokens[row])
            new = out.sequences[row, ids.shape[1] : ids.shape[1] + n].tolist()
            ended = bool(new) and new[-1] in common["eos_token_id"]
            text, hit = cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), job.stop)
            kept = new[: tokens_within(self.tokenizer, new, text)] if job.logprobs is not None or hit else new
            scores = self._logprobs(job, out, row, ids, mask, kept) if job.logprobs is not None else None
            # a sample keeps what a stop string did not cut: without one, every token, EOS included (no text)
            trained = kept if hit else new
            sample = self._sample(job, out, row, trained) if job.record and trained else None
            done.append(
                Completion(
                    text=job.prompt + text if job.echo else text,
                    finish_reason="stop" if ended or hit else "length",
                    prompt_tokens=int(mask[row].sum()),
                    completion_tokens=n,
                    version=version,
                    stats=row_stats(out, row, args.gamma) | ({"coupled": True} if seeds else {}),
                    seconds=seconds,
                    args=args,
                    logprobs=scores,
                    sample=sample,
                    cached_prompt_tokens=0 if out.cached_prompt_tokens is None else int(out.cached_prompt_tokens[row]),
                )
            )
        return done

    def _logprobs(
        self, job: CompletionJob, out: GenerationOutput, row: int, ids, mask, tokens: list[int]
    ) -> TokenLogprobs:
        """Row ``row``'s scores: ``tokens``, the new tokens its text keeps (a stop string cuts them), after its
        prompt's (``echo``), each with the job's ``logprobs`` likeliest tokens."""
        k = job.logprobs
        scores = TokenLogprobs.of(out.logprobs, row, tokens, 0, k) if tokens else TokenLogprobs([], [], [])
        if not job.echo:
            return scores
        width, real = ids.shape[1], int(mask[row].sum())
        prompt = ids[row, width - real :].tolist()
        first = TokenLogprobs(prompt[:1], [None], [None])  # nothing scores a text's first token
        return first + TokenLogprobs.of(out.prompt_logprobs, row, prompt[1:], width - real, k) + scores

    def _sample(self, job: CompletionJob, out: GenerationOutput, row: int, tokens: list[int]) -> ServedSample:
        """Row ``row`` as a :class:`ServedSample`: its new ``tokens``, each with the target's top ``job.record``."""
        columns = slice(0, len(tokens))
        return ServedSample(
            prompt=list(job.ids(self.tokenizer)),
            tokens=tokens,
            top_ids=out.logprobs.top_ids[row, columns, : job.record].cpu().numpy().astype(np.int64),
            top=out.logprobs.top[row, columns, : job.record].float().cpu().numpy(),
            temperature=job.args.temperature,
        )


def scored(job: CompletionJob) -> int | None:
    """How many likeliest tokens a call scores at each position for ``job`` (None: no scores): the client's
    ``logprobs``, or the ``record`` a recorded job keeps if more."""
    if not job.record:
        return job.logprobs
    return max(job.logprobs or 0, job.record)


UNSEEDED = -1  #: the group of jobs without a seed (and of greedy ones, which draw no random numbers)
SEEDED = -2  #: the group of lossless seeded jobs, batched together with their random numbers keyed by seed


def seed_group(job: CompletionJob, index: int) -> int:
    """The call a job joins among those with its decoding settings: :data:`UNSEEDED`, :data:`SEEDED`, or its own
    (``index``: a seeded lossy job runs alone)."""
    if job.seed is None or job.args.temperature == 0:
        return UNSEEDED
    return SEEDED if job.args.lenience is None else index


class RequestBatcher:
    """Concurrent requests decoded together, in batches that a replica decoding one batch at a time can keep full.

    A batch decodes to its last row, so the clients whose requests it held all come back at once when it ends, each
    after its own round trip. A batch formed while another decodes, or sealed a fixed few milliseconds after its first
    request, splits them: part of them decode alone, the rest wait behind, and with clients that each send their next
    request when the last one returns, the split repeats batch after batch (8 clients ran as batches of 3.4 to 4.4).
    Here a batch forms only once the decoder is free, and then waits, at most ``wait_s``, until it holds as many
    requests as the replica has held at once during any of its last ``memory`` batches (at most ``max_size``): a
    lone client never waits, and clients that come back together decode together.

    ``run(jobs)``, a coroutine function, decodes one batch and returns one result per job, a :class:`Completion` or
    the exception of that job alone."""

    def __init__(
        self,
        run: Callable[[list[CompletionJob]], Awaitable[list[Completion | Exception]]],
        max_size: int,
        wait_s: float,
        memory: int = 4,
    ) -> None:
        self.run, self.max_size, self.wait_s = run, max_size, wait_s
        self.queue: deque[tuple[CompletionJob, asyncio.Future]] = deque()
        self.decoding = 0  #: requests in the batch being decoded
        self.peak = 0  #: the most requests held at once (queued or decoding) since the last batch formed
        self.peaks: deque[int] = deque(maxlen=memory)  #: ``peak`` at each of the last batches
        self.sizes: Counter[int] = Counter()  #: the batches decoded, by their number of requests
        self.arrived = asyncio.Event()
        self.loop: asyncio.Task | None = None

    @property
    def expected(self) -> int:
        """Requests a batch waits for: the most held at once lately, at most ``max_size``."""
        return max(1, min(self.max_size, max(self.peaks, default=1)))

    async def submit(self, job: CompletionJob) -> Completion | Exception:
        """Decode ``job`` in the next batch that has room; its completion, or the exception of its own failure."""
        if self.loop is None or self.loop.done():
            self.loop = asyncio.get_running_loop().create_task(self._batches())
        future = asyncio.get_running_loop().create_future()
        self.queue.append((job, future))
        self.peak = max(self.peak, len(self.queue) + self.decoding)
        self.arrived.set()
        return await future

    async def _batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrival(None)
            deadline = loop.time() + self.wait_s
            while len(self.queue) < self.expected and (left := deadline - loop.time()) > 0:
                await self._arrival(left)
            batch = [self.queue.popleft() for _ in range(min(self.max_size, len(self.queue)))]
            batch = [(job, f) for job, f in batch if not f.done()]  # a client that left cancelled its future
            self.peaks.append(self.peak)
            self.peak, self.decoding = len(self.queue) + len(batch), len(batch)
            if not batch:
                continue
            self.sizes[len(batch)] += 1
            try:
                done = await self.run([job for job, _ in batch])
            except Exception as exc:  # the batch failed as a whole: each of its requests is told why
                done = [exc] * len(batch)
            finally:
                self.decoding = 0
            for (_, future), result in zip(batch, done, strict=True):
                if not future.done():
                    future.set_result(result)

    async def _arrival(self, timeout: float | None) -> None:
        """Until the queue holds a request (``timeout`` None) or another arrives (at most ``timeout`` seconds)."""
        if timeout is None and self.queue:
            return
        self.arrived.clear()
        try:
            await asyncio.wait_for(self.arrived.wait(), timeout)
        except TimeoutError:
            pass


def canary_refusal(alpha: float, serving_alpha: float | None, margin: float) -> str | None:
    """The serving gate's canary rule: why a version whose canary measured ``alpha`` may not replace the serving
    version (whose canary alpha is ``serving_alpha``; None before any), or None when it may. A version nothing was
    judged for (alpha NaN: no draft token decoded, or an engine's counters missing) is refused, never waved through.
    """
    if not math.isfinite(alpha):
        return f"canary: alpha {alpha} (nothing judged)"
    if serving_alpha is not None and alpha < serving_alpha - margin:
        return f"canary: alpha {alpha:.3f} < serving {serving_alpha:.3f} - {margin:g}"
    return None


MAX_SETTINGS = 256  #: decoding settings (per version) a replica keeps statistics for; the oldest go first
NOISE_Z = 2.0  #: a rollback needs a drop this many standard errors beyond the margin (one-sided, about 2%)
JUDGED_WINDOWS = 4  #: a new version still undecided after this many rollback windows of completions passes


def ratio_variance(completions: Iterable[tuple[int, int]]) -> tuple[float, float]:
    """Pooled alpha of ``completions`` ((accepted, judged) draft tokens of each) and its variance over completions:
    the ratio estimator's, sum((a - alpha * j)^2) / (sum j)^2 * n / (n - 1), which counts a completion as one draw
    (the tokens of one completion are not independent); 0 for one completion."""
    pairs = list(completions)
    judged = sum(j for _, j in pairs)
    alpha = sum(a for a, _ in pairs) / judged
    n = len(pairs)
    spread = sum((a - alpha * j) ** 2 for a, j in pairs) / judged**2
    return alpha, spread * n / (n - 1) if n > 1 else 0.0


class LiveAcceptance:
    """Live alpha per draft version from served completions' SD statistics, and the rollback rule.

    Completions are pooled per version and per decoding settings (gamma, temperature, lenience, epsilon), because
    alpha depends on the settings; each keeps its last ``JUDGED_WINDOWS * window``. After a swap from ``previous`` to
    ``version``, the new version is judged from the moment it has made ``window`` completions with settings the
    previous version also served (at least ``window // 4`` times each): its pooled alpha over them is compared with
    the previous version's alpha on the same settings, weighted as the new version's traffic is (like with like,
    whatever the traffic's mix).

    - It is rolled back when it is more than ``margin`` lower, beyond sampling noise: by more than ``margin`` plus
      :data:`NOISE_Z` standard errors of the difference (:func:`ratio_variance`: completions differ, and a window of
      few completions over a skewed mix of prompts can be well below another window of the same draft; the new
      version's at least the binomial one of its judged tokens at the previous version's alpha).
    - It passes when it is at most ``margin`` lower.
    - In between (lower by more than the margin, within the noise: too few draft tokens judged to tell) it is judged
      again on each new completion, over all it has made, until one of the two holds; after ``JUDGED_WINDOWS`` windows
      still undecided, it passes.

    With gamma chosen live, a completion may draft nothing (the choice stopped speculating, as it does soon after a
    version collapses): it still counts towards the window, so a version the choice gave up on is judged on the draft
    tokens it had judged, rather than never (the choice drafts for a new version until it was measured:
    :data:`distillspec.decoding.auto_gamma.PROBE_TOKENS`); a window without a single judged token waits for one.
    """

    def __init__(self, window: int, margin: float) -> None:
        self.window, self.margin = window, margin
        #: (version, settings) -> (accepted, judged) of its last ``JUDGED_WINDOWS * window`` completions
        self.recent: dict[tuple[int, DecodingArgs], deque[tuple[int, int]]] = {}
        self.judged: set[int] = set()  #: versions already judged

    def record(self, version: int, stats: dict, args: DecodingArgs) -> None:
        """Count one completion's ``stats`` (:func:`counts_stats`) for ``version`` and the settings ``args`` it was
        made with; plain decoding counts nothing (gamma chosen live that drafted nothing counts: see the class)."""
        judged = stats["accepted"] + stats["rejected"]
        if stats.get("coupled"):  # seeded rows verify by coupling, which accepts at a rate of its own
            return
        if judged or args.gamma == "auto":
            if (version, args) not in self.recent and len(self.recent) >= MAX_SETTINGS:
                del self.recent[next(iter(self.recent))]  # the oldest: clients' settings never grow it unbounded
            recent = self.recent.setdefault((version, args), deque(maxlen=JUDGED_WINDOWS * self.window))
            recent.append((stats["accepted"], judged))

    def alpha(self, version: int, args: DecodingArgs | None = None) -> float | None:
        """Pooled alpha of ``version``'s completions kept with settings ``args`` (None: all settings together); None
        before any draft token was judged."""
        pooled = [x for (v, a), recent in self.recent.items() if v == version and args in (None, a) for x in recent]
        judged = sum(j for _, j in pooled)
        return sum(a for a, _ in pooled) / judged if judged else None

    def verdict(self, version: int, previous: int) -> str | None:
        """The reason to roll ``version`` back to ``previous``, once, as soon as its completions with a reference tell
        (see the class); None otherwise (also once the version passed)."""
        if not self.window or version in self.judged or version == previous:
            return None
        least = max(1, self.window // 4)
        shared = {
            args: recent
            for (v, args), recent in self.recent.items()
            if v == version
            and len(reference := self.recent.get((previous, args), ())) >= least
            and any(j for _, j in reference)
        }
        judged = {args: sum(j for _, j in recent) for args, recent in shared.items()}
        total = sum(judged.values())
        completions = sum(len(recent) for recent in shared.values())
        if completions < self.window or not total:
            return None
        new, new_var = ratio_variance([x for recent in shared.values() for x in recent])
        old = old_var = 0.0
        for args in shared:
            alpha, var = ratio_variance(self.recent[(previous, args)])
            old, old_var = old + judged[args] / total * alpha, old_var + (judged[args] / total) ** 2 * var
        # Were the new version as good as the previous one, its alpha over ``total`` judged tokens would vary at least
        # as a binomial's (the tokens of one completion, correlated, only add to that); its own spread is 0 when the
        # window accepted nothing, however few tokens it judged (a draft at alpha 0.3 rejects 3 in a row a third of
        # the time).
        new_var = max(new_var, old * (1 - old) / total)
        noise = NOISE_Z * math.sqrt(new_var + old_var)
        if new < old - self.margin - noise:
            self.judged.add(version)
            return (
                f"rollback: live alpha {new:.3f} of version {version} < {old:.3f} of version {previous} on the same "
                f"decoding settings - {self.margin:g} - {noise:.3f} (noise) (over {completions} completions)"
            )
        if new >= old - self.margin or completions >= JUDGED_WINDOWS * self.window:
            self.judged.add(version)  # passed (or as long undecided as it may be)
        return None

    def versions(self) -> list[int]:
        return sorted({v for v, _ in self.recent})

    def forget(self, keep: set[int]) -> None:
        """Drop the statistics of versions other than ``keep``."""
        for key in [k for k in self.recent if k[0] not in keep]:
            del self.recent[key]
