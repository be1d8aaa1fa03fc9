"""Speculative decoding (DistillSpec Algorithm A.1; Leviathan et al., 2023) and plain decoding.

Both decoders share one piece of KV-cache bookkeeping, :class:`distillspec.decoding.kvcache.CachedLM`. Rejected
draft positions are never re-run: they stay in the cache as *holes* (attention-mask 0), and every row keeps
its own position counter, so each row of a batch accepts its own number of tokens and stays exact.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from distillspec.config import Compile, DraftContext, Lenience
from distillspec.decoding.auto_gamma import acceptance_by_position
from distillspec.decoding.kvcache import CachedLM, bucketed_capacity
from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.decoding.prompt_cache import PromptCache
from distillspec.decoding.sampling import History, SamplingControls
from distillspec.errors import DistillSpecError
from distillspec.models.draft_vocab import d2t, expand_logits, full_probs, vocab_size

#: Lenience functions ``f(p, epsilon)`` of lossy speculative decoding (paper Sec. 5.2).
LENIENCES: dict[Lenience, Callable[[Tensor, float], Tensor]] = {
    "lin": lambda p, epsilon: p / epsilon,
    "sq": lambda p, epsilon: p / epsilon**2,
    "exp": lambda p, epsilon: p.pow(epsilon),
}


def check_decoding_args(
    *,
    gamma: int = 1,
    max_new_tokens: int | Sequence[int],
    temperature: float,
    lenience: str | None,
    epsilon: float,
) -> None:
    """Raise :class:`DistillSpecError` naming the bad value and the fix."""
    if not isinstance(gamma, int) or gamma < 1:
        raise DistillSpecError(f"gamma={gamma!r}: gamma (draft tokens per block) must be an integer >= 1")
    limits = [max_new_tokens] if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if not limits or not all(isinstance(n, int) and n >= 1 for n in limits):
        raise DistillSpecError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1 (or one per row)")
    if temperature < 0:
        raise DistillSpecError(f"temperature={temperature!r}: must be >= 0 (0 means greedy)")
    if lenience is not None and lenience not in LENIENCES:
        raise DistillSpecError(f"lenience={lenience!r}: choose one of {sorted(LENIENCES)} or None (lossless)")
    if not 0.0 < epsilon <= 1.0:
        raise DistillSpecError(f"epsilon={epsilon!r}: must be in (0, 1]; 1 is lossless")


def check_pair(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """The target and the draft must share one vocabulary (a draft may propose from a part of it: see
    :mod:`distillspec.models.draft_vocab`)."""
    vt, vd = vocab_size(target), vocab_size(draft)
    if vt != vd:
        raise DistillSpecError(f"draft vocab {vd} != target vocab {vt}: the draft and target must share one tokenizer")


def next_token(
    logits: Tensor, temperature: float, generator: torch.Generator | None = None, race: Tensor | None = None
) -> Tensor:
    """Greedy (``temperature == 0``) or sampled next token from ``logits`` [..., V] (``race``: see :func:`sample`)."""
    if temperature == 0:
        return logits.argmax(-1)
    return sample(torch.softmax(logits / temperature, dim=-1), generator, race)


def sample(probs: Tensor, generator: torch.Generator | None = None, race: Tensor | None = None) -> Tensor:
    """One token per row of ``probs`` [..., V] -> [...], token i with probability ``probs[i] / sum(probs)``.

    Unseeded: by inverse transform, one uniform ``u`` a row from ``generator`` and the first token whose cumulative
    mass (summed in float64, so that no token's share moves by more than about 1e-16) exceeds ``u`` times the total:
    a cumulative sum and a binary search. On a CPU that takes under a fifteenth of the time of ``V`` exponential
    draws, and ``torch.multinomial`` draws as slowly as they do (a row of 151,936 tokens on 2 cores: 0.26 against
    4.19 and 4.00 ms; ``python benchmarks/benchmark.py sampler``).
    ``race``: draws ``E ~ Exp(1)`` [..., V] given (:class:`SeededNoise`): the argmax of ``probs / E`` (an exponential
    race), which couples the draft's and the target's choices at a position."""
    if race is not None:
        return (probs / race.clamp(min=torch.finfo(probs.dtype).tiny)).argmax(-1)
    cdf = probs.double().cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[..., -1:]
    # right=True: the first index whose cumulative mass exceeds u, which never lands on a token of mass 0
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class SeededNoise:
    """The random numbers of seeded rows, keyed by (seed, position of the emitted token), not drawn from a stream.

    Every token is sampled by an exponential race (:func:`sample`) whose draws ``E_t`` [V] depend only on the row's
    seed and the token's position ``t`` among the row's new tokens. With these draws speculative decoding verifies by
    *coupling* (:func:`verify` with ``race``): at each position the draft proposes ``argmax(q / E_t)``, the target's
    token is ``argmax(p / E_t)``, and a draft is accepted when the two agree. The emitted token at position ``t`` is
    then the target's own exponential-race sample, whatever gamma the block had, which rows shared the batch, or
    whether the target decoded alone: a seed gives one text. It is exact, since ``E_t`` is independent of the prefix
    it scores. The price is acceptance: two races agree with probability at most ``1 - TVD(p, q)`` (the rejection
    sampler's rate), and at least ``(1 - TVD) / (1 + TVD)``."""

    def __init__(self, seeds: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> None:
        self.seeds, self.vocab, self.device = [int(x) for x in seeds], vocab, torch.device(device)
        #: each row's draws of the positions not emitted yet, by position: a block's drafts that were not accepted
        #: are drafted again at the same positions in the next block, with the same draws
        self.kept: dict[int, dict[int, Tensor]] = {}

    def draws(self, rows: Tensor, positions: Tensor) -> Tensor:
        """``E`` [b, k, V] for original rows ``rows`` [b] at new-token positions ``positions`` [b, k] (each row's
        ascending, and never below an earlier call's first: the positions before it are emitted)."""
        out = torch.empty(*positions.shape, self.vocab, device=self.device)
        for i, row in enumerate(rows.tolist()):
            wanted, kept = positions[i].tolist(), self.kept.setdefault(row, {})
            for t in [t for t in kept if t < wanted[0]]:  # emitted: never drawn again
                del kept[t]
            for j, t in enumerate(wanted):
                if t not in kept:
                    kept[t] = self.draw(self.seeds[row], t)
                out[i, j] = kept[t]
        return out

    def draw(self, seed: int, position: int) -> Tensor:
        """``E_t`` [V] of a row with ``seed`` at new-token ``position``: ``-log(1 - U)`` for uniform ``U`` in 53 bits
        (float64) from a generator keyed by the two, rounded to float32. On a CPU that takes a third of the time of
        torch's ``exponential_`` (151,936 draws on 2 cores: 0.6 against 2.0 ms), which seeded decoding at T > 0 paid
        at every position of every block."""
        key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        generator = torch.Generator(device=self.device).manual_seed(int.from_bytes(key, "little") >> 1)
        uniform = torch.rand(self.vocab, generator=generator, dtype=torch.float64, device=self.device)
        return uniform.neg_().log1p_().neg_().float()


@dataclass
class SpecStats:
    """Per-row statistics of a speculative decoding run (tensors on CPU)."""

    gamma: int  # the most draft tokens a block proposed (with a schedule, blocks may propose fewer)
    blocks: Tensor  # [B] target calls (draft-and-verify blocks) in which the row took part
    drafted: Tensor  # [B] draft tokens proposed
    accepted: Tensor  # [B, gamma] accepted draft tokens, by draft position
    rejected: Tensor  # [B] blocks that ended in a rejection
    new_tokens: Tensor  # [B] tokens emitted after EOS / max_new_tokens truncation
    target_calls: int  # target forward passes for the whole batch (prefill excluded)
    draft_calls: int  # draft forward passes for the whole batch (prefill excluded)
    gammas: list[int] = field(default_factory=list)  # draft tokens of each block, in order

    @property
    def counts(self) -> AcceptanceCounts:
        """The counts pooled over rows, where alpha and tau are defined (one definition for every engine)."""
        return AcceptanceCounts(int(self.blocks.sum()), int(self.accepted.sum()), int(self.rejected.sum()))

    @property
    def alpha(self) -> float:
        """Empirical acceptance rate: accepted / draft tokens that were judged (MLE of alpha)."""
        return self.counts.alpha

    @property
    def tau(self) -> float:
        """Empirical block efficiency: tokens per target call (accepted + 1 per block), at most gamma + 1."""
        return self.counts.tau


@dataclass
class Logprobs:
    """The target's log-probabilities (of its raw distribution, at temperature 1, before any sampling control: what
    vLLM reports by default) of tokens, and the ``k`` likeliest tokens at each position with theirs."""

    token: Tensor  # [B, T]: of each token
    top_ids: Tensor  # [B, T, k]
    top: Tensor  # [B, T, k]


def score_tokens(logits: Tensor, tokens: Tensor, k: int) -> Logprobs:
    """:class:`Logprobs` of ``tokens`` [b, t] under ``logits`` [b, t, V] (the logits that predicted them)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    top = logprobs.topk(k, -1) if k else (logprobs[..., :0], tokens[..., None][..., :0])
    return Logprobs(logprobs.gather(-1, tokens[..., None]).squeeze(-1), top[1], top[0])


@dataclass
class GenerationOutput:
    sequences: Tensor  # [B, prompt_len + max(num_new_tokens)]: prompt, then new tokens, padded after EOS
    num_new_tokens: Tensor  # [B]
    stats: SpecStats | None = None
    logprobs: Logprobs | None = None  # of the new tokens, [B, max(num_new_tokens)] (``logprobs=k``)
    prompt_logprobs: Logprobs | None = None  # of the prompt's tokens after its first, [B, prompt_len - 1]
    cached_prompt_tokens: Tensor | None = None  # [B]: the target's prompt tokens taken from a prompt cache


class GammaSchedule(Protocol):
    """Gamma chosen per block (e.g. :class:`distillspec.decoding.auto_gamma.AutoGamma` for one call): ``choose`` gives
    the next block's gamma (0: the target alone for one token) for a batch of ``batch`` rows that may each emit ``left``
    more tokens, at most the call's ``gamma``, trying another than its best only where ``explore`` (False while the
    draft has yet to read the call's prompt); ``observe`` gets what the block cost (None: a block whose cost is not
    its shape's, such as the first) and yielded: draft tokens accepted and judged by draft position (see
    :func:`~distillspec.decoding.auto_gamma.acceptance_by_position`) and tokens emitted, all rows together."""

    def choose(self, batch: int, explore: bool = True, left: Sequence[int] | None = None) -> int: ...

    def observe(
        self,
        batch: int,
        gamma: int,
        draft_s: float | None,
        verify_s: float | None,
        accepted: Sequence[float],
        judged: Sequence[float],
        tokens: int,
    ) -> None: ...


def step_clock(device: torch.device) -> float:
    """Seconds to time a decoding block's steps by (the costs gamma chosen live plans on). On a GPU: wall-clock, once
    the device has finished the work queued so far (it runs asynchronously). On a CPU where torch runs one thread,
    the calling thread does all of a step's work: its CPU time, which leaves out the time other processes hold the
    cores. Their share of the cores slows every step alike, so it would change no choice, yet it moves one step's
    wall-clock several-fold on a shared machine and, caught in one shape's timings and not another's, turns the
    choice. With more threads, wall-clock (the pool's work is not the calling thread's time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif torch.get_num_threads() == 1:
        return time.thread_time()
    return time.perf_counter()


#: ``on_block(tokens, counts, scores)`` is called after each decoding block with the new tokens so far ([B, max],
#: padded), how many each row has ([B]) and, with ``logprobs``, their :class:`Logprobs` so far (else None); it returns
#: True to stop the whole batch early (a streaming client left, or a stop string was reached).
BlockCallback = Callable[[Tensor, Tensor, "Logprobs | None"], bool | None]


class _Emitter:
    """Collects emitted tokens per original row and retires rows at EOS or their token budget."""

    def __init__(
        self,
        batch: int,
        max_new_tokens: int | Sequence[int],
        eos: list[int],
        pad: int,
        device,
        logprobs: int | None = None,
    ) -> None:
        limits = [max_new_tokens] * batch if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != batch:
            raise DistillSpecError(f"{len(limits)} max_new_tokens values for a batch of {batch} prompts")
        self.limit = torch.tensor(limits, dtype=torch.long, device=device)
        self.out = torch.full((batch, max(limits)), pad, dtype=torch.long, device=device)
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.eos = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self.k = logprobs
        self.scores = None
        if logprobs is not None:
            shape = (batch, max(limits))
            self.scores = Logprobs(
                torch.zeros(shape, device=device),
                torch.zeros(*shape, logprobs, dtype=torch.long, device=device),
                torch.zeros(*shape, logprobs, device=device),
            )

    def emit(self, rows: Tensor, tokens: Tensor, n: Tensor, logits: Tensor | None = None) -> Tensor:
        """Append the first ``n[i]`` of ``tokens[i]`` to original row ``rows[i]`` (with ``logprobs``, scored under
        ``logits``, the target's that predicted them); return a done mask."""
        k = tokens.shape[1]
        offs = torch.arange(k, device=tokens.device)
        take = offs[None, :] < n[:, None]
        if self.eos is not None:  # cut after the first EOS
            is_eos = torch.isin(tokens, self.eos) & take
            first = torch.where(is_eos.any(1), is_eos.float().argmax(1), k)
            take &= offs[None, :] <= first[:, None]
        start = self.count[rows]
        pos = start[:, None] + offs[None, :]
        take &= pos < self.limit[rows][:, None]
        r, c = take.nonzero(as_tuple=True)
        self.out[rows[r], pos[r, c]] = tokens[r, c]
        if self.scores is not None:
            scored = score_tokens(logits[:, :k], tokens, self.k)
            for mine, new in zip(vars(self.scores).values(), vars(scored).values(), strict=True):
                mine[rows[r], pos[r, c]] = new[r, c]
        self.count[rows] = start + take.sum(1)
        done = self.count[rows] >= self.limit[rows]
        if self.eos is not None:
            done |= (torch.isin(tokens, self.eos) & take).any(1)
        return done

    def sequences(self, input_ids: Tensor) -> Tensor:
        """The prompts, then the new tokens, as wide as the longest row's (not the token budget)."""
        return torch.cat([input_ids, self.out[:, : int(self.count.max())]], 1)

    def output(
        self,
        input_ids: Tensor,
        stats: SpecStats | None = None,
        prompt: Logprobs | None = None,
        target: CachedLM | None = None,
    ) -> GenerationOutput:
        """The call's :class:`GenerationOutput` (``target``: the target's :class:`CachedLM`, for what it took from a
        prompt cache)."""
        width = int(self.count.max())
        scores = None if self.scores is None else Logprobs(*(t[:, :width] for t in vars(self.scores).values()))
        cached = None if target is None else target.reused
        return GenerationOutput(self.sequences(input_ids), self.count.clone(), stats, scores, prompt, cached)


@torch.inference_mode()
def score_prompts(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, k: int) -> Logprobs:
    """The prompts' tokens scored under ``model`` (:func:`prompt_scores`), with no token generated."""
    logits = CachedLM(model).prefill(input_ids, _prepare(input_ids, attention_mask), every=True)
    return prompt_scores(logits, input_ids, k)


def prompt_scores(logits: Tensor, input_ids: Tensor, k: int) -> Logprobs:
    """:class:`Logprobs` of each prompt token after the first, from the prefill's logits [B, P, V] (left padding
    scores as any token: the caller keeps the real columns)."""
    return score_tokens(logits[:, :-1], input_ids[:, 1:], k)


def _prepare(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise DistillSpecError(f"input_ids of shape {tuple(input_ids.shape)}: expected [batch, prompt_len >= 1]")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    if not bool(mask[:, -1].all()):
        raise DistillSpecError("prompts must be left-padded: attention_mask[:, -1] must be 1 for every row")
    return mask


def cached_lm(
    model: PreTrainedModel,
    input_ids: Tensor,
    max_new_tokens: int | Sequence[int],
    gamma: int,
    compile: bool,
    prompts: PromptCache | None = None,
) -> CachedLM:
    """The decoder's :class:`CachedLM` for ``model``. With ``compile``, its decoding steps run through
    ``torch.compile`` (a Llama, Mistral or Qwen2 model; see :mod:`distillspec.decoding.kvcache`): on a GPU each new
    batch size or cache capacity compiles once, on a CPU a batch of one and a larger one, and later calls reuse them.
    The capacity is the prompt, the budget and one block, rounded up to 128 columns so that calls with similar prompts
    share it. ``prompts``: the prompt cache its first read takes blocks from and leaves its own in."""
    if not compile:
        return CachedLM(model, prompts=prompts)
    limit = max_new_tokens if isinstance(max_new_tokens, int) else max(max_new_tokens)
    capacity = bucketed_capacity(input_ids.shape[1] + limit + gamma + 1)
    return CachedLM(model, compile=True, capacity=capacity, prompts=prompts)


def generation_defaults(
    model: PreTrainedModel, eos_token_id: int | list[int] | None, pad_token_id: int | None
) -> tuple[list[int], int]:
    """EOS ids and the padding id, from the arguments or, where None, from the model's ``generation_config`` (as
    ``generate`` does). Returns the EOS ids (empty: decode to the budget) and the padding value."""
    config = getattr(model, "generation_config", None)
    if eos_token_id is None and config is not None:
        eos_token_id = config.eos_token_id
    if pad_token_id is None and config is not None:
        pad_token_id = config.pad_token_id
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return eos, pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)


@torch.inference_mode()
def autoregressive_generate(
    model: PreTrainedModel,
    input_ids: Tensor,
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    attention_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
    on_block: BlockCallback | None = None,
    compile: bool = False,
    seeds: Sequence[int] | None = None,
    controls: SamplingControls | None = None,
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
    prompt_cache: PromptCache | None = None,
) -> GenerationOutput:
    """Plain one-token-per-call decoding with the same cache code as :func:`speculative_generate`
    (``max_new_tokens``: one budget, or one per row; ``on_block``: see :data:`BlockCallback`; ``compile``: see
    :func:`cached_lm`; ``seeds``: one per row, each row's sample keyed by its seed, see :class:`SeededNoise`;
    ``controls``: see :mod:`distillspec.decoding.sampling`; ``logprobs``, ``prompt_logprobs`` and ``prompt_cache``:
    see :func:`speculative_generate`)."""
    check_decoding_args(max_new_tokens=max_new_tokens, temperature=temperature, lenience=None, epsilon=1.0)
    mask = _prepare(input_ids, attention_mask)
    noise = _seeded(seeds, len(input_ids), temperature, None, model, input_ids.device)
    history = _history(controls, input_ids, mask, model)
    lm = cached_lm(model, input_ids, max_new_tokens, 0, compile, prompt_cache)
    eos, pad = generation_defaults(model, eos_token_id, pad_token_id)
    emitter = _Emitter(len(input_ids), max_new_tokens, eos, pad, input_ids.device, logprobs)
    rows = torch.arange(len(input_ids), device=input_ids.device)
    # A model with a draft vocabulary samples an index into it; with controls, a token of the whole vocabulary.
    restricted, vocab = d2t(model), vocab_size(model)
    ids = restricted if history is None else None
    logits, prompt = _prefill(lm, input_ids, mask, logprobs if prompt_logprobs else None)
    while True:
        raw = logits[:, None]
        if history is not None:
            history.observe(emitter.out, emitter.count)
            logits = history.process(expand_logits(logits, restricted, vocab)[:, None], rows, temperature)[:, 0]
        race = None if noise is None else noise.draws(rows, emitter.count[rows][:, None])[:, 0]
        if race is not None and ids is not None:
            race = race[:, ids]
        token = next_token(logits, temperature, generator, race)
        token = token if ids is None else ids[token]
        done = emitter.emit(rows, token[:, None], torch.ones_like(token), raw)
        if bool(done.all()) or (on_block is not None and on_block(emitter.out, emitter.count, emitter.scores)):
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            rows, token = rows[keep], token[keep]
            lm.select_rows(keep)
        logits = lm.step(token[:, None])[:, -1]
    return emitter.output(input_ids, prompt=prompt, target=lm)


def _prefill(lm: CachedLM, input_ids: Tensor, mask: Tensor, k: int | None) -> tuple[Tensor, Logprobs | None]:
    """The prompt's last logits [B, V], and with ``k`` (prompt log-probs asked for) its tokens' scores."""
    if k is None:
        return lm.prefill(input_ids, mask), None
    logits = lm.prefill(input_ids, mask, every=True)
    return logits[:, -1], prompt_scores(logits, input_ids, k)


def _start(
    tgt: CachedLM, drf: CachedLM, input_ids: Tensor, mask: Tensor, k: int | None
) -> tuple[Tensor, Logprobs | None]:
    """The target reads the whole prompt now: its last logits [B, 1, V] give the first token, as plain decoding's
    do (the call's first block drafts nothing and needs no target call, so the first token comes as soon as the
    target alone's would); with ``k``, the prompt's scores too (:func:`_prefill`). The draft reads the prompt lazily,
    with its first drafts: a call whose blocks all draft nothing never runs the draft."""
    first_logits, prompt = _prefill(tgt, input_ids, mask, k)
    drf.mask, drf.next_pos = input_ids.new_zeros(len(input_ids), 0), input_ids.new_zeros(len(input_ids))
    tgt.calls = drf.calls = 0
    return first_logits[:, None], prompt


def _score(
    tgt: CachedLM,
    first_logits: Tensor | None,
    target_in: Tensor,
    drafts: Tensor,
    history: History | None,
    rows: Tensor,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """The target's logits [b, g + 1, V] for a block's drafts and the position after them, as the model gave them
    and as the sampling controls process them (the same tensor without a ``history``): one call on the tokens it
    has not read and the drafts; the first block's first position comes from the prompt's last logits."""
    if first_logits is None:
        raw = tgt.step(torch.cat([target_in, drafts], 1))
    else:
        raw = torch.cat([first_logits, tgt.step(drafts)], 1) if drafts.shape[1] else first_logits
    return raw, (raw if history is None else history.process(raw, rows, temperature, drafts))


def _draft(
    drf: CachedLM,
    draft_in: Tensor,
    draft_valid: Tensor,
    g: int,
    emitter: _Emitter,
    rows: Tensor,
    noise: SeededNoise | None,
    history: History | None,
    temperature: float,
    generator: torch.Generator | None,
    compile: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Step 1 of a block on rows ``rows``: :func:`draft_tokens` after the sampling controls saw what was emitted;
    seeded rows draw the random numbers of the block's g + 1 positions first. Returns the drafts, their q and the
    draws (None without seeds)."""
    race = None
    if noise is not None:
        race = noise.draws(rows, emitter.count[rows][:, None] + torch.arange(g + 1, device=rows.device))
    if history is not None:
        history.observe(emitter.out, emitter.count)
    drafts, q = draft_tokens(drf, draft_in, draft_valid, g, temperature, generator, compile, race, history, rows)
    return drafts, q, race


def _emitted(drafts: Tensor, n: Tensor, new: Tensor) -> Tensor:
    """A block's tokens [b, g + 1]: the accepted drafts d_1..d_n, then the new token (after it: ignored)."""
    emitted = torch.cat([drafts, new[:, None]], 1)
    return emitted.scatter_(1, n[:, None], new[:, None])


def _history(controls: SamplingControls | None, input_ids: Tensor, mask: Tensor, model) -> History | None:
    """The :class:`~distillspec.decoding.sampling.History` of a call with sampling controls that change a
    distribution."""
    if controls is None or not controls.active:
        return None
    controls.check(vocab_size(model))
    return History(controls, input_ids, mask, vocab_size(model))


def _seeded(
    seeds: Sequence[int] | None, batch: int, temperature: float, lenience: str | None, model, device
) -> SeededNoise | None:
    """The :class:`SeededNoise` of a call with ``seeds`` (None: no seeds, or greedy, which needs no random numbers)."""
    if seeds is None or temperature == 0:
        return None
    if len(seeds) != batch:
        raise DistillSpecError(f"{len(seeds)} seeds for a batch of {batch} prompts")
    if lenience is not None:
        raise DistillSpecError(
            f"lenience={lenience!r} with seeds: seeded rows verify by coupling, which is lossless only; run lossy "
            "speculative decoding with a generator"
        )
    return SeededNoise(seeds, vocab_size(model), device)


def verify(
    target_logits: Tensor,
    drafts: Tensor,
    q: Tensor | None,
    temperature: float,
    lenience: str | None = None,
    epsilon: float = 1.0,
    generator: torch.Generator | None = None,
    race: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The accept/reject step of speculative decoding for one block.

    ``target_logits`` [b, gamma+1, V] are the target's logits at the ``gamma`` draft positions and the one after;
    ``drafts`` [b, gamma] the draft tokens, sampled from ``q`` [b, gamma, V] (the draft's probabilities at
    ``temperature``; None when ``temperature == 0``). Draft ``j`` is accepted with probability
    ``min(1, f(p_j(d_j), epsilon) / q_j(d_j))``, while all before it were; after ``n`` accepted, the next token is
    drawn from ``norm(max(0, p_{n+1} - q_{n+1}))`` (``p_{gamma+1}`` when all were). Greedy: accept while the argmaxes
    agree, then the target's argmax. With ``race`` [b, gamma+1, V] (:class:`SeededNoise`; the drafts were raced with
    the same draws): accept while the drafts equal the target's races, then the target's race. Returns ``n`` [b]
    (drafts accepted) and the next token [b]."""
    gamma = drafts.shape[1]
    if temperature == 0 or race is not None:  # greedy, or coupled: each position's token is the target's own
        best = (
            target_logits.argmax(-1)
            if temperature == 0
            else sample(torch.softmax(target_logits / temperature, -1), race=race)
        )
        n = (drafts == best[:, :gamma]).long().cumprod(1).sum(1)
        return n, best.gather(1, n[:, None]).squeeze(1)
    p = torch.softmax(target_logits / temperature, dim=-1)
    if gamma == 0:
        return drafts.new_zeros(len(drafts)), sample(p[:, 0], generator)
    f = LENIENCES[lenience] if lenience is not None else (lambda p, _eps: p)
    p_d = p[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
    r = torch.rand(drafts.shape, generator=generator, device=drafts.device)
    ok = r < (f(p_d, epsilon) / q_d).clamp(max=1.0)  # q_d > 0: d was sampled from q
    n = ok.long().cumprod(1).sum(1)  # leading accepted drafts per row
    idx = n[:, None, None].expand(-1, 1, p.shape[-1])
    p_next = p.gather(1, idx).squeeze(1)
    q_next = q.gather(1, idx.clamp(max=gamma - 1)).squeeze(1)  # q is 0 after the last draft (all accepted)
    residual = torch.where((n < gamma)[:, None], p_next - q_next, p_next).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    return n, sample(residual, generator)


def draft_tokens(
    drf: CachedLM,
    x: Tensor,
    valid: Tensor | None,
    g: int,
    temperature: float,
    generator: torch.Generator | None = None,
    compile: bool = False,
    race: Tensor | None = None,
    history: History | None = None,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Step 1 of a block: ``g`` tokens from the draft, one call each, after it read ``x`` (the tokens it has not read
    yet; ``valid``: 0 at holes). Returns the drafts [b, g] and their distributions q [b, g, V] on the whole
    vocabulary (None at ``temperature == 0``: greedy drafts, and with ``race``: drafts raced with those draws, see
    :class:`SeededNoise`). A draft with a draft vocabulary samples inside it. With a ``history`` (of the call's
    rows ``rows``), each step's logits are processed by the sampling controls after the drafts before it."""
    q, drafts = [], []
    restricted, vocab = d2t(drf.model), vocab_size(drf.model)
    ids = restricted if history is None else None  # with controls, drafts sample on the whole vocabulary
    for j in range(g):
        # Compiled steps attend over every column of the cache; a wide catch-up (the prompt) runs eagerly.
        logits = drf.step(x, valid, last_only=not compile or x.shape[1] > 2)[:, -1]
        if history is not None:
            full = expand_logits(logits, restricted, vocab)[:, None]
            logits = history.process(full, rows, temperature, torch.stack(drafts, 1) if drafts else None)[:, 0]
        if temperature == 0:
            d_j = logits.argmax(-1)
        elif race is not None:
            d_j = sample(
                torch.softmax(logits / temperature, -1), race=race[:, j] if ids is None else race[:, j][:, ids]
            )
        else:
            q_j = torch.softmax(logits / temperature, dim=-1)
            d_j = sample(q_j, generator)
            q.append(full_probs(q_j, ids, vocab))
        d_j = d_j if ids is None else ids[d_j]
        drafts.append(d_j)
        x, valid = d_j[:, None], None
    return (torch.stack(drafts, 1) if g else x[:, :0]), (torch.stack(q, 1) if q else None)


def _rewind(
    tgt: CachedLM, drf: CachedLM, drafts: Tensor, n: Tensor, new: Tensor, draft_in: Tensor, draft_valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """After a block (``drafts`` [b, g], ``n`` accepted, then ``new``): both caches drop the drafts that were not
    accepted, and the inputs of the next block are returned: the target's (the new token), the draft's and its
    validity. The draft has not read its last draft (read only when all were accepted: a hole otherwise) nor the new
    token; after a block that drafted nothing, it has read none of that block's input either."""
    g = drafts.shape[1]
    tgt.reject_tail(g - n)  # the target read its input, d_1..d_g; it keeps d_1..d_n
    if g:
        drf.reject_tail((g - 1 - n).clamp(min=0))  # the draft read its input, d_1..d_{g-1}
        return new[:, None], torch.stack([drafts[:, -1], new], 1), torch.stack([(n == g).long(), torch.ones_like(n)], 1)
    ones = torch.ones_like(new[:, None])
    return new[:, None], torch.cat([draft_in, new[:, None]], 1), torch.cat([draft_valid, ones], 1)


class _Tally:
    """Per row of the call: blocks, drafts, accepted drafts by position, blocks that ended in a rejection."""

    def __init__(self, batch: int, gamma: int, device: torch.device) -> None:
        self.blocks, self.drafted, self.rejected = (
            torch.zeros(batch, dtype=torch.long, device=device) for _ in range(3)
        )
        self.accepted = torch.zeros(batch, gamma, dtype=torch.long, device=device)
        self.gammas: list[int] = []

    def add(self, rows: Tensor, g: int, n: Tensor) -> None:
        """A block of ``g`` drafts, ``n`` accepted, on rows ``rows``. Every draft the target judged counts, also past
        the row's budget in its last block (as vLLM counts them)."""
        self.gammas.append(g)
        self.blocks[rows] += 1
        self.drafted[rows] += g
        self.accepted[rows, :g] += (torch.arange(g, device=n.device)[None, :] < n[:, None]).long()
        self.rejected[rows] += (n < g).long()

    def stats(self, gamma: int, new_tokens: Tensor, target_calls: int, draft_calls: int) -> SpecStats:
        return SpecStats(
            gamma=gamma,
            blocks=self.blocks.cpu(),
            drafted=self.drafted.cpu(),
            accepted=self.accepted.cpu(),
            rejected=self.rejected.cpu(),
            new_tokens=new_tokens.cpu(),
            target_calls=target_calls,
            draft_calls=draft_calls,
            gammas=self.gammas,
        )


class _Blocks:
    """Each block's gamma: the call's, or what ``schedule`` chooses; the schedule is then told what the block cost
    (drafting, then verifying and its bookkeeping) and yielded."""

    def __init__(self, gamma: int, schedule: GammaSchedule | None, device: torch.device) -> None:
        self.gamma, self.schedule, self.device = gamma, schedule, device
        self.start = self.drafted_at = 0.0
        self.typical = False

    def choose(self, rows: Tensor, emitter: _Emitter, *, draft_calls: int) -> int:
        if self.schedule is None:
            return self.gamma
        # the tokens each row may still emit: a row near its budget gains nothing from more drafts
        left = (emitter.limit[rows] - emitter.count[rows]).tolist()
        g = self.schedule.choose(len(rows), explore=draft_calls > 0, left=left)
        # What a block of this shape costs, but for the one whose draft reads the prompt.
        self.typical = g == 0 or draft_calls > 0
        self.start = step_clock(self.device)
        return g

    def drafted(self) -> None:
        if self.schedule is not None:
            self.drafted_at = step_clock(self.device)

    def observe(self, batch: int, g: int, n: Tensor) -> None:
        if self.schedule is None:
            return
        took = n.tolist()
        seconds = (
            (self.drafted_at - self.start, step_clock(self.device) - self.drafted_at) if self.typical else (None,) * 2
        )
        self.schedule.observe(batch, g, *seconds, *acceptance_by_position([g] * batch, took), sum(took) + batch)


def _retire(done: Tensor, caches: tuple[CachedLM, ...], *rows_first: Tensor) -> tuple[Tensor, ...]:
    """Rows whose ``done`` is set leave the batch: the caches and each of ``rows_first`` (tensors with a row per
    batch row) keep the others."""
    keep = (~done).nonzero().squeeze(1)
    for cache in caches:
        cache.select_rows(keep)
    return tuple(t[keep] for t in rows_first)


#: ``draft_context="auto"`` on a CPU: the draft reads at most this many of a prompt's last tokens for each new token a
#: row may emit, and never fewer than :data:`AUTO_CONTEXT_MIN` (see :func:`auto_draft_context`).
AUTO_CONTEXT_PER_TOKEN = 5
AUTO_CONTEXT_MIN = 512


def auto_draft_context(draft: PreTrainedModel, max_new_tokens: int | Sequence[int]) -> int | None:
    """What ``draft_context="auto"`` has the draft read of each prompt: on a CPU, its last
    ``max(AUTO_CONTEXT_MIN, AUTO_CONTEXT_PER_TOKEN * N)`` tokens, N the most new tokens a row may emit; elsewhere all of
    it (None). On a CPU a draft reads a prompt at the rate of its matrix products, and what its drafts save is bounded
    by the tokens they propose: the 0.5B Qwen draft read a token in about 2 ms on 2 cores, a twentieth of the 1.5B
    target's step, where speculative decoding saved about half a target step a token, so reading more than about ten
    times the new tokens could not pay. Over ~1,550-token prompts and 96 new tokens it ran 1.30-1.78x the target alone
    reading the last 512 tokens and 0.72-0.92x reading all (docs/MEASUREMENTS.md). On a GPU a prompt's reading costs
    little beside the steps."""
    if draft.device.type != "cpu":
        return None
    most = max(max_new_tokens) if isinstance(max_new_tokens, Sequence) else int(max_new_tokens)
    return max(AUTO_CONTEXT_MIN, AUTO_CONTEXT_PER_TOKEN * most)


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: Tensor,
    *,
    gamma: int,
    max_new_tokens: int | Sequence[int],
    temperature: float = 1.0,
    lenience: str | None = None,
    epsilon: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    attention_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
    on_block: BlockCallback | None = None,
    compile: Compile = False,
    schedule: GammaSchedule | None = None,
    seeds: Sequence[int] | None = None,
    controls: SamplingControls | None = None,
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
    draft_context: DraftContext = None,
    prompt_cache: PromptCache | None = None,
) -> GenerationOutput:
    """Sample from ``target`` with ``draft`` proposing ``gamma`` tokens per target call.

    Lossless when ``lenience`` is None: the output follows the target's distribution at ``temperature`` exactly
    (``temperature=0`` reproduces the target's greedy output). Lossy with ``lenience`` in ``{"lin", "sq", "exp"}``: see
    :func:`verify`. ``max_new_tokens`` is one budget or one per row; ``on_block`` streams (see :data:`BlockCallback`).
    ``compile`` runs both models' decoding steps through ``torch.compile`` (see :func:`cached_lm`); ``compile="draft"``
    the draft's alone: a small draft's step is the one whose operators cost most beside its products (on a CPU, the 0.5B
    Qwen draft's compiled step took 0.82x its eager one), and each of the target's shapes would compile anew. With a
    ``schedule``, each block drafts the number of tokens it chooses, 0 to ``gamma`` (0: the target alone emits one
    token; the draft catches up at its next block), and the schedule is told what each block cost and yielded. With
    ``seeds`` (one per row, lossless only) each row's random numbers are keyed by its seed and the token's position, and
    blocks verify by coupling (:class:`SeededNoise`): a row's text depends on its seed alone, not on gamma, the schedule
    or the other rows. ``controls`` (top-p, penalties, ...; see :mod:`distillspec.decoding.sampling`) process the
    draft's and the target's logits alike: exact for the processed target. ``logprobs=k`` scores the new tokens under
    the target (:class:`Logprobs`, with the ``k`` likeliest tokens at each position); ``prompt_logprobs`` scores the
    prompt's too. ``draft_context=N``: the draft reads only the last ``N`` tokens of each prompt (the target reads it
    all): on a long prompt the draft's own reading of it is a cost the target alone does not pay, and its proposals
    depend mostly on the recent tokens; the output stays the target's. ``"auto"``: :func:`auto_draft_context`.
    ``prompt_cache`` (:class:`~distillspec.decoding.prompt_cache.PromptCache`): each model reads only the part of a
    prompt after the blocks of it that the cache holds (a system prompt, a conversation's earlier turns), and leaves
    the blocks it read there; not with ``prompt_logprobs``, whose prompt is read whole.
    """
    if draft_context == "auto":
        draft_context = auto_draft_context(draft, max_new_tokens)
    elif draft_context is not None and (isinstance(draft_context, str) or draft_context < 1):
        raise DistillSpecError(f"draft_context must be a positive number of tokens, auto or None, not {draft_context}")
    check_decoding_args(
        gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, lenience=lenience, epsilon=epsilon
    )
    check_pair(target, draft)
    mask = _prepare(input_ids, attention_mask)
    dev, batch = input_ids.device, len(input_ids)
    noise = _seeded(seeds, batch, temperature, lenience, target, dev)
    history = _history(controls, input_ids, mask, target)
    tgt = cached_lm(target, input_ids, max_new_tokens, gamma, compile is True, prompt_cache)
    drf = cached_lm(draft, input_ids, max_new_tokens, gamma, bool(compile), prompt_cache)
    first_logits, prompt = _start(tgt, drf, input_ids, mask, logprobs if prompt_logprobs else None)
    eos, pad = generation_defaults(target, eos_token_id, pad_token_id)
    emitter, tally = _Emitter(batch, max_new_tokens, eos, pad, dev, logprobs), _Tally(batch, gamma, dev)
    blocks, rows = _Blocks(gamma, schedule, dev), torch.arange(batch, device=dev)
    target_in = input_ids[:, :0]  # the emitted tokens the target has not read: none yet
    # The draft's input: the tokens it has not read (the prompt; later the last emitted one: see _rewind). Holes: 0.
    draft_in, draft_valid, finished = input_ids, mask.long(), False
    if draft_context is not None:  # the prompts are left-padded: each row's last tokens are its last columns
        draft_in, draft_valid = draft_in[:, -draft_context:], draft_valid[:, -draft_context:]

    while not finished:
        # The first block drafts nothing: its token comes from the prompt's last logits (see _start), no target call.
        first_block = first_logits is not None
        g = 0 if first_block else blocks.choose(rows, emitter, draft_calls=drf.calls)
        # 1. Draft g tokens autoregressively (seeded rows: with the draws of the block's g + 1 positions).
        drafts, q, race = _draft(
            drf, draft_in, draft_valid, g, emitter, rows, noise, history, temperature, generator, bool(compile)
        )
        blocks.drafted()
        # 2. One target call scores the g drafts and the position after them; 3-4. accept, then the next token.
        raw, target_logits = _score(tgt, first_logits, target_in, drafts, history, rows, temperature)  # [b, g+1, V]
        first_logits = None
        n, new = verify(target_logits, drafts, q, temperature, lenience, epsilon, generator, race)
        # 5. Emit d_1..d_n and the new token, count the block (a target call); both caches forget the drafts not
        # accepted.
        if not first_block:
            tally.add(rows, g, n)
        done = emitter.emit(rows, _emitted(drafts, n, new), n + 1, raw)
        if on_block is not None and on_block(emitter.out, emitter.count, emitter.scores):
            done = torch.ones_like(done)
        target_in, draft_in, draft_valid = _rewind(tgt, drf, drafts, n, new, draft_in, draft_valid)
        finished = bool(done.all())
        if not finished and bool(done.any()):
            rows, target_in, draft_in, draft_valid = _retire(done, (tgt, drf), rows, target_in, draft_in, draft_valid)
        if not first_block:
            blocks.observe(len(drafts), g, n)  # the whole block: drafting, then verifying and its bookkeeping

    return emitter.output(input_ids, tally.stats(gamma, emitter.count, tgt.calls, drf.calls), prompt, tgt)
