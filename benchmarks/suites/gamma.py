"""Suite ``gamma``: gamma chosen live against fixed gammas.

Tokens/s at the endpoint at concurrency 1, 4, 8 and 16 for gamma 0 (speculation off), 1, 3, 5, 7 and auto, settings
measured side by side; ``serve.temperature=0`` makes every setting decode the same tokens.

    python benchmarks/benchmark.py gamma serve.temperature=0
    python benchmarks/benchmark.py gamma serve.temperature=0 eval.max_new_tokens=16 --scale real --rounds 4 \
        -o outputs/real

With ``--distilling`` the draft improves during the run: at each concurrency a distill job trains the undistilled
draft for --budget seconds while the settings take turns, and the replica takes every version it publishes; the suite
adds tokens/s over each third of the run and the gamma chosen live over time.

    python benchmarks/benchmark.py gamma --distilling --budget 240
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
import requests
from ray import serve

from benchmarks.suites.traffic import distill_job, load, replica_use, send
from cluster.connect import connect
from cluster.serve_job import start
from distillspec.config import JobConfig, load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import pyplot
from distillspec.models.pretrained import resolve_models
from distillspec.serving.completer import merge_stats
from distillspec.tasks.data import load_task


@dataclass
class GammaRun:
    """One run of the suite: the endpoint's config, the settings that take turns and the traffic of a slice."""

    cfg: JobConfig
    run: list[str]  #: the overrides of the endpoint (and of the distill job, with ``distilling``)
    overrides: list[str]
    out: Path
    budget: float
    distilling: bool
    prompts: list[str] = field(default_factory=list)
    per_client: int = 8  #: requests per client per setting and round

    @property
    def vllm(self) -> bool:
        return self.cfg.serve.backend == "vllm"

    @property
    def settings(self) -> list[int | str]:
        # vLLM fixes gamma per engine and always speculates: no gamma 0 there
        return [1, 3, 5, 7, "auto"] if self.vllm else [0, 1, 3, 5, 7, "auto"]

    @property
    def body(self) -> dict:
        return {"max_tokens": self.cfg.eval.max_new_tokens}

    def with_gamma(self, gamma: int | str) -> JobConfig:
        return replace(self.cfg, serve=replace(self.cfg.serve, gamma=gamma))

    def deploy(self, c: int) -> dict:
        """The endpoint(s) of one concurrency: by setting, its URL."""
        if self.vllm:
            return {g: start(self.with_gamma(g), name=f"gamma-{g}", route_prefix=f"/gamma-{g}") for g in self.settings}
        if self.distilling:  # a store of its own: the replica starts on the undistilled draft
            cfg = replace(self.cfg, ray=replace(self.cfg.ray, run_name=f"gamma-bench-{c}"))
            return dict.fromkeys(self.settings, start(cfg))
        return dict.fromkeys(self.settings, start(self.cfg))

    def one_round(self, urls: dict, c: int, r: int, t0: float) -> list[dict]:
        """Every setting in turn (the order rotated by ``r``): a slice of ``per_client`` requests per client each."""
        slices, settings = [], self.settings
        for g in settings[r % len(settings) :] + settings[: r % len(settings)]:
            extra = {} if self.vllm else {"speculative": False} if g == 0 else {"gamma": g}
            more = lambda i, n=self.per_client * c: i < n
            sizes, cpu_s = replica_use(urls[g])
            rows, errors, seconds = send(urls[g], self.prompts, {**self.body, **extra}, c, more)
            if errors:
                raise DistillSpecError(f"gamma {g}, concurrency {c}: {len(errors)} errors, e.g. {errors[0]}")
            versions = [x["sd"]["draft_version"] for x in rows if x["sd"].get("draft_version") is not None]
            sizes_after, cpu_s_after = replica_use(urls[g])
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

    def slices(self, urls: dict, c: int, rounds: int) -> list[dict]:
        """The rounds of one concurrency: ``rounds`` of them, or with ``distilling`` as many as the job lasts."""
        t0, slices = time.perf_counter(), []
        if not self.distilling:
            for r in range(rounds):
                slices += self.one_round(urls, c, r, t0)
            return slices
        proc = distill_job(self.out / f"concurrency-{c}", [*self.run, *self.overrides, f"ray.run_name=gamma-bench-{c}"],
                           self.budget)  # fmt: skip
        while proc.poll() is None or not slices:
            slices += self.one_round(urls, c, len(slices) // len(self.settings), t0)
        if proc.wait() != 0:
            log = self.out / f"concurrency-{c}" / "distill.log"
            raise DistillSpecError(f"the distill job failed (exit {proc.returncode}); see {log}")
        return slices


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
    run = ["ray.run_name=gamma-bench", "serve.follow.sync_every_s=0", "serve.batching.max_batch_size=16"]
    if distilling:  # the replica takes every version the learner publishes; the job's actors get the other CPUs
        run += ["serve.follow.sync_every_s=1", "serve.follow.version=latest", "serve.replica.cpus=0.5"]
    bench = GammaRun(load_config(None, [*run, *overrides]), run, overrides, out, budget, distilling)
    if distilling and (bench.vllm or rounds):
        what = (
            "serve.backend=vllm (gamma fixed per engine)" if bench.vllm else "--rounds (rounds run until the job ends)"
        )
        raise DistillSpecError(f"--distilling: not with {what}")
    bench.cfg = resolve_models(bench.cfg)  # the pair to serve (the garden's, built once, where none is named)
    connect(bench.cfg.ray)
    bench.prompts = [e.prompt for e in load_task(bench.cfg.dataset, seed=bench.cfg.seed).test]
    # Requests per client per setting and round: a pretrained target 2, the garden 8 (2 while distilling, so that a
    # round is short against the run); rounds: a pretrained target 2, the garden 3.
    concurrencies, (default_rounds, bench.per_client) = (
        concurrency or [1, 4, 8, 16],
        (2, 2) if bench.cfg.target else (3, 8),
    )
    bench.per_client = 2 if distilling else bench.per_client
    table: dict[str, dict[str, dict]] = {}
    runs: dict[str, list[dict]] = {}  # each concurrency's slices
    chosen: dict = {}
    urls: dict = {}
    try:
        for c in concurrencies:
            if distilling or not urls:
                urls = bench.deploy(c)
                for url in set(urls.values()):  # warm-up: compiles nothing, measures first costs
                    load(url, bench.prompts, 32, 8, bench.body if bench.vllm else {**bench.body, "gamma": "auto"})
            runs[str(c)] = bench.slices(urls, c, rounds or default_rounds)
            table[str(c)] = _gamma_row(runs[str(c)], bench.settings)
            _print_concurrency(c, table[str(c)], bench.vllm)
            chosen = requests.get(f"{urls['auto']}/stats", timeout=10).json().get("auto_gamma", {})
            if distilling:
                serve.shutdown()
    finally:
        serve.shutdown()
        ray.shutdown()
    return gamma_report(bench, table, runs, chosen, concurrencies)


def _print_concurrency(c: int, row: dict, vllm: bool) -> None:
    print(f"concurrency {c}: " + ", ".join(f"gamma {g} {v['tokens_per_s']:.1f}" for g, v in row.items()))
    if not vllm:
        fill = ", ".join(f"gamma {g} {v['requests_per_batch']:.2f}" for g, v in row.items())
        print(f"  requests per decoding batch (of {c} clients): {fill}")


def gamma_report(bench: GammaRun, table: dict, runs: dict, chosen: dict, concurrencies: list[int]) -> dict:
    """The suite's tables (per second of wall-clock and of the replica's CPU time), printed, plotted and returned."""
    cfg, settings = bench.cfg, bench.settings
    what = "while a distill job publishes new draft versions, " if bench.distilling else ""
    print(
        f"\ntokens/s at the endpoint, {what}{cfg.eval.max_new_tokens} tokens, T = {cfg.serve.temperature:g}, "
        f"{cfg.dataset} prompts:"
    )
    _print_gamma_table(table, settings, "concurrency")
    # Per second of the replica's CPU time: what serving cost the machine, whatever share of the cores the clients
    # (and a distill job) held meanwhile, the share that moves a slice's wall-clock from one round to the next.
    cpu_table = {c: _gamma_row(slices, settings, "cpu_s") for c, slices in runs.items()}
    print("\nthe same per second of the replica's CPU time (its processes' user + system seconds):")
    _print_gamma_table(cpu_table, settings, "concurrency")
    result = {
        "table": table,
        "table_replica_cpu": cpu_table,
        "auto_gamma": chosen,
        "max_tokens": cfg.eval.max_new_tokens,
        "temperature": cfg.serve.temperature,
    }
    if bench.distilling:
        return result | _distilling_report(bench, runs)
    nan = float("nan")
    expected, measured = (chosen.get(f"{k}_tokens_per_s") or nan for k in ("expected", "measured"))
    print(
        f"gamma=auto over the run: chosen {chosen.get('chosen')}, tokens/s expected {expected:.1f}, "
        f"measured {measured:.1f}"
    )
    for settings_name, rates in (chosen.get("alpha_by_position") or {}).items():
        shown = " ".join("-" if r is None else f"{r:.3f}" for r in rates)
        print(f"acceptance by draft position (given the ones before accepted), {settings_name}: {shown}")
    _plot_gamma(table, settings, concurrencies, bench.out, cfg)
    return result


def _distilling_report(bench: GammaRun, runs: dict) -> dict:
    """A distilling run's thirds and the gamma chosen over time, printed and plotted."""
    settings = bench.settings
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
    clocks = {"wall-clock": thirds, "replica CPU": cpu_thirds}
    _plot_gamma_distilling(over_time, clocks, settings, bench.out, bench.cfg)
    return {"budget_s": bench.budget, "thirds": thirds, "thirds_replica_cpu": cpu_thirds, "slices": runs}


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


def _gamma_thirds(slices: list[dict], settings: list, clock: str = "seconds") -> list[dict]:
    """A distilling run's rounds in three parts (by order): each part's table row (``clock``: as in
    :func:`_gamma_row`), alpha and draft versions."""
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
    plt = pyplot()
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
    plt = pyplot()
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
