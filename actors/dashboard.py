"""The pipeline's dashboard metrics (``ray.util.metrics``), created lazily inside the process that sets them.

Prometheus sees each as ``ray_<name>`` (Ray prefixes application metrics); ``cluster/grafana_dashboard.json``
charts them.
"""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge

#: name -> (kind, description, tag keys)
SPECS: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "distillspec_acceptance_rate": (Gauge, "alpha of the current draft on held-out prompts", ("run",)),
    "distillspec_block_efficiency": (Gauge, "tau (tokens per target call) of the current draft", ("run",)),
    "distillspec_eval_version": (Gauge, "draft version of the latest evaluation", ("run",)),
    "distillspec_alpha_alarms": (Counter, "evaluations where alpha collapsed after a weight sync", ("run",)),
    "distillspec_learner_loss": (Gauge, "divergence of the latest learner step", ("run",)),
    "distillspec_learner_samples_per_s": (Gauge, "sequences trained per second", ("run",)),
    "distillspec_learner_tokens_per_s": (Gauge, "continuation tokens trained per second", ("run",)),
    "distillspec_weight_version": (Gauge, "latest draft version published by the learner", ("run",)),
    "distillspec_policy_lag": (Gauge, "weight versions between a batch's sampler and the learner", ("run",)),
    "distillspec_rollout_samples_per_s": (Gauge, "sequences sampled per second per rollout actor", ("run", "actor")),
    "distillspec_rollout_tokens_per_s": (Gauge, "tokens sampled per second per rollout actor", ("run", "actor")),
    "distillspec_buffer_size": (Gauge, "batches waiting in the buffer", ("run",)),
    "distillspec_samples": (Counter, "batches by ledger column", ("run", "column")),
    "distillspec_online_prompts": (Counter, "prompts the endpoint sent for online distillation", ("run",)),
    "distillspec_online_samples": (
        Counter,
        "completions with the target's scores the endpoint sent for online distillation",
        ("run",),
    ),
    "distillspec_weights_refused": (Counter, "published draft versions a consumer refused to load", ("run", "reason")),
    "distillspec_serving_version": (Gauge, "draft version that passed the serving gate", ("run",)),
    "distillspec_versions_refused": (Counter, "versions the serving gate refused, by reason", ("run", "reason")),
    "distillspec_rollbacks": (Counter, "serving versions rolled back after live alpha collapsed", ("run",)),
}

_made: dict[str, Any] = {}


def metric(name: str) -> Any:
    if name not in _made:
        kind, description, tags = SPECS[name]
        _made[name] = kind(name, description=description, tag_keys=tags)
    return _made[name]


def gauge(name: str, value: float, **tags: str) -> None:
    metric(name).set(float(value), tags=tags)


def count(name: str, value: float = 1.0, **tags: str) -> None:
    if value:
        metric(name).inc(float(value), tags=tags)
