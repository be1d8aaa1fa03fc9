"""Traffic for the endpoint suites: completion requests from client threads, summarised, and a distill job that
joins the suite's Ray cluster to publish draft versions meanwhile."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import ray
import requests

from actors.common import NAMESPACE, weights_name
from distillspec.errors import DistillSpecError
from distillspec.serving.completer import merge_stats


def send(
    url: str, prompts: list[str], body: dict, concurrency: int, more: Callable[[int], bool], during=None
) -> tuple[list[dict], list[str], float]:
    """Completion requests from ``concurrency`` threads while ``more(i)`` holds for the i-th request (prompts in
    turn); ``during(ok_so_far)`` runs after each. Returns the responses (time since start, latency, completion
    tokens and SD statistics), the errors, and the wall-clock seconds."""
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


def load(url: str, prompts: list[str], n: int, concurrency: int, body: dict, during=None) -> dict:
    """``n`` completion requests from ``concurrency`` threads, summarised."""
    rows, errors, seconds = send(url, prompts, body, concurrency, lambda i: i < n, during)
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


def job_settings(overrides: list[str], budget: float) -> list[str]:
    """The config overrides of :func:`distill_job`'s job: ``budget`` seconds of training, no evaluator, a short final
    evaluation, then ``overrides``."""
    return [
        "evaluator.every=0",
        "learner.resume=false",
        f"distill.time_budget_s={budget}",
        "distill.steps=100000",
        "eval.gammas=[5]",
        "eval.temperatures=[1]",
        "eval.speedup_prompts=0",
        *overrides,
    ]


def distill_job(out: Path, overrides: list[str], budget: float) -> subprocess.Popen:
    """``jobs/distill.py`` joining this process's Ray cluster with :func:`job_settings`, its output under
    ``out/distill`` and its log in ``out/distill.log``."""
    job = [
        sys.executable,
        str(Path(__file__).resolve().parents[2] / "jobs" / "distill.py"),
        "--output-dir",
        str(out / "distill"),
        f"ray.address={ray.get_runtime_context().gcs_address}",
        *job_settings(overrides, budget),
    ]
    shutil.rmtree(out / "distill", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "distill.log").open("w") as log:
        return subprocess.Popen(job, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=log, stderr=subprocess.STDOUT)


def wait_for_store(proc: subprocess.Popen, run: str, timeout_s: float = 1800.0) -> None:
    """Until the weight store of the job ``proc`` (run ``run``) is up: its pipeline has started (the measurements
    before training come first), so an endpoint started now builds the target over the weights the run shares."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise DistillSpecError(f"the distill job ended (exit {proc.returncode}) before its pipeline started")
        try:
            ray.get_actor(weights_name(run), namespace=NAMESPACE)
            return
        except ValueError:
            time.sleep(2)
    raise DistillSpecError(f"no weight store of run {run} after {timeout_s:.0f}s")


def replica_use(url: str) -> tuple[Counter, float]:
    """The replica's decoding batches so far by their number of requests (empty where it does not batch them), and
    the CPU seconds it has run."""
    stats = requests.get(f"{url}/stats", timeout=30).json()
    return Counter({int(b): n for b, n in stats.get("batch_sizes", {}).items()}), stats["cpu_s"]
