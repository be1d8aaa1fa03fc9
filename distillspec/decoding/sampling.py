"""Sampling controls as vLLM's sampler applies them (OpenAI's ``top_p``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``; vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``),
kept exact under speculative decoding.

The controls turn a model's logits at a position into the *processed* distribution that is sampled from, in
vLLM's order: ``logit_bias`` is added; the penalties see the tokens generated so far (``repetition_penalty`` also
the prompt's): a repeated token's positive logit is divided by ``repetition_penalty`` and a negative one multiplied,
``frequency_penalty`` times its count and ``presence_penalty`` once are subtracted; then, at the temperature,
``min_p`` drops tokens less likely than ``min_p`` times the likeliest, ``top_k`` keeps the ``k`` likeliest and
``top_p`` the smallest set of likeliest tokens whose mass reaches ``top_p``. Greedy decoding (T = 0) takes the
argmax of the biased and penalised logits (truncation never removes it).

Speculative decoding stays exact for the processed target: at each position of a block, the draft's and the
target's logits are processed alike, with the penalties seeing the tokens emitted so far *and* the block's drafts
before that position (:class:`History`). The processed distribution at a position is a function of the prefix
alone, so the rejection sampler reproduces the chain of processed target distributions, as it does the plain one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from distillspec.errors import DistillSpecError


@dataclass(frozen=True)
class SamplingControls:
    """The controls of a call, shared by its rows (each row's penalties see its own tokens). The defaults change
    nothing. ``logit_bias``: ``(token id, bias)`` pairs; ``stop_token_ids``: tokens that end a row as EOS does."""

    top_p: float = 1.0
    top_k: int = 0  #: 0 (or -1, as vLLM takes it): every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, logit_bias: Mapping[int | str, float] | None = None, **kw) -> SamplingControls:
        """From keyword values as requests give them (``logit_bias`` a mapping of token id, or its string, to bias;
        ``top_k`` -1 for off; None for a default)."""
        kw = {k: v for k, v in kw.items() if v is not None}
        if kw.get("top_k") == -1:
            kw["top_k"] = 0
        if "stop_token_ids" in kw:
            kw["stop_token_ids"] = tuple(int(t) for t in kw["stop_token_ids"])
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
        except ValueError:
            raise DistillSpecError("logit_bias: its keys must be token ids (integers)") from None
        return cls(logit_bias=bias, **kw)

    @property
    def penalised(self) -> bool:
        """Whether the processed logits depend on the tokens so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def active(self) -> bool:
        """Whether the controls change any distribution (``stop_token_ids`` change where rows end, not what they
        sample)."""
        truncated = self.top_p < 1 or self.top_k > 0 or self.min_p > 0
        return truncated or self.penalised or bool(self.logit_bias)

    def check(self, vocab: int | None = None) -> None:
        """Raise :class:`DistillSpecError` naming the bad value (token ids against ``vocab`` where given)."""
        if not 0 < self.top_p <= 1:
            raise DistillSpecError(f"top_p={self.top_p}: must be in (0, 1]; 1 keeps every token")
        if self.top_k < 0:
            raise DistillSpecError(f"top_k={self.top_k}: must be >= 1, or 0 or -1 for every token")
        if not 0 <= self.min_p <= 1:
            raise DistillSpecError(f"min_p={self.min_p}: must be in [0, 1]; 0 keeps every token")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise DistillSpecError(f"{name}={getattr(self, name)}: must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2 or not math.isfinite(self.repetition_penalty):
            raise DistillSpecError(f"repetition_penalty={self.repetition_penalty}: must be in (0, 2]; 1 is none")
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise DistillSpecError(f"logit_bias: {bias} for token {token}: a bias must be in [-100, 100]")
        if vocab is not None:
            for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
                if bad := [t for t in ids if not 0 <= t < vocab]:
                    raise DistillSpecError(f"{name}: token ids {bad} are outside the vocabulary [0, {vocab})")


class History:
    """The tokens each row of a call has seen, for the controls' penalties: the prompt's (for
    ``repetition_penalty``) and the generated ones (counts, for all three). :meth:`process` gives the processed
    logits of a block's positions, each seeing the block's drafts before it."""

    def __init__(self, controls: SamplingControls, input_ids: Tensor, mask: Tensor, vocab: int) -> None:
        self.controls, self.vocab = controls, vocab
        device = input_ids.device
        self.bias = None
        if controls.logit_bias:
            self.bias = torch.zeros(vocab, device=device)
            ids, values = zip(*controls.logit_bias, strict=True)
            self.bias[list(ids)] = torch.tensor(values, device=device)
        self.prompt = None
        if controls.repetition_penalty != 1:
            self.prompt = torch.zeros(len(input_ids), vocab, dtype=torch.bool, device=device)
            r, c = mask.nonzero(as_tuple=True)
            self.prompt[r, input_ids[r, c]] = True
        self.counts = torch.zeros(len(input_ids), vocab, device=device)

    def observe(self, tokens: Tensor, counts: Tensor) -> None:
        """The generated tokens of every row of the call so far (``tokens`` [B, max], the first ``counts[i]`` of
        row ``i``), as :data:`~distillspec.decoding.speculative.BlockCallback` gets them."""
        if not self.controls.penalised:
            return
        taken = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < counts[:, None]
        self.counts.zero_().scatter_add_(1, tokens, taken.float())

    def process(self, logits: Tensor, rows: Tensor, temperature: float, drafts: Tensor | None = None) -> Tensor:
        """The processed logits of ``logits`` [b, k, V] (rows ``rows`` of the call) after the row's tokens and the
        block's ``drafts`` [b, m] (m >= k - 1): the last position sees all ``m``, each one before it one fewer (the
        target's ``gamma + 1`` positions after ``gamma`` drafts; a draft step's one position after the drafts so far).
        Softmax of them at ``temperature`` is the distribution sampled from (argmax, greedily)."""
        c = self.controls
        out = logits.float()
        if self.bias is not None:
            out = out + self.bias
        if c.penalised:
            counts = self.counts[rows][:, None]  # [b, 1, V]: the row's tokens so far, the same at every position
            prompt = None if self.prompt is None else self.prompt[rows][:, None]
            biased, out = out, penalise(out, counts, prompt, c)
            if drafts is not None and drafts.shape[1]:  # the drafts' own tokens count more at the positions after them
                out = self._after_drafts(biased, out, counts, prompt, drafts)
        return truncate(out, temperature, c) if temperature > 0 else out

    def _after_drafts(self, biased: Tensor, out: Tensor, counts: Tensor, prompt: Tensor | None, drafts: Tensor):
        """``out`` [b, k, V] (penalised after the row's tokens) with the entries of the drafts' tokens penalised again
        after the drafts each position sees: the first ``m - k + 1 + i`` of the ``m`` at position ``i`` (draft ``t``
        from position ``t - m + k``). Only those ``m`` tokens a position change, so only they are recomputed, from the
        ``biased`` logits."""
        (b, k), m = out.shape[:2], drafts.shape[1]
        first = (torch.arange(m, device=out.device) - m + k).clamp(min=0)
        sees = torch.arange(k, device=out.device)[:, None] >= first  # [k, m]: position i sees draft t
        same = drafts[:, :, None] == drafts[:, None, :]  # [b, m, m]: draft j's token is draft t's
        extra = (same[:, None] & sees[None, :, None]).sum(-1)  # [b, k, m]: draft j's token among those position i sees
        tokens = drafts[:, None].expand(b, k, m)
        seen = None if prompt is None else prompt.expand(b, k, -1).gather(-1, tokens)
        again = penalise(
            biased.gather(-1, tokens), counts.expand(b, k, -1).gather(-1, tokens) + extra, seen, self.controls
        )
        return out.scatter_(-1, tokens, again)  # a token drafted twice gets one value, its count the same at both


def penalise(logits: Tensor, counts: Tensor, prompt: Tensor | None, c: SamplingControls) -> Tensor:
    """vLLM's penalties: ``counts`` [..., V] of each token among the generated ones, ``prompt`` [..., V] whether it is
    in the prompt (for ``repetition_penalty``)."""
    if c.repetition_penalty != 1:
        seen = counts > 0 if prompt is None else (counts > 0) | prompt
        scaled = torch.where(logits > 0, logits / c.repetition_penalty, logits * c.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    return logits - c.frequency_penalty * counts - c.presence_penalty * (counts > 0).float()


def truncate(logits: Tensor, temperature: float, c: SamplingControls) -> Tensor:
    """``logits`` with ``-inf`` outside what ``min_p``, ``top_k`` then ``top_p`` keep at ``temperature`` (> 0)."""
    if c.min_p > 0:
        probs = torch.softmax(logits / temperature, -1)
        logits = logits.masked_fill(probs < c.min_p * probs.amax(-1, keepdim=True), -math.inf)
    if 0 < c.top_k < logits.shape[-1]:
        kth = logits.topk(c.top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if c.top_p < 1:
        probs = torch.softmax(logits / temperature, -1)
        logits = logits.masked_fill(probs < nucleus_floor(probs, c.top_p), -math.inf)
    return logits


#: The likeliest tokens of a row that :func:`nucleus_floor` searches first: at the temperatures and ``top_p`` clients
#: send they usually hold the nucleus, and a partial sort of them costs little beside a sort of the whole vocabulary
#: (the Qwen pair at ``top_p = 0.9``, T = 1, 2 CPU cores: 15 ms of a speculative block truncating against 143 ms;
#: ``python benchmarks/benchmark.py sampler``).
NUCLEUS_CANDIDATES = 1024


def nucleus_floor(probs: Tensor, top_p: float) -> Tensor:
    """[..., 1]: the least probability ``top_p`` keeps in each row of ``probs`` [..., V]. A token stays where the
    tokens likelier than it hold less than ``top_p`` of the mass (so the likeliest always does), as vLLM's sampler
    drops the least likely while their mass stays within ``1 - top_p``. Searched among each row's
    :data:`NUCLEUS_CANDIDATES` likeliest tokens when they hold ``top_p`` in every row (then no token past them
    stays), else among 16 times as many, up to the whole row. Tokens tied with the floor all stay."""
    vocab = probs.shape[-1]
    k = min(NUCLEUS_CANDIDATES, vocab)
    while True:
        values = probs.topk(k, -1).values  # descending
        mass = values.cumsum(-1)
        if k == vocab or bool((mass[..., -1] >= top_p).all()):
            break
        k = min(16 * k, vocab)
    kept = (mass - values < top_p).sum(-1, keepdim=True)  # a leading run: the likelier mass only grows
    return values.gather(-1, kept - 1)
