"""Suite ``latency``: wall-clock tokens/s at batch 1 of a pretrained pair, undistilled and distilled.

The target alone, and speculative decoding with the draft and with ``--distilled`` at each of ``eval.gammas`` and
``eval.temperatures``, one prompt at a time; this project's decoder, then vLLM (when installed) with the same drafts.

    python benchmarks/benchmark.py latency target=smollm2-135m-instruct draft=first:2 --distilled outputs/real/draft
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.measure import measure_speedup
from distillspec.models.loading import encode_prompts, load_model, load_pair
from distillspec.models.pretrained import resolve_pair
from distillspec.tasks.data import chat_prompts, load_task


def suite_latency(overrides: list[str], budget: float, out: Path, distilled: str | None = None) -> dict:
    """Wall-clock tokens/s at batch 1, one prompt at a time (``eval.speedup_prompts`` test prompts through the
    target's chat template, ``eval.max_new_tokens`` each): the target alone, and speculative decoding with the draft
    and with ``--distilled`` at each of ``eval.gammas`` and ``eval.temperatures``; this project's decoder, then vLLM
    (when installed) with the same drafts."""
    del budget
    cfg = load_config(None, overrides)
    if cfg.target is None:
        raise DistillSpecError("suite latency: give target=... and draft=... (and --distilled for a distilled draft)")
    target_dir, draft_dir = resolve_pair(cfg.target, cfg.draft)
    target, draft, tokenizer = load_pair(target_dir, draft_dir, device=cfg.device, dtype=cfg.dtype)
    task = chat_prompts(load_task(cfg.dataset, seed=cfg.seed), tokenizer, cfg.chat_template)
    prompts = [e.prompt for e in task.test[: cfg.eval.speedup_prompts]]
    drafts = {"undistilled": (draft_dir, draft)}
    if distilled:
        drafts["distilled"] = (str(Path(distilled).resolve()), load_model(distilled, device=cfg.device)[0])
    n = cfg.eval.max_new_tokens
    print(f"tokens/s at batch 1 over {len(prompts)} prompts x {n} tokens ({torch.get_num_threads()} torch threads)")
    rows = []
    for temperature in cfg.eval.temperatures:
        for name, (_, model) in drafts.items():
            for gamma in cfg.eval.gammas:
                r = measure_speedup(
                    target, model, tokenizer, prompts, gamma=gamma, temperature=temperature, max_new_tokens=n,
                    seed=cfg.seed, compile=cfg.eval.compile,
                )  # fmt: skip
                rows.append({"engine": "distillspec", "draft": name, "gamma": gamma, "temperature": temperature, **r})
                print(
                    f"  distillspec T={temperature:g} {name:>11} gamma {gamma}: target {r['target_tokens_per_s']:.1f}"
                    f" tok/s, SD {r['sd_tokens_per_s']:.1f} tok/s ({r['measured_speedup']:.2f}x), tau "
                    f"{r['speedup_tau']:.2f}, c {r['c']:.3f}"
                )
    if importlib.util.find_spec("vllm") is not None:
        from vllm import SamplingParams  # the optional extra

        from distillspec.serving.vllm_backend import acceptance_counts, start_engine

        ids = [encode_prompts(tokenizer, [p])[0][0].tolist() for p in prompts]

        def tokens_per_s(llm, temperature: float) -> tuple[float, float]:
            params = SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True, seed=cfg.seed)
            llm.generate([{"prompt_token_ids": ids[0]}], params, use_tqdm=False)  # warm-up
            before, start, made = acceptance_counts(llm.get_metrics()), time.perf_counter(), 0
            for x in ids:
                out = llm.generate([{"prompt_token_ids": x}], params, use_tqdm=False)
                made += len(out[0].outputs[0].token_ids)
            counts = acceptance_counts(llm.get_metrics()) - before
            return made / (time.perf_counter() - start), counts.tau

        engines = [("target alone", None, None)] + [(k, d, g) for k, (d, _) in drafts.items() for g in cfg.eval.gammas]
        base: dict[float, float] = {}  # the target alone's tokens/s per temperature
        for name, draft_path, gamma in engines:
            llm = start_engine(cfg.vllm, target_dir, draft=draft_path, gamma=gamma or 1, seed=cfg.seed)
            try:
                for temperature in cfg.eval.temperatures:
                    speed, tau = tokens_per_s(llm, temperature)
                    ratio = speed / base.setdefault(temperature, speed)
                    tau = tau if draft_path else None
                    rows.append({"engine": "vllm", "draft": name, "gamma": gamma, "temperature": temperature,
                                 "tokens_per_s": speed, "speedup": ratio, "tau": tau})  # fmt: skip
                    line = f"  vllm T={temperature:g} {name:>12} gamma {gamma or '-'}: {speed:.1f} tok/s ({ratio:.2f}x)"
                    print(line + (f", tau {tau:.2f}" if tau is not None else ""))
            finally:
                llm.llm_engine.engine_core.shutdown()
    return {"target": target_dir, "drafts": {k: d for k, (d, _) in drafts.items()}, "rows": rows}
