"""The endpoint under load.

Suite ``serve``: the endpoint (one replica) under 400 requests at concurrency 8 on the task's test prompts, T = 1:
speculation off, SD with the garden draft, SD while the learner's weight store swaps in the distilled draft, and SD
with the distilled draft. Reports errors, p50/p95 latency, tokens/s, alpha and tau, and the draft versions.

    python benchmarks/benchmark.py serve --distilled outputs/distill/draft

Suite ``soak``: --budget seconds (e.g. 1200) of mixed traffic at concurrency 8 (temperatures, streams, gamma auto,
fixed or off) with a new draft version every minute: errors and the replica's memory over time.

    python benchmarks/benchmark.py soak --budget 1200

Suite ``fuzz``: Schemathesis (``pip install -e .[fuzz]``) sends property-based requests to every route of the OpenAPI
schema and the suite counts the answers with a 5xx.

    python benchmarks/benchmark.py fuzz
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import ray
import requests
import torch
from ray import serve
from ray.util.state import list_actors

from actors.common import NAMESPACE, weights_name
from actors.weights import WeightStore, publish
from benchmarks.suites.traffic import load
from cluster.connect import connect
from cluster.serve_job import start
from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.models.loading import load_model
from distillspec.models.pretrained import resolve_models
from distillspec.tasks.data import load_task


def suite_serve(overrides: list[str], budget: float, out: Path, distilled: str | None = None) -> dict:
    """The endpoint under load: SD vs speculation off, before and after distillation, and a swap under load."""
    del budget
    cfg = resolve_models(load_config(None, ["ray.run_name=serve-bench", "serve.follow.sync_every_s=0.5", *overrides]))
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
        load(url, prompts, 16, conc, body)  # warm-up
        rows["sd_before"] = load(url, prompts, n, conc, body)
        rows["no_sd"] = load(url, prompts, n, conc, {**body, "speculative": False})
        swapped = []

        def swap(done: int) -> None:
            if done >= n // 4 and not swapped:
                swapped.append(time.perf_counter())
                publish(store, new_draft, 1, serving=True)

        rows["sd_swap"] = load(url, prompts, n, conc, body, during=swap)
        rows["sd_after"] = load(url, prompts, n, conc, body)
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


class SoakTraffic:
    """The soak's clients: ``workers`` threads sending mixed requests until :meth:`stop` (temperatures 0, 0.7 and 1;
    one request in three streamed; gamma auto, 3 or speculation off), counting answers, streams and errors (a non-200
    answer, a stream without ``[DONE]`` or with an error event) and the draft versions that answered."""

    def __init__(self, url: str, prompts: list[str], workers: int = 8) -> None:
        self.url, self.prompts = url, prompts
        self.lock, self.issued, self.stopping = threading.Lock(), itertools.count(), threading.Event()
        self.counts = {"ok": 0, "streams": 0, "errors": 0}
        self.errors: list[str] = []
        self.versions: set = set()
        self.threads = [threading.Thread(target=self.worker) for _ in range(workers)]
        for t in self.threads:
            t.start()

    def one(self, i: int, session: requests.Session) -> None:
        body = {"prompt": self.prompts[i % len(self.prompts)], "max_tokens": 32, "temperature": [0.0, 0.7, 1.0][i % 3]}
        body.update([{"gamma": "auto"}, {"gamma": 3}, {"speculative": False}][(i // 3) % 3])
        if i % 3 == 1:
            with session.post(f"{self.url}/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
                events = [x for x in r.iter_lines(decode_unicode=True) if x.startswith("data: ")]
            if r.status_code != 200 or events[-1:] != ["data: [DONE]"] or any('"error"' in e for e in events):
                raise RuntimeError(f"stream: status {r.status_code}, last events {events[-2:]}")
            with self.lock:
                self.counts["streams"] += 1
            return
        r = session.post(f"{self.url}/completions", json=body, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
        with self.lock:
            self.versions.add(r.json()["distillspec"]["draft_version"])

    def worker(self) -> None:
        session = requests.Session()
        while not self.stopping.is_set():
            i = next(self.issued)
            try:
                self.one(i, session)
                with self.lock:
                    self.counts["ok"] += 1
            except Exception as exc:
                with self.lock:
                    self.counts["errors"] += 1
                    self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join()


def suite_soak(overrides: list[str], budget: float, out: Path) -> dict:
    """Mixed traffic (:class:`SoakTraffic`) for ``--budget`` seconds at concurrency 8 on one replica, and a new draft
    version published every minute (the draft plus a little noise). Reports errors and the replica's resident memory
    over time."""
    cfg = resolve_models(load_config(None, ["ray.run_name=soak", "serve.follow.sync_every_s=0.5", *overrides]))
    connect(cfg.ray)
    url = start(cfg)
    store = WeightStore.options(name=weights_name("soak"), namespace=NAMESPACE).remote("soak")
    draft = load_model(cfg.draft)[0]
    original = {k: v.clone() for k, v in draft.state_dict().items()}
    replica = next(a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "Completions" in a.class_name)
    memory = psutil.Process(replica.pid)
    traffic = SoakTraffic(url, [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test])
    start_time = time.perf_counter()
    rss = [(0.0, memory.memory_info().rss)]
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
            print(f"  {elapsed:5.0f}s: {traffic.counts} replica RSS {rss[-1][1] / 2**20:.0f} MiB, version {version}")
    finally:
        traffic.stop()
        stats = requests.get(f"{url}/stats", timeout=10).json()
        serve.shutdown()
        ray.kill(store)
    return soak_report(budget, traffic, stats, version, rss)


def soak_report(budget: float, traffic: SoakTraffic, stats: dict, version: int, rss: list[tuple]) -> dict:
    """The soak's figures, printed and returned."""
    counts, errors = traffic.counts, traffic.errors
    warm = next((m for t, m in rss if t >= 60), rss[0][1])  # after the first minute: models loaded, caches warm
    result = {
        "seconds": budget,
        **counts,
        "error_samples": errors[:5],
        "versions_published": version,
        "versions_served": sorted(traffic.versions),
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
    del budget
    st = shutil.which("st") or str(Path(sys.executable).parent / "st")
    if not Path(st).exists():
        raise DistillSpecError('suite fuzz needs Schemathesis: pip install -e ".[fuzz]"')
    cfg = load_config(
        None, ["ray.run_name=fuzz", "serve.follow.sync_every_s=0", "serve.limits.max_tokens=16", *overrides]
    )
    cfg = resolve_models(cfg)
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
