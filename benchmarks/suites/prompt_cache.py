"""Prompts that share a long first part, read with and without a prompt cache: the time to the first token and tokens/s.

Each prompt is a held-out question after ``--shots`` worked examples of the training split (GSM8K's few-shot form),
through the pair's prompt format: every prompt starts with the same worked examples. With a prompt cache
(:class:`~distillspec.decoding.prompt_cache.PromptCache`, the endpoint's ``serve.prompt_cache_mb``) a model reads
only what follows the blocks of 16 tokens it holds, here the question. Per prompt, four decoders in turn, the same
seed each: the target alone and speculative decoding, each without a cache and with one (one cache each, holding the
worked examples as an untimed first call left them, so that no decoder finds the question another read). Each call
is split at its first block (:class:`~distillspec.evaluation.measure.FirstBlock`): the time to the first token holds
the prompt's reading.

    python -m benchmarks.suites.prompt_cache target=qwen2.5-coder-1.5b-instruct \\
        draft=qwen2.5-coder-0.5b-instruct dataset=../shared/data/gsm8k --shots 4 --prompts 4

Writes ``prompt_cache.json`` and ``prompt_cache.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.suites.common import command, few_shot
from distillspec.cli import run_main
from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.decoding.prompt_cache import PromptCache
from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
from distillspec.evaluation.measure import FirstBlock

#: The decoders, in the order each prompt meets them: (decoder, with a prompt cache).
DECODERS = [("target alone", False), ("SD", False), ("target alone", True), ("SD", True)]


def suite_prompt_cache(
    overrides: list[str],
    *,
    shots: int,
    prompts: int,
    gamma: int,
    temperature: float,
    max_new_tokens: int,
    out: Path,
    log=print,
) -> dict:
    """The whole suite (see the module docstring); writes ``prompt_cache.json`` and ``prompt_cache.md`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    pair = few_shot(overrides, shots, prompts)
    cfg, target, draft, tokenizer, ids = pair.cfg, pair.target, pair.draft, pair.tokenizer, pair.prompts
    lengths = [int(x.shape[1]) for x in ids]
    shared = int(pair.examples.shape[1])
    log(f"prompts of {lengths} tokens, the first {shared} the same ({shots} worked examples before each question)")
    caches = {"target alone": PromptCache(1 << 30), "SD": PromptCache(1 << 30)}

    def decode(decoder: str, cached: bool, prompt: torch.Tensor, seed: int, **timing):
        common = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=tokenizer.eos_token_id)
        common |= dict(generator=torch.Generator().manual_seed(seed), prompt_cache=caches[decoder] if cached else None)
        if decoder == "target alone":
            return autoregressive_generate(target, prompt, **common, **timing)
        return speculative_generate(target, draft, prompt, gamma=gamma, **common, **timing)

    with torch.inference_mode():
        for decoder in caches:  # untimed: the caches hold the worked examples, and every path has run once
            decode(decoder, True, pair.examples, 0)
            decode(decoder, False, pair.examples[:, -32:], 0)
        timings = {d: FirstBlock() for d in DECODERS}
        counts = {d: AcceptanceCounts(0, 0, 0) for d in DECODERS if d[0] == "SD"}
        same = 0
        for i, prompt in enumerate(ids):
            texts = []
            for d in DECODERS:
                timing = timings[d]
                timing.start()
                result = decode(*d, prompt, i, on_block=timing.on_block)
                timing.stop(int(result.num_new_tokens.sum()))
                if d in counts:
                    counts[d] += result.stats.counts
                texts.append(result.sequences)
            same += int(torch.equal(texts[0], texts[2]) and torch.equal(texts[1], texts[3]))
            log(f"prompt {i + 1}/{len(ids)}")
    rows = []
    for (decoder, cached), timing in timings.items():
        row = {"decoder": decoder, "prompt_cache": cached, **FirstBlock.pooled([timing])}
        if (decoder, cached) in counts:
            row["alpha"], row["tau"] = counts[(decoder, cached)].alpha, counts[(decoder, cached)].tau
        rows.append(row)
    result = {
        "command": command(),
        "config": {
            "target": cfg.target,
            "draft": cfg.draft,
            "shots": shots,
            "prompt_tokens": lengths,
            "shared_tokens": shared,
            "gamma": gamma,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
        },
        "same_text": same,
        "rows": rows,
    }
    (out / "prompt_cache.json").write_text(json.dumps(result, indent=1))
    (out / "prompt_cache.md").write_text(format_table(result) + "\n")
    log(format_table(result))
    return result


def format_table(result: dict) -> str:
    config = result["config"]
    base = next(r for r in result["rows"] if r["decoder"] == "target alone" and not r["prompt_cache"])
    lines = [
        f"{len(config['prompt_tokens'])} prompts of {min(config['prompt_tokens'])}-{max(config['prompt_tokens'])} "
        f"tokens, the first {config['shared_tokens']} the same ({config['shots']} worked examples), "
        f"{config['max_new_tokens']} new tokens, T = {config['temperature']:g}, gamma {config['gamma']}",
        "",
        "| decoder | prompt cache | alpha | tau | first token, s | tokens/s | after the first token | "
        "tokens/s over the target alone without a cache |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        alpha, tau = (f"{r['alpha']:.3f}", f"{r['tau']:.2f}") if "alpha" in r else ("", "")
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        lines.append(
            f"| {r['decoder']} | {'yes' if r['prompt_cache'] else 'no'} | {alpha} | {tau} | {r['ttft_s']:.2f} | "
            f"{r['tokens_per_s']:.2f} | {r['decode_tokens_per_s']:.2f} | {ratio:.2f}x |"
        )
    lines += [
        "",
        f"With a cache each decoder gave the text it gave without one on {result['same_text']} of "
        f"{len(config['prompt_tokens'])} prompts.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="job config keys (target=..., draft=..., dataset=...)")
    parser.add_argument("--shots", type=int, default=4, help="worked examples before each question")
    parser.add_argument("--prompts", type=int, default=4, help="held-out questions")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("outputs/prompt-cache"))
    args = parser.parse_args()
    if args.shots < 1 or args.prompts < 1:
        parser.error("--shots and --prompts take a positive number")
    suite_prompt_cache(
        args.overrides,
        shots=args.shots,
        prompts=args.prompts,
        gamma=args.gamma,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        out=args.out,
    )


if __name__ == "__main__":
    run_main(main)
