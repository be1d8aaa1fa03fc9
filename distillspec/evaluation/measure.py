"""Measure a target/draft pair: alpha and tau from SD runs and from TVD, task score, wall-clock speedup."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.config import Compile
from distillspec.decoding.metrics import (
    AcceptanceCounts,
    CostRatio,
    alpha_from_tvd,
    expected_tau,
    measure_cost_ratio,
    predicted_speedup,
)
from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
from distillspec.models.draft_vocab import d2t, expand_logits, vocab_size
from distillspec.models.loading import decode_new, encode_prompts
from distillspec.tasks.scores import score
from distillspec.training.batches import make_batch
from distillspec.training.losses import forward_logits


@torch.inference_mode()
def evaluate_sd(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int = 32,
    seed: int = 0,
    references: list[str] | None = None,
    metric: str | None = None,
    lenience: str | None = None,
    epsilon: float = 1.0,
) -> dict:
    """Speculative decoding over ``prompts``: empirical alpha/tau, alpha from TVD (Eq. 3), task score."""
    generator = torch.Generator(device=target.device).manual_seed(seed)
    accepted = rejected = blocks = new_tokens = 0
    tvd_sum = tvd_count = 0.0
    predictions: list[str] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ids, mask = (t.to(target.device) for t in encode_prompts(tokenizer, prompts[i : i + batch_size]))
        out = speculative_generate(
            target,
            draft,
            ids,
            gamma=gamma,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            lenience=lenience,
            epsilon=epsilon,
            eos_token_id=tokenizer.eos_token_id,
            attention_mask=mask,
            generator=generator,
            pad_token_id=tokenizer.pad_token_id,
        )
        s = out.stats
        accepted += int(s.accepted.sum())
        rejected += int(s.rejected.sum())
        blocks += int(s.blocks.sum())
        new_tokens += int(s.new_tokens.sum())
        predictions += decode_new(tokenizer, out.sequences, ids.shape[1], out.num_new_tokens)
        # Eq. 3 on these samples (target samples when lossless): alpha = 1 - E[TVD(p, q)].
        batch = make_batch(ids, mask, out.sequences[:, ids.shape[1] :], out.num_new_tokens)
        n = batch.loss_mask.sum().item()
        if n:
            a = alpha_from_tvd(
                expand_logits(forward_logits(draft, batch), d2t(draft), vocab_size(target)),
                forward_logits(target, batch),
                batch.window_mask,
                temperature,
            )
            tvd_sum += (1.0 - a) * n
            tvd_count += n
    seconds = time.perf_counter() - start
    counts = AcceptanceCounts(blocks, accepted, rejected)
    alpha_tvd = 1.0 - tvd_sum / tvd_count if tvd_count else float("nan")
    record = {
        "gamma": gamma,
        "temperature": temperature,
        "lenience": lenience,
        "epsilon": epsilon,
        "alpha": counts.alpha,
        "tau": counts.tau,
        "alpha_tvd": alpha_tvd,
        "tau_theory": expected_tau(alpha_tvd, gamma),
        "drafted": blocks * gamma,
        "accepted": accepted,
        "rejected": rejected,
        "target_calls": blocks,
        "new_tokens": new_tokens,
        "prompts": len(prompts),
        "seconds": seconds,
    }
    if references is not None and metric is not None:
        record.update(score(metric, predictions, references[: len(predictions)]))
    return record


@torch.inference_mode()
def measure_speedup(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    compile: Compile = False,
    repeats: int = 1,
) -> dict:
    """:func:`measure_speeds` of one draft at one gamma and temperature."""
    speeds = measure_speeds(
        target,
        {"draft": draft},
        tokenizer,
        prompts,
        gammas=[gamma],
        temperatures=[temperature],
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        seed=seed,
        compile=compile,
    )
    return speeds[("draft", gamma, temperature)]


@torch.inference_mode()
def measure_speeds(
    target: PreTrainedModel,
    drafts: dict[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    gammas: Sequence[int],
    temperatures: Sequence[float],
    max_new_tokens: int,
    repeats: int = 1,
    seed: int = 0,
    compile: Compile = False,
) -> dict[tuple[str, int, float], dict]:
    """Wall-clock speedups of SD with each of ``drafts`` over the target alone, all side by side (:func:`race`,
    ``repeats`` passes over ``prompts``), with the measured costs (``c``, ``v``) and the speedups they predict
    (:func:`speed_record`), keyed by (draft name, gamma, temperature). ``compile``: every decoder's steps compiled
    (true), or the drafts' alone (``"draft"``: the target alone decodes eagerly)."""
    ids, _ = encode_prompts(tokenizer, prompts[:1])
    costs = {
        (name, gamma): measure_cost_ratio(target, d, ids.to(target.device), gamma=gamma, compile=compile)
        for name, d in drafts.items()
        for gamma in gammas
    }
    speeds = {}
    for temperature in temperatures:
        raced = race(
            target,
            drafts,
            tokenizer,
            prompts,
            gammas=gammas,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            seed=seed,
            compile=compile is True,
            compiled_drafts=list(drafts) if compile == "draft" else (),
            desc=f"speedups at T = {temperature:g}",
        )
        for row in raced["sd"]:
            cost = costs[(row["draft"], row["gamma"])]
            record = speed_record(row, raced["target"], cost, repeats)
            speeds[(row["draft"], row["gamma"], temperature)] = record
    return speeds


def speed_record(row: dict, target: dict, cost: CostRatio, repeats: int) -> dict:
    """One decoder's speed figures: a :func:`race` row, the target alone's (its ``"target"``), and the measured costs
    ``c`` and ``v`` with the speedups they predict from the measured tau, ``tau / (c gamma + 1)`` and with ``v``
    (decoding only: the ratios compare them with the speedup after the first block)."""
    predicted = predicted_speedup(row["tau"], cost.c, row["gamma"])
    predicted_v = predicted_speedup(row["tau"], cost.c, row["gamma"], cost.v)
    return {
        "c": cost.c,
        "v": cost.v,
        "target_ms": cost.target_ms,
        "draft_ms": cost.draft_ms,
        "verify_ms": cost.verify_ms,
        "target_tokens_per_s": target["tokens_per_s"],
        "sd_tokens_per_s": row["tokens_per_s"],
        "target_ttft_s": target["ttft_s"],
        "sd_ttft_s": row["ttft_s"],
        "speedup_tau": row["tau"],
        "measured_speedup": row["speedup"],
        "speedup_min": row["speedup_min"],
        "speedup_max": row["speedup_max"],
        "decode_speedup": row["decode_speedup"],
        "decode_speedup_min": row["decode_speedup_min"],
        "decode_speedup_max": row["decode_speedup_max"],
        "speedup_repeats": repeats,
        "predicted_speedup": predicted,
        "measured_over_predicted": row["decode_speedup"] / predicted,
        "predicted_speedup_with_v": predicted_v,
        "measured_over_predicted_with_v": row["decode_speedup"] / predicted_v,
    }


@torch.inference_mode()
def race(
    target: PreTrainedModel,
    drafts: dict[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    gammas: Sequence[int],
    temperature: float,
    max_new_tokens: int,
    repeats: int = 1,
    seed: int = 0,
    compile: bool = False,
    compiled_drafts: Collection[str] = (),
    seeded: bool = False,
    desc: str | None = None,
) -> dict:
    """Tokens/s at batch 1 of the target alone and of SD with each of ``drafts`` at each of ``gammas``, measured side
    by side: each prompt is decoded by every decoder in turn (a drift in the machine's speed hits them all alike),
    and the whole is repeated ``repeats`` times. A decoder's speedup is its tokens/s over the target alone's in the
    same repeat; the mean and the spread (min, max) over repeats are reported. Each call is also split at its first
    block (:class:`FirstBlock`): the time to the first tokens (``ttft_s``, per prompt: the target reads the prompt and
    gives the first token, in SD as alone) and the rate after them, whose ratio (``decode_speedup``) is what a long
    answer approaches and what the step costs predict. ``compile``: every decoder's steps compiled
    (:func:`distillspec.decoding.speculative.cached_lm`), each shape once in an untimed pass first;
    ``compiled_drafts``: the drafts (names in ``drafts``) whose steps alone run compiled (``compile="draft"``), the
    same way.
    ``seeded``: prompt ``i`` decoded with the seed ``seed + i`` by every decoder
    (:class:`~distillspec.decoding.speculative.SeededNoise`), so each emits the target alone's text; ``same_text``
    counts the prompts where it did. ``desc``: a progress bar of that name, a step per prompt and pass.

    Returns ``{"target": {"tokens_per_s", "decode_tokens_per_s", "ttft_s"}, "sd": [{"draft", "gamma",
    "tokens_per_s", "speedup", "speedup_min", "speedup_max", "decode_tokens_per_s", "decode_speedup",
    "decode_speedup_min", "decode_speedup_max", "ttft_s", "alpha", "tau", "same_text"}, ...]}``."""
    common = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        compile=compile,
    )
    cells = [(name, gamma) for name in drafts for gamma in gammas]
    compiles = {cell: compile or ("draft" if cell[0] in compiled_drafts else False) for cell in cells}
    for prompt in prompts if compile or any(compiles.values()) else []:  # an untimed pass compiles each shape
        ids = encode_prompts(tokenizer, [prompt])[0].to(target.device)
        if compile:
            autoregressive_generate(target, ids, **common)
        for cell in [cell for cell in cells if compiles[cell]]:
            speculative_generate(target, drafts[cell[0]], ids, gamma=cell[1], **common | {"compile": compiles[cell]})
    timings = {cell: [FirstBlock() for _ in range(repeats)] for cell in [None, *cells]}
    counts = {cell: AcceptanceCounts(0, 0, 0) for cell in cells}
    same = dict.fromkeys(cells, 0)
    generators = {cell: torch.Generator(device=target.device).manual_seed(seed) for cell in [None, *cells]}
    bar = tqdm(total=repeats * len(prompts), desc=desc, unit="prompt", disable=desc is None)
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            ids = encode_prompts(tokenizer, [prompt])[0].to(target.device)
            seeds = {"seeds": [seed + i]} if seeded else {}
            for cell in [None, *cells]:
                timing = timings[cell][r]
                timing.start()
                if cell is None:
                    out = alone = autoregressive_generate(
                        target, ids, generator=generators[cell], on_block=timing.on_block, **common, **seeds
                    )
                else:
                    out = speculative_generate(
                        target,
                        drafts[cell[0]],
                        ids,
                        gamma=cell[1],
                        generator=generators[cell],
                        on_block=timing.on_block,
                        **common | {"compile": compiles[cell]},
                        **seeds,
                    )
                    counts[cell] = counts[cell] + out.stats.counts
                    same[cell] += int(torch.equal(out.sequences, alone.sequences))
                timing.stop(int(out.num_new_tokens.sum()))
            bar.update()
    bar.close()
    rows = []
    for cell in cells:
        ours, theirs = timings[cell], timings[None]
        speedups = [sd.tokens_per_s / alone.tokens_per_s for sd, alone in zip(ours, theirs)]
        decode = [sd.decode_tokens_per_s / alone.decode_tokens_per_s for sd, alone in zip(ours, theirs)]
        rows.append(
            {
                "draft": cell[0],
                "gamma": cell[1],
                "speedup": sum(speedups) / len(speedups),
                "speedup_min": min(speedups),
                "speedup_max": max(speedups),
                "decode_speedup": sum(decode) / len(decode),
                "decode_speedup_min": min(decode),
                "decode_speedup_max": max(decode),
                "alpha": counts[cell].alpha,
                "tau": counts[cell].tau,
                "same_text": same[cell] / (repeats * len(prompts)),
            }
            | FirstBlock.pooled(ours)
        )
    return {"target": FirstBlock.pooled(timings[None]), "sd": rows}


class FirstBlock:
    """The wall-clock of decoding calls, split at each call's first block (its ``on_block`` callback): the time to
    the first tokens, which holds the prompt's prefill, and the tokens and time after them. ``start()`` before a call,
    ``stop(new_tokens)`` after it; a call with one block counts whole as its time to the first tokens."""

    def __init__(self) -> None:
        self.calls, self.tokens, self.seconds = 0, 0, 0.0
        self.first_seconds, self.first_tokens = 0.0, 0
        self._start: float | None = None
        self._first: tuple[float, int] | None = None

    def start(self) -> None:
        self._start, self._first = time.perf_counter(), None

    def on_block(self, tokens: torch.Tensor, counts: torch.Tensor, scores: object) -> None:
        if self._first is None:
            self._first = (time.perf_counter(), int(counts.sum()))

    def stop(self, new_tokens: int) -> None:
        end = time.perf_counter()
        first_at, first_tokens = self._first or (end, new_tokens)
        self.calls += 1
        self.tokens += new_tokens
        self.seconds += end - self._start
        self.first_seconds += first_at - self._start
        self.first_tokens += first_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each call's first block over the time after it (nan where no call had a second block)."""
        after = self.seconds - self.first_seconds
        return (self.tokens - self.first_tokens) / after if after > 0 else float("nan")

    @staticmethod
    def pooled(timings: Sequence[FirstBlock]) -> dict:
        """Tokens/s, tokens/s after the first block, and the mean seconds to the first tokens, over ``timings``."""
        whole = FirstBlock()
        for t in timings:
            for name in ("calls", "tokens", "seconds", "first_seconds", "first_tokens"):
                setattr(whole, name, getattr(whole, name) + getattr(t, name))
        return {
            "tokens_per_s": whole.tokens_per_s,
            "decode_tokens_per_s": whole.decode_tokens_per_s,
            "ttft_s": whole.first_seconds / whole.calls,
        }
