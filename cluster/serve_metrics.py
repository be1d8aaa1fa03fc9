"""The endpoint's metrics on the Ray dashboard (Prometheus: ``ray_<name>``): requests by outcome, latency, alpha,
tau, tokens/s, the draft version, rollbacks, the gammas chosen live, the batch sizes and the prompt cache's hits."""

import time
from collections.abc import Callable

import psutil
from ray.serve import metrics

from distillspec.decoding.prompt_cache import PromptCache
from distillspec.serving.completer import Completion, merge_stats

#: name -> (kind, description, tag keys) of the endpoint's metrics (Prometheus: ``ray_<name>``)
SERVE_SPECS: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "distillspec_serve_requests": (metrics.Counter, "completion requests by outcome", ("status",)),
    "distillspec_serve_acceptance_rate": (metrics.Gauge, "alpha of the latest served batch", ()),
    "distillspec_serve_block_efficiency": (metrics.Gauge, "tau of the latest served batch", ()),
    "distillspec_serve_tokens_per_s": (metrics.Gauge, "completion tokens per second of the latest batch", ()),
    "distillspec_serve_latency_s": (metrics.Histogram, "request latency in seconds", ()),
    "distillspec_serve_draft_version": (metrics.Gauge, "draft weight version the replica serves", ()),
    "distillspec_serve_rollbacks": (metrics.Counter, "draft versions the replica rolled back (live alpha fell)", ()),
    "distillspec_serve_gamma": (metrics.Histogram, "draft tokens per block chosen by gamma=auto", ()),
    "distillspec_serve_batch_size": (metrics.Histogram, "requests decoded together in one batch (torch backend)", ()),
    "distillspec_serve_expected_tokens_per_s": (
        metrics.Gauge,
        "gamma=auto: tokens/s its choices were expected to reach (moving average over blocks)",
        (),
    ),
    "distillspec_serve_measured_tokens_per_s": (
        metrics.Gauge,
        "gamma=auto: tokens/s the blocks reached (moving average over blocks)",
        (),
    ),
    "distillspec_serve_prompt_tokens_looked_up": (
        metrics.Counter,
        "prompt tokens the models looked up in the prompt cache (serve.prompt_cache_mb; the target's and the draft's)",
        (),
    ),
    "distillspec_serve_prompt_tokens_reused": (
        metrics.Counter,
        "prompt tokens found there, whose keys and values were not computed again",
        (),
    ),
}
LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class ServeMetrics:
    """A replica's metrics (``metrics[name]``: one of :data:`SERVE_SPECS`)."""

    def __init__(self, max_gamma: int, max_batch_size: int) -> None:
        boundaries = {
            "distillspec_serve_latency_s": LATENCY_BOUNDARIES,
            "distillspec_serve_gamma": [g + 0.5 for g in range(max_gamma)],  # one bucket per gamma
            "distillspec_serve_batch_size": [b + 0.5 for b in range(max_batch_size)],  # one bucket per size
        }
        self.metrics = {
            name: kind(
                name, description=d, tag_keys=tags, **({"boundaries": boundaries[name]} if name in boundaries else {})
            )
            for name, (kind, d, tags) in SERVE_SPECS.items()
        }
        self.gamma_counted: dict[str, int] = {}  #: gamma=auto: the choices already on the dashboard, by gamma
        self.gamma_polled = 0.0  #: when they were last brought to the dashboard (at most once a second)
        self.prompts_counted = (0, 0)  #: the prompt cache's counts (looked up, reused) already on the dashboard

    def __getitem__(self, name: str):
        return self.metrics[name]

    def count(self, status: str) -> None:
        self.metrics["distillspec_serve_requests"].inc(tags={"status": status})

    def observe(
        self, done: list[Completion], gamma_summary: Callable[[], dict | None], prompts: PromptCache | None = None
    ) -> None:
        """Alpha, tau and tokens/s of completions ``done``, gamma=auto's choices (at most once a second), and what the
        prompt cache ``prompts`` found since the last call."""
        sd = merge_stats([c.stats for c in done])
        if sd["alpha"] is not None:
            self.metrics["distillspec_serve_acceptance_rate"].set(sd["alpha"])
        if sd["tau"] is not None:
            self.metrics["distillspec_serve_block_efficiency"].set(sd["tau"])
        seconds = max(c.seconds for c in done)
        self.metrics["distillspec_serve_tokens_per_s"].set(sum(c.completion_tokens for c in done) / max(seconds, 1e-9))
        if prompts is not None:
            asked, hits = prompts.asked, prompts.hits
            for name, now, before in zip(
                ("distillspec_serve_prompt_tokens_looked_up", "distillspec_serve_prompt_tokens_reused"),
                (asked, hits),
                self.prompts_counted,
            ):
                if now > before:
                    self.metrics[name].inc(now - before)
            self.prompts_counted = (asked, hits)
        if time.monotonic() - self.gamma_polled >= 1.0:  # the choices' running counts: nothing is lost between
            self.gamma_polled = time.monotonic()
            if (summary := gamma_summary()) is not None:
                self.gamma(summary)

    def gamma(self, summary: dict) -> None:
        """The gammas chosen since the last call (from the summary's running counts) and the expected and measured
        tokens/s, on the dashboard."""
        for gamma, n in summary["chosen"].items():
            for _ in range(n - self.gamma_counted.get(gamma, 0)):
                self.metrics["distillspec_serve_gamma"].observe(int(gamma))
        self.gamma_counted = dict(summary["chosen"])
        if summary["expected_tokens_per_s"] is not None and summary["measured_tokens_per_s"] is not None:
            self.metrics["distillspec_serve_expected_tokens_per_s"].set(summary["expected_tokens_per_s"])
            self.metrics["distillspec_serve_measured_tokens_per_s"].set(summary["measured_tokens_per_s"])


def cpu_seconds() -> float:
    """CPU seconds this replica's process and its children (vLLM's engine core) have run so far: the machine's work
    its serving took, whatever share of the cores other processes held meanwhile."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # a child that ended meanwhile
            continue
        total += times.user + times.system
    return total
