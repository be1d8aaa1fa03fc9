"""Joining a Ray cluster (``ray job submit``, ``ray.address``) or starting a local one sized for this machine."""

from __future__ import annotations

import os

import ray

from actors.common import NAMESPACE
from distillspec.config import RayConfig


def connect(cfg: RayConfig) -> str:
    """``ray.init`` once; returns how: ``joined <address>`` or ``started a local cluster``."""
    if ray.is_initialized():
        return "already connected"
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return f"joined {address}"
    # address="local": never join a stale cluster recorded in Ray's temp folder.
    ray.init(
        address="local",
        namespace=NAMESPACE,
        num_cpus=cfg.num_cpus,
        object_store_memory=cfg.object_store_memory,
        _metrics_export_port=cfg.metrics_export_port,
    )
    return "started a local cluster"


def metrics_url() -> str | None:
    """The Prometheus endpoint of this node's metrics agent (``ray_*`` application metrics)."""
    node = ray.worker.global_worker.node
    port = getattr(node, "metrics_export_port", None)
    return f"http://{node.node_ip_address}:{port}/metrics" if port else None
