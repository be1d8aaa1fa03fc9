"""What ``jobs/serve.py`` runs: the endpoint deployed on a Ray cluster (the Serve application of
:mod:`cluster.serve`), served until told to stop, then stopped within seconds."""

from __future__ import annotations

import logging
import signal
import time

import ray
from ray import serve

from cluster.connect import connect
from cluster.serve import API_KEY_ENV, bind, with_api_key
from cluster.stopping import stop_signal
from distillspec.cli import sigterm_held
from distillspec.config import JobConfig
from distillspec.models.pretrained import resolve_models

LOOPBACK = ("127.0.0.1", "localhost", "::1")  #: hosts that need no API key
APP = "distillspec"  #: the endpoint's Serve application
STREAMS_END_S = 0.5  #: seconds the replicas have, once told to stop, to send their streams' last events


def start(cfg: JobConfig, *, route_prefix: str = "/") -> str:
    """Deploy the endpoint for the resolved ``cfg`` on the connected Ray cluster (its routes under ``route_prefix``);
    returns its base URL."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up INFO lines; the job says its own
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(bind(cfg), name=APP, route_prefix=route_prefix)
    return f"http://{cfg.serve.host}:{cfg.serve.port}{route_prefix.rstrip('/')}/v1"


def stop(*, own_cluster: bool) -> None:
    """End the endpoint within seconds: its replicas end their streams with an error event and refuse new requests
    (:meth:`cluster.serve.Completions.stop`), then the cluster this job started goes (or, on a cluster it joined, the
    application alone)."""
    if ray.is_initialized():
        ray.get(stop_signal(APP).set.remote())
        time.sleep(STREAMS_END_S)
        if not own_cluster:
            serve.delete(APP)
    ray.shutdown()


def run(cfg: JobConfig) -> None:
    """Serve ``cfg``'s pair until Ctrl-C or SIGTERM, then stop within seconds (:func:`stop`)."""
    cfg = resolve_models(cfg)  # a wrong --run or --draft fails here, before Ray starts
    cfg = with_api_key(cfg)
    if cfg.serve.api_key is None and cfg.serve.host not in LOOPBACK:
        print(
            f"warning: serve.host={cfg.serve.host} without an API key: anyone who reaches port {cfg.serve.port} can "
            f"use the endpoint (set {API_KEY_ENV}, or serve.api_key)"
        )
    how = ""
    try:
        with sigterm_held():  # Ray's own handler would abort the process
            how = connect(cfg.ray)
        print(f"ray: {how}")
        url = start(cfg)
        key = "set (serve.api_key)" if cfg.serve.api_key else "none"
        print(f"target {cfg.target}\ndraft  {cfg.draft}")
        routes = "chat/completions, completions, models"
        print(f"serving {cfg.serve.model_name!r} at {url} ({routes}; API key: {key}); Ctrl-C stops")
        print(f"the draft follows the weight store of run {cfg.serve.follow.run or cfg.ray.run_name!r}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping the endpoint")
        stop(own_cluster=how.startswith("started"))
