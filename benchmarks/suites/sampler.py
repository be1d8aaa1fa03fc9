"""What sampling at T = 1 costs the decoders, each way raced against the one it replaced, in one run: drawing a
token (:func:`distillspec.decoding.speculative.sample`, one uniform a row and a search of the float64 cumulative mass,
against ``V`` draws ``E ~ Exp(1)`` a row and the argmax of ``p / E``), finding a top-p nucleus (among the likeliest
tokens, :func:`distillspec.decoding.sampling.nucleus_floor`, against a sort of the whole row) and penalising after a
block's drafts. Both ways of each draw exactly from the same distribution.

1. One draw (ms, median of 30) for each number of rows and vocabulary size, ``torch.multinomial``'s beside them.
2. Decoding at T = 1 with each sampler in turn on every prompt: the target alone and speculative decoding (the pair as
   the endpoint decodes it: the draft in the pair's dtype, int8 as ``draft_int8`` says), and the draft alone sampling
   all the prompts as one batch, as a rollout actor does (in float32, as it trains).
3. The same two decoders with ``top_p`` (``--top-p``, 0.9), the nucleus found each way in turn on every prompt.
4. Speculative decoding with penalties (``--presence-penalty`` 0.5, ``--repetition-penalty`` 1.1), the logits
   processed each way in turn on every prompt: a block's counts over the whole vocabulary at each position, as
   before, or the row's counts once and the drafts' own tokens recounted
   (:meth:`distillspec.decoding.sampling.History.process`).

The two ways of each pair draw other tokens, so answers differ in acceptance; the figures to compare are the seconds
per target call (a block of speculative decoding) and per draft step, and the share of them spent in what differs
(a timer around the sampler, the truncation or the processing of each position's distribution), with tokens/s beside
them.

    python -m benchmarks.suites.sampler target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --prompts 4 --max-new-tokens 64 --out outputs/sampler-qwen

Writes ``sampler.json`` and ``sampler.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.suites.common import cpu_kernels
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.decoding import sampling, speculative
from distillspec.decoding.sampling import History, SamplingControls
from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
from distillspec.models.loading import encode_prompts, load_decoding_draft, load_model, pad_prompts
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task

SAMPLERS = ("exponential race", "inverse transform")
MULTINOMIAL = "torch.multinomial"
NUCLEI = ("the whole row sorted", "among the likeliest")
PENALTIES = ("every position counted", "the drafts' tokens recounted")
ROWS, VOCABS = (1, 8), (32_768, 151_936)
SAMPLE, TRUNCATE, PROCESS = speculative.sample, sampling.truncate, sampling.History.process


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None = None, race=None) -> torch.Tensor:
    """The sampler before: new ``Exp(1)`` draws for every token of every row, raced (the seeded rows' path)."""
    if race is None:
        race = torch.empty_like(probs).exponential_(generator=generator)
    return SAMPLE(probs, race=race)


class Timed:
    """A function that counts the seconds spent in it."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kw):
        start = time.perf_counter()
        out = self.fn(*args, **kw)
        self.seconds += time.perf_counter() - start
        return out


@contextmanager
def swapped(owner: object, attr: str, fn: Callable) -> Iterator[Timed]:
    """``owner.attr`` (a module's function, a class's method) replaced by ``fn``, timed, while the block runs."""
    original, timer = getattr(owner, attr), Timed(fn)

    def timed_fn(*args, **kw):  # a function, so that a method's instance is passed on as ``self``
        return timer(*args, **kw)

    setattr(owner, attr, timed_fn)
    try:
        yield timer
    finally:
        setattr(owner, attr, original)


def sampler(name: str) -> AbstractContextManager[Timed]:
    """The decoders with the sampler ``name`` of :data:`SAMPLERS`, timed."""
    return swapped(speculative, "sample", exponential_race if name == SAMPLERS[0] else SAMPLE)


def truncate_by_sorting(logits: torch.Tensor, temperature: float, c: SamplingControls) -> torch.Tensor:
    """The truncation before: the top-p nucleus found by sorting the whole row, as vLLM's sampler finds it."""
    logits = TRUNCATE(logits, temperature, replace(c, top_p=1.0))
    if c.top_p < 1:
        ordered, order = logits.sort(-1)  # ascending: drop the least likely while their mass stays <= 1 - top_p
        below = torch.softmax(ordered / temperature, -1).cumsum(-1) <= 1 - c.top_p
        below[..., -1] = False  # the likeliest token always stays
        logits = logits.masked_fill(below.scatter(-1, order, below), -math.inf)
    return logits


def process_densely(self, logits, rows, temperature, drafts=None):
    """:meth:`History.process` before: the counts of every position of a block over the whole vocabulary (the row's
    tokens and the drafts it sees), then every token penalised with them."""
    c = self.controls
    out = logits.float()
    if self.bias is not None:
        out = out + self.bias
    if c.penalised:
        b, k = logits.shape[:2]
        counts = self.counts[rows][:, None].expand(-1, k, -1)
        if drafts is not None and drafts.shape[1]:
            m = drafts.shape[1]  # position i sees the first m - k + 1 + i drafts: draft t from position t - m + k
            first = (torch.arange(m, device=out.device) - m + k).clamp(min=0)
            seen = torch.zeros(b, k * self.vocab, device=out.device)
            seen.scatter_add_(1, first * self.vocab + drafts, torch.ones_like(drafts, dtype=seen.dtype))
            counts = counts + seen.view(b, k, self.vocab).cumsum(1)
        out = sampling.penalise(out, counts, None if self.prompt is None else self.prompt[rows][:, None], c)
    return sampling.truncate(out, temperature, c) if temperature > 0 else out


def penalties(name: str) -> AbstractContextManager[Timed]:
    """The decoders' processing of the logits, timed, the penalties after a block's drafts counted as ``name`` of
    :data:`PENALTIES` says."""
    return swapped(History, "process", process_densely if name == PENALTIES[0] else PROCESS)


def nucleus(name: str) -> AbstractContextManager[Timed]:
    """The decoders' truncation, timed, with the nucleus found as ``name`` of :data:`NUCLEI` says."""
    return swapped(sampling, "truncate", truncate_by_sorting if name == NUCLEI[0] else TRUNCATE)


def draw_ms(reps: int = 30) -> list[dict]:
    """Part 1: one draw's milliseconds (median of ``reps``) by rows, vocabulary and sampler."""
    rows = []
    for n in ROWS:
        for vocab in VOCABS:
            probs = torch.softmax(torch.randn(n, vocab), -1)
            row = {"rows": n, "vocab": vocab}
            draws = {SAMPLERS[0]: exponential_race, SAMPLERS[1]: SAMPLE, MULTINOMIAL: lambda p: torch.multinomial(p, 1)}
            for name, draw in draws.items():
                times = []
                for _ in range(reps + 2):
                    start = time.perf_counter()
                    draw(probs)
                    times.append(time.perf_counter() - start)
                row[name] = 1e3 * statistics.median(times[2:])
            rows.append(row)
    return rows


def timed(fn: Callable, *args, **kw) -> tuple[float, object]:
    """Seconds of ``fn(*args, **kw)``, and what it gave."""
    start = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - start, out


def race_decoders(
    target,
    draft,
    prompts: list[torch.Tensor],
    variants: dict[str, Callable[[], AbstractContextManager[Timed]]],
    *,
    gamma: int,
    repeats: int,
    seed: int,
    alone: bool = True,
    **kw,
) -> list[dict]:
    """The target alone (where ``alone``) and speculative decoding on every prompt with each of ``variants`` in turn
    (the order alternating from prompt to prompt), ``kw`` the decoders' arguments: per decoder and variant, the
    seconds, tokens, target calls and seconds in the variant's timer (and alpha, for speculative decoding)."""
    # per decoder and variant: seconds, tokens, target calls, seconds timed, draft tokens accepted, judged
    decoders = ("alone", "sd") if alone else ("sd",)
    totals = {(decoder, name): [0.0, 0, 0, 0.0, 0, 0] for decoder in decoders for name in variants}
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            for name in list(variants) if (r + i) % 2 == 0 else list(variants)[::-1]:
                generator = torch.Generator().manual_seed(seed + 1000 * r + i)
                if alone:
                    with variants[name]() as clock:
                        s, got = timed(autoregressive_generate, target, prompt, generator=generator, **kw)
                    tokens = int(got.num_new_tokens[0])  # one target call a token
                    totals["alone", name][:4] = add(totals["alone", name][:4], s, tokens, tokens, clock.seconds)
                with variants[name]() as clock:
                    s, sd = timed(speculative_generate, target, draft, prompt, gamma=gamma, generator=generator, **kw)
                c, new = sd.stats.counts, int(sd.num_new_tokens[0])
                judged = c.accepted + c.rejected
                totals["sd", name] = add(totals["sd", name], s, new, c.blocks, clock.seconds, c.accepted, judged)
            print(f"repeat {r + 1}, prompt {i + 1}: {format_progress(totals)}", flush=True)
    return [
        {"decoder": decoder, "variant": name, "seconds": t[0], "tokens": t[1], "target_calls": t[2], "timed_s": t[3]}
        | ({"alpha": t[4] / t[5]} if decoder == "sd" else {})
        for (decoder, name), t in totals.items()
    ]


def suite_sampler(
    overrides: list[str],
    *,
    prompts: int,
    max_new_tokens: int,
    gamma: int,
    repeats: int,
    top_p: float,
    presence_penalty: float,
    repetition_penalty: float,
    out: Path,
) -> dict:
    """The whole suite (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    result = {"config": {"target": cfg.target, "draft": cfg.draft, "dtype": cfg.dtype, "draft_int8": cfg.draft_int8}}
    result["config"] |= {"prompts": prompts, "max_new_tokens": max_new_tokens, "gamma": gamma, "repeats": repeats}
    result["config"] |= {"top_p": top_p, "nucleus_candidates": sampling.NUCLEUS_CANDIDATES}  # the first search
    result["config"] |= {"presence_penalty": presence_penalty, "repetition_penalty": repetition_penalty}
    result["config"] |= {"threads": torch.get_num_threads()} | cpu_kernels()
    result["draw_ms"] = draw_ms()
    print(format_draws(result["draw_ms"]))
    dtype = getattr(torch, cfg.dtype)
    target, tokenizer = load_model(cfg.target, device=cfg.device, dtype=dtype, prepack=cfg.prepack)
    draft = load_decoding_draft(cfg.draft, device=cfg.device, dtype=dtype, int8=cfg.draft_int8)[0]
    ids = [encode_prompts(tokenizer, [e.prompt])[0].to(cfg.device) for e in task.test[:prompts]]
    kw = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "eos_token_id": []}  # every answer to the budget
    kw |= {"gamma": gamma, "repeats": repeats, "seed": cfg.seed}
    samplers = {name: lambda name=name: sampler(name) for name in SAMPLERS}
    result["decoders"] = race_decoders(target, draft, ids, samplers, **kw)
    nuclei = {name: lambda name=name: nucleus(name) for name in NUCLEI}
    result["top_p"] = race_decoders(target, draft, ids, nuclei, controls=SamplingControls(top_p=top_p), **kw)
    penalised = SamplingControls(presence_penalty=presence_penalty, repetition_penalty=repetition_penalty)
    ways = {name: lambda name=name: penalties(name) for name in PENALTIES}
    result["penalties"] = race_decoders(target, draft, ids, ways, controls=penalised, alone=False, **kw)
    del target, draft
    rollout_draft = load_model(cfg.draft, device=cfg.device, dtype=torch.float32)[0]
    batch, mask = pad_prompts([p[0].tolist() for p in ids], tokenizer.pad_token_id or 0)
    result["rollouts"] = []
    for r in range(repeats):
        for name in SAMPLERS if r % 2 == 0 else SAMPLERS[::-1]:
            generator = torch.Generator().manual_seed(cfg.seed + r)
            with sampler(name) as clock:
                s, got = timed(
                    autoregressive_generate,
                    rollout_draft,
                    batch,
                    attention_mask=mask,
                    generator=generator,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=[],
                )
            steps = int(got.num_new_tokens.max())
            row = {"variant": name, "rows": len(ids), "seconds": s, "steps": steps, "timed_s": clock.seconds}
            result["rollouts"].append(row)
    table = format_table(result)
    (out / "sampler.json").write_text(json.dumps(result, indent=1))
    (out / "sampler.md").write_text(table + "\n")
    print(table)
    return result


def add(acc: list, *values) -> list:
    return [a + v for a, v in zip(acc, values, strict=True)]


def format_progress(totals: dict) -> str:
    return "; ".join(f"{d} {n}: {t[1] / t[0]:.2f} tokens/s" for (d, n), t in totals.items())


def per(row: dict, unit: str) -> str:
    """Milliseconds per ``unit`` (target calls, steps), and those in the timer (their share)."""
    ms, inside = (1e3 * row[key] / row[unit] for key in ("seconds", "timed_s"))
    return f"{ms:.0f} | {inside:.1f} ({inside / ms:.1%})"


def format_draws(rows: list[dict]) -> str:
    names = [*SAMPLERS, MULTINOMIAL]
    head = "| rows | vocabulary | " + " | ".join(f"{n}, ms" for n in names) + " | race / inverse |\n" + "|---" * 6 + "|"
    lines = [
        f"| {r['rows']} | {r['vocab']:,} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " | "
        f"{r[SAMPLERS[0]] / r[SAMPLERS[1]]:.1f}x |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def format_decoders(rows: list[dict], gamma: int, what: str, timed_what: str) -> list[str]:
    head = f"| decoder | {what} | tokens | s | tokens/s | alpha | ms per target call | of it {timed_what} |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        name = "target alone" if row["decoder"] == "alone" else f"SD, gamma {gamma}"
        alpha = f"{row['alpha']:.3f}" if "alpha" in row else ""
        lines.append(
            f"| {name} | {row['variant']} | {row['tokens']} | {row['seconds']:.1f} |"
            f" {row['tokens'] / row['seconds']:.2f} | {alpha} | {per(row, 'target_calls')} |"
        )
    return lines


def format_table(result: dict) -> str:
    """The five tables: draws, decoding at batch 1 by sampler, by nucleus search and by penalties, rollout
    batches."""
    gamma, top_p = result["config"]["gamma"], result["config"]["top_p"]
    lines = [format_draws(result["draw_ms"]), ""]
    lines += format_decoders(result["decoders"], gamma, "sampler", "drawing tokens") + [""]
    lines += format_decoders(result["top_p"], gamma, f"top_p = {top_p}, nucleus", "truncating") + [""]
    penalised = f"presence {result['config']['presence_penalty']}, repetition {result['config']['repetition_penalty']}"
    lines += format_decoders(result["penalties"], gamma, f"penalties ({penalised})", "processing logits") + [""]
    lines += [
        "| rollout batch | sampler | steps | s | ms per step | of it drawing tokens |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rollouts"]:
        lines.append(
            f"| {row['rows']} rows | {row['variant']} | {row['steps']} | {row['seconds']:.1f} | {per(row, 'steps')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_int8)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out test prompts (also the rollout batch's rows)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--top-p", type=float, default=0.9, help="the top_p of part 3")
    parser.add_argument("--presence-penalty", type=float, default=0.5, help="a penalty of part 4")
    parser.add_argument("--repetition-penalty", type=float, default=1.1, help="a penalty of part 4")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--out", type=Path, default=Path("outputs/sampler"))
    args = parser.parse_args()
    suite_sampler(
        args.overrides,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        gamma=args.gamma,
        repeats=args.repeats,
        top_p=args.top_p,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        out=args.out,
    )


if __name__ == "__main__":
    run_main(main)
