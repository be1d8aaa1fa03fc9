"""A draft vocabulary: the draft's output layer keeps only the ``V`` most frequent tokens (FR-Spec, arXiv
2502.14856; EAGLE-3's ``d2t`` map), so that a drafting step reads ``V`` rows of the head instead of the whole
vocabulary's.

The draft still reads every token (its input embeddings are whole); only what it proposes is restricted. Its head
is a :class:`DraftHead`: a ``Linear(hidden, V)`` with ``d2t`` [V], the target token id of each of its rows.
Speculative decoding stays exact: a draft that gives zero probability outside its vocabulary never proposes those
tokens, and the residual ``max(0, p - q)`` then equals ``p`` there (:func:`full_probs` puts the draft's
distribution back on the whole vocabulary for the verifier).

Training (:func:`restrict_target`): the target's distribution is *conditioned on the draft vocabulary* (its logits
gathered at ``d2t``, renormalised). Among drafts that give no mass outside ``V``, that is the minimiser of FKL,
RKL, JSD and TVD alike, and it is the one that maximises the acceptance rate ``sum_V min(p, q)``; the mass the
target puts outside ``V`` is lost to acceptance whatever the draft does (``1 - E[TVD]`` over the whole vocabulary,
:func:`expand_logits`, counts it).

A restricted draft is saved with ``save_pretrained`` as usual: its ``config.json`` gains ``draft_vocab_size`` and
its weights hold ``lm_head.weight`` [V, hidden] and ``lm_head.d2t`` [V]; :func:`distillspec.models.loading.load_model`
rebuilds it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from distillspec.errors import DistillSpecError
from distillspec.training.divergences import TopKLogprobs

#: The ``config.json`` key that marks a draft with a restricted vocabulary (its value: ``V``).
CONFIG_KEY = "draft_vocab_size"


class DraftHead(nn.Linear):
    """The output layer of a draft with a restricted vocabulary: ``V`` rows, and ``d2t`` [V] (long), the target
    token id of each row (saved with the weights)."""

    def __init__(self, hidden: int, d2t: Tensor, *, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__(hidden, len(d2t), bias=bias, device=device, dtype=dtype)
        self.register_buffer("d2t", d2t.to(device=device, dtype=torch.long).clone())


def d2t(model: nn.Module) -> Tensor | None:
    """The draft-to-target token map of ``model``'s head, or None for a model whose head covers the vocabulary."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    ids = getattr(head, "d2t", None)  # a DraftHead's, or kept by a head quantized from one
    return ids if isinstance(ids, Tensor) else None


def vocab_size(model: nn.Module) -> int:
    """The vocabulary a model reads (its input embeddings' rows), restricted head or not."""
    return model.get_input_embeddings().weight.shape[0]


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, vocab: int, always: Iterable[int] = ()) -> Tensor:
    """The ``size`` most frequent token ids of ``sequences`` (ties by id), ``always`` first (special tokens such as
    EOS, which a draft must be able to propose), as a sorted long tensor: a :class:`DraftHead`'s ``d2t``. Ids
    never seen fill the rest in id order when fewer than ``size`` were seen."""
    if not 1 <= size <= vocab:
        raise DistillSpecError(f"draft vocabulary size {size}: must be in [1, the vocabulary's {vocab}]")
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    chosen = dict.fromkeys(int(t) for t in always if 0 <= int(t) < vocab)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if 0 <= token < vocab:
            chosen.setdefault(token)
    for token in range(vocab):
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    return torch.tensor(sorted(chosen)[:size], dtype=torch.long)


def restrict_head(model: nn.Module, ids: Tensor) -> nn.Module:
    """Give ``model`` (in place) a :class:`DraftHead` over the token ids ``ids``, initialised from the rows of its
    current head (a tied head is untied: the embeddings stay whole). Returns the model."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    vocab = vocab_size(model)
    if ids.ndim != 1 or len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise DistillSpecError(f"draft vocabulary: {len(ids)} ids, each must be in [0, {vocab})")
    if len(torch.unique(ids)) != len(ids):
        raise DistillSpecError("draft vocabulary: the ids must be distinct")
    old = model.get_output_embeddings()
    if isinstance(old, DraftHead):  # restrict further: rows of the restricted head
        row = {int(t): i for i, t in enumerate(old.d2t.tolist())}
        if any(int(t) not in row for t in ids):
            raise DistillSpecError("draft vocabulary: a restricted head can only be restricted to a subset of its ids")
        rows = torch.tensor([row[int(t)] for t in ids], device=old.weight.device)
    else:
        rows = ids.to(old.weight.device)
    head = DraftHead(
        old.weight.shape[1], ids, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype
    )
    with torch.no_grad():
        head.weight.copy_(old.weight[rows])
        if old.bias is not None:
            head.bias.copy_(old.bias[rows])
    model.set_output_embeddings(head)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    setattr(model.config, CONFIG_KEY, len(ids))
    return model


def whole_head(model: nn.Module, base: Tensor) -> nn.Module:
    """Give a draft with a :class:`DraftHead` a head over the whole vocabulary again (in place), for an engine that
    takes no draft vocabulary (vLLM's ``draft_model``): the rows of its draft vocabulary as they are (distilled or
    not), every other row ``base``'s [vocabulary, hidden], the head of the model it was cut from. A head the learner
    froze (``distill.train=layers`` or ``top:K``) comes back as that model's. A draft without a draft vocabulary
    comes back as it is."""
    head = model.get_output_embeddings()
    if not isinstance(head, DraftHead):
        return model
    hidden, vocab = head.weight.shape[1], model.get_input_embeddings().weight.shape[0]
    if tuple(base.shape) != (vocab, hidden) or head.bias is not None:
        raise DistillSpecError(
            f"whole vocabulary: the base head must be the whole head of the model the draft was cut from, "
            f"[{vocab}, {hidden}] without a bias; got {list(base.shape)}"
        )
    whole = nn.Linear(hidden, vocab, bias=False, device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        whole.weight.copy_(base)
        whole.weight[head.d2t] = head.weight
    model.set_output_embeddings(whole)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


def full_probs(q: Tensor, ids: Tensor | None, vocab: int) -> Tensor:
    """A draft's probabilities over its vocabulary ``q`` [..., V] put back on the whole vocabulary [..., vocab]
    (zero outside ``ids``); ``q`` itself where the draft has no restricted head (``ids`` None)."""
    if ids is None:
        return q
    return q.new_zeros(*q.shape[:-1], vocab).index_copy_(-1, ids, q)


def expand_logits(logits: Tensor, ids: Tensor | None, vocab: int) -> Tensor:
    """A draft's logits over its vocabulary on the whole vocabulary, ``-inf`` outside ``ids`` (the distribution the
    verifier sees: 1 - TVD against the target's full distribution is the acceptance rate)."""
    if ids is None:
        return logits
    return logits.new_full((*logits.shape[:-1], vocab), -math.inf).index_copy_(-1, ids, logits)


def restrict_target(target: Tensor | TopKLogprobs, ids: Tensor | None) -> Tensor | TopKLogprobs:
    """The target's distribution conditioned on the draft vocabulary ``ids`` (see the module docstring), in the
    draft's index space: full logits gathered at ``ids`` (the divergences renormalise them); top-k log-probs with
    the entries outside ``ids`` dropped (their log-probability set to -inf, index 0), the rest renormalised on the
    assumption that the unscored tail lies inside ``ids``. ``target`` itself where ``ids`` is None."""
    if ids is None:
        return target
    if not isinstance(target, TopKLogprobs):
        return target.index_select(-1, ids.to(target.device))
    ids = ids.to(target.indices.device)
    t2d = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long, device=ids.device)
    t2d[ids] = torch.arange(len(ids), device=ids.device)
    inside = target.indices <= int(ids.max())
    mapped = torch.where(inside, t2d[target.indices.clamp(max=int(ids.max()))], -1)
    kept = mapped >= 0
    logprobs = target.logprobs.float().masked_fill(~kept, -math.inf)
    dropped = torch.where(kept, 0.0, target.logprobs.float().exp()).sum(-1, keepdim=True)
    logprobs = logprobs - torch.log1p(-dropped.clamp(max=1 - 1e-6))
    return TopKLogprobs(logprobs, mapped.clamp(min=0), target.temperature)
