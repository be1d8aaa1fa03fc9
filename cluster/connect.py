"""Joining a Ray cluster (``ray job submit``, ``ray.address``) or starting a local one sized for this machine."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

from actors.common import NAMESPACE
from distillspec.config import RayConfig

_DASHBOARD: list[str] = []  #: the dashboard address ray.init reported
_SESSION: list[str] = []  #: the session folder ray.init reported (its logs/ holds every process's log)


def _default_auth_notice(record: logging.LogRecord) -> bool:
    """Drops Ray's notice that a new local cluster uses token authentication, its default (a user need not act on
    it; ``RAY_AUTH_MODE=disabled`` still opts out, and Ray's notice that authentication is off still shows)."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def connect(cfg: RayConfig) -> str:
    """``ray.init`` once; returns how: ``joined <address>`` or ``started a local cluster``."""
    if ray.is_initialized():
        return "already connected"
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        context = ray.init(
            address=address, namespace=NAMESPACE, log_to_driver=cfg.log_to_driver, logging_level=logging.WARNING
        )
        how = f"joined {address}"
    else:  # address="local": never join a stale cluster recorded in Ray's temp folder.
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_default_auth_notice)
        context = ray.init(
            address="local",
            namespace=NAMESPACE,
            num_cpus=cfg.num_cpus,
            object_store_memory=cfg.object_store_memory,
            _metrics_export_port=cfg.metrics_export_port,
            log_to_driver=cfg.log_to_driver,
            logging_level=logging.WARNING,
        )
        how = "started a local cluster"
    _DASHBOARD[:] = [context.dashboard_url] if context.dashboard_url else []
    _SESSION[:] = [context.address_info.get("session_dir", "")]
    return how


def logs_dir() -> str | None:
    """Where this Ray session writes the logs of its processes (on the head node)."""
    return str(Path(_SESSION[0]) / "logs") if _SESSION and _SESSION[0] else None


def metrics_url() -> str | None:
    """The Prometheus endpoint of the metrics agent on this machine's node (``ray_*`` application metrics), at
    127.0.0.1 so that a browser on this machine opens it."""
    node = ray.get_runtime_context().get_node_id()
    port = next((n.get("MetricsExportPort") for n in ray.nodes() if n["NodeID"] == node), None)
    return f"http://127.0.0.1:{port}/metrics" if port else None


def dashboard_url() -> str | None:
    """The Ray dashboard's address, when the cluster runs one."""
    if not _DASHBOARD:
        return None
    url = _DASHBOARD[0]
    return url if url.startswith("http") else f"http://{url}"
