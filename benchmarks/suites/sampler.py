"""What drawing a token costs at T = 1: the decoders' sampler (:func:`distillspec.decoding.speculative.sample`, one
uniform a row and a search of the float64 cumulative mass) against the exponential race it replaced (``V`` draws
``E ~ Exp(1)`` a row, the argmax of ``p / E``), in one run. Both draw exactly from ``p``.

1. One draw (ms, median of 30) for each number of rows and vocabulary size, ``torch.multinomial``'s beside them.
2. Decoding at T = 1 with each sampler in turn on every prompt: the target alone and speculative decoding (the pair as
   the endpoint decodes it: the draft in the pair's dtype, int8 as ``draft_int8`` says), and the draft alone sampling
   all the prompts as one batch, as a rollout actor does (in float32, as it trains). The two samplers draw other
   tokens, so answers differ in length and in acceptance; the figures to compare are the seconds per target call
   (a block of speculative decoding) and per draft step, with tokens/s beside them.

    python -m benchmarks.suites.sampler target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct \\
        dataset=../shared/data/gsm8k --prompts 4 --max-new-tokens 64 --out outputs/sampler-qwen

Writes ``sampler.json`` and ``sampler.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.suites.common import cpu_kernels
from distillspec.config import load_config
from distillspec.decoding import speculative
from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
from distillspec.models.loading import encode_prompts, load_decoding_draft, load_model, pad_prompts
from distillspec.models.pretrained import prepare_pair
from distillspec.tasks.data import load_task

SAMPLERS = ("exponential race", "inverse transform")
MULTINOMIAL = "torch.multinomial"
ROWS, VOCABS = (1, 8), (32_768, 151_936)


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None = None, race=None) -> torch.Tensor:
    """The sampler before: new ``Exp(1)`` draws for every token of every row, raced (the seeded rows' path)."""
    if race is None:
        race = torch.empty_like(probs).exponential_(generator=generator)
    return SAMPLE(probs, race=race)


SAMPLE = speculative.sample


class Timed:
    """A sampler that counts the seconds spent in it."""

    def __init__(self, draw: Callable) -> None:
        self.draw, self.seconds = draw, 0.0

    def __call__(self, *args, **kw) -> torch.Tensor:
        start = time.perf_counter()
        out = self.draw(*args, **kw)
        self.seconds += time.perf_counter() - start
        return out


@contextmanager
def sampler(name: str) -> Iterator[Timed]:
    """The decoders with the sampler ``name`` of :data:`SAMPLERS` in place of their own while the block runs, timed."""
    speculative.sample = chosen = Timed(exponential_race if name == SAMPLERS[0] else SAMPLE)
    try:
        yield chosen
    finally:
        speculative.sample = SAMPLE


def draw_ms(reps: int = 30) -> list[dict]:
    """Part 1: one draw's milliseconds (median of ``reps``) by rows, vocabulary and sampler."""
    rows = []
    for n in ROWS:
        for vocab in VOCABS:
            probs = torch.softmax(torch.randn(n, vocab), -1)
            row = {"rows": n, "vocab": vocab}
            draws = {name: exponential_race if name == SAMPLERS[0] else SAMPLE for name in SAMPLERS}
            for name, draw in (draws | {MULTINOMIAL: lambda p: torch.multinomial(p, 1)}).items():
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


def suite_sampler(overrides: list[str], *, prompts: int, max_new_tokens: int, gamma: int, repeats: int, out: Path):
    """The whole suite (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides)
    cfg, task = prepare_pair(cfg, load_task(cfg.dataset, seed=cfg.seed))
    result = {"config": {"target": cfg.target, "draft": cfg.draft, "dtype": cfg.dtype, "draft_int8": cfg.draft_int8}}
    result["config"] |= {"prompts": prompts, "max_new_tokens": max_new_tokens, "gamma": gamma, "repeats": repeats}
    result["config"] |= {"threads": torch.get_num_threads()} | cpu_kernels()
    result["draw_ms"] = draw_ms()
    print(format_draws(result["draw_ms"]))
    dtype = getattr(torch, cfg.dtype)
    target, tokenizer = load_model(cfg.target, device=cfg.device, dtype=dtype, prepack=cfg.prepack)
    draft = load_decoding_draft(cfg.draft, device=cfg.device, dtype=dtype, int8=cfg.draft_int8)[0]
    ids = [encode_prompts(tokenizer, [e.prompt])[0].to(cfg.device) for e in task.test[:prompts]]
    kw = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "eos_token_id": []}  # every answer to the budget
    # per decoder and sampler: seconds, tokens, target calls, seconds drawing tokens, draft tokens accepted, judged
    totals = {(decoder, name): [0.0, 0, 0, 0.0, 0, 0] for decoder in ("alone", "sd") for name in SAMPLERS}
    for r in range(repeats):
        for i, prompt in enumerate(ids):
            for name in SAMPLERS if (r + i) % 2 == 0 else SAMPLERS[::-1]:
                generator = torch.Generator().manual_seed(cfg.seed + 1000 * r + i)
                with sampler(name) as clock:
                    s, alone = timed(autoregressive_generate, target, prompt, generator=generator, **kw)
                tokens = int(alone.num_new_tokens[0])  # one target call a token
                totals["alone", name][:4] = add(totals["alone", name][:4], s, tokens, tokens, clock.seconds)
                with sampler(name) as clock:
                    s, sd = timed(speculative_generate, target, draft, prompt, gamma=gamma, generator=generator, **kw)
                c, new = sd.stats.counts, int(sd.num_new_tokens[0])
                totals["sd", name] = add(
                    totals["sd", name], s, new, c.blocks, clock.seconds, c.accepted, c.accepted + c.rejected
                )
            print(f"repeat {r + 1}, prompt {i + 1}: {format_decoders(totals)}", flush=True)
    result["decoders"] = [
        {"decoder": decoder, "sampler": name, "seconds": t[0], "tokens": t[1], "target_calls": t[2], "drawing_s": t[3]}
        | ({"alpha": t[4] / t[5]} if decoder == "sd" else {})
        for (decoder, name), t in totals.items()
    ]
    del target, draft
    rollout_draft = load_model(cfg.draft, device=cfg.device, dtype=torch.float32)[0]
    batch, mask = pad_prompts([p[0].tolist() for p in ids], tokenizer.pad_token_id or 0)
    result["rollouts"] = []
    for r in range(repeats):
        for name in SAMPLERS if r % 2 == 0 else SAMPLERS[::-1]:
            generator = torch.Generator().manual_seed(cfg.seed + r)
            with sampler(name) as clock:
                s, got = timed(
                    autoregressive_generate, rollout_draft, batch, attention_mask=mask, generator=generator, **kw
                )
            steps = int(got.num_new_tokens.max())
            row = {"sampler": name, "rows": len(ids), "seconds": s, "steps": steps, "drawing_s": clock.seconds}
            result["rollouts"].append(row)
    table = format_table(result)
    (out / "sampler.json").write_text(json.dumps(result, indent=1))
    (out / "sampler.md").write_text(table + "\n")
    print(table)
    return result


def add(acc: list, *values) -> list:
    return [a + v for a, v in zip(acc, values, strict=True)]


def format_decoders(totals: dict) -> str:
    return "; ".join(f"{d} {n}: {t[1] / t[0]:.2f} tokens/s" for (d, n), t in totals.items())


def per(row: dict, unit: str) -> str:
    """Milliseconds per ``unit`` (target calls, steps), and those spent drawing tokens (their share)."""
    ms, drawing = (1e3 * row[key] / row[unit] for key in ("seconds", "drawing_s"))
    return f"{ms:.0f} | {drawing:.1f} ({drawing / ms:.1%})"


def format_draws(rows: list[dict]) -> str:
    names = [*SAMPLERS, MULTINOMIAL]
    head = "| rows | vocabulary | " + " | ".join(f"{n}, ms" for n in names) + " | race / inverse |\n" + "|---" * 6 + "|"
    lines = [
        f"| {r['rows']} | {r['vocab']:,} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " | "
        f"{r[SAMPLERS[0]] / r[SAMPLERS[1]]:.1f}x |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def format_table(result: dict) -> str:
    """The three tables: draws, decoding at batch 1, rollout batches."""
    lines = [format_draws(result["draw_ms"]), ""]
    head = "| decoder | sampler | tokens | s | tokens/s | alpha | ms per target call | of it drawing tokens |"
    lines += [head, "|---|---|---|---|---|---|---|---|"]
    for row in result["decoders"]:
        name = "target alone" if row["decoder"] == "alone" else f"SD, gamma {result['config']['gamma']}"
        alpha = f"{row['alpha']:.3f}" if "alpha" in row else ""
        lines.append(
            f"| {name} | {row['sampler']} | {row['tokens']} | {row['seconds']:.1f} |"
            f" {row['tokens'] / row['seconds']:.2f} | {alpha} | {per(row, 'target_calls')} |"
        )
    lines += [
        "",
        "| rollout batch | sampler | steps | s | ms per step | of it drawing tokens |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rollouts"]:
        lines.append(
            f"| {row['rows']} rows | {row['sampler']} | {row['steps']} | {row['seconds']:.1f} | {per(row, 'steps')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=..., draft_int8)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out test prompts (also the rollout batch's rows)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--out", type=Path, default=Path("outputs/sampler"))
    args = parser.parse_args()
    suite_sampler(
        args.overrides,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        gamma=args.gamma,
        repeats=args.repeats,
        out=args.out,
    )


if __name__ == "__main__":
    main()
