"""Serve the target with its draft behind an OpenAI-compatible API (speculative decoding on Ray Serve).

    python jobs/serve.py --run outputs/distill             # what that jobs/distill.py run distilled, with its target
    python jobs/serve.py --draft outputs/distill/draft     # the same (a run's draft/ knows its target)
    python jobs/serve.py                                   # the undistilled garden pair, on http://127.0.0.1:8000
    DISTILLSPEC_API_KEY=secret python jobs/serve.py --target T --draft D serve.port=8001 serve.host=0.0.0.0
    python jobs/serve.py serve.record_prompts=true         # online distillation: feed served prompts to a job

Then, e.g. with the ``openai`` client: ``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
.chat.completions.create(model="distillspec", messages=[{"role": "user", "content": "..."}], max_tokens=32)``, or
``.completions.create(model="distillspec", prompt="...", max_tokens=32, extra_body={"gamma": 5})``.

The replicas follow the weight store of the distillation run ``serve.follow.run`` (default ``ray.run_name``):
start ``jobs/distill.py`` on the same Ray cluster and the endpoint serves each new draft version as it is
published. Stop with Ctrl-C.
"""

from __future__ import annotations

import logging
import signal
import time

from distillspec.cli import parse_job_args, run_main, sigterm_held
from distillspec.config import JobConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


APP = "distillspec"  #: the endpoint's Serve application
STREAMS_END_S = 0.5  #: seconds the replicas have, once told to stop, to send their streams' last events


def start(cfg: JobConfig, *, route_prefix: str = "/") -> str:
    """Deploy the endpoint for the resolved ``cfg`` on the connected Ray cluster (its routes under ``route_prefix``);
    returns its base URL."""
    from ray import serve

    from cluster.serve import bind

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up INFO lines; the job says its own
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(bind(cfg), name=APP, route_prefix=route_prefix)
    return f"http://{cfg.serve.host}:{cfg.serve.port}{route_prefix.rstrip('/')}/v1"


def stop(*, own_cluster: bool) -> None:
    """End the endpoint within seconds: its replicas end their streams with an error event and refuse new requests
    (:meth:`cluster.serve.Completions.stop`), then the cluster this job started goes (or, on a cluster it joined, the
    application alone)."""
    import ray
    from ray import serve

    from cluster.stopping import stop_signal

    if ray.is_initialized():
        ray.get(stop_signal(APP).set.remote())
        time.sleep(STREAMS_END_S)
        if not own_cluster:
            serve.delete(APP)
    ray.shutdown()


def main(cfg: JobConfig) -> None:
    from cluster.connect import connect
    from cluster.serve import API_KEY_ENV, with_api_key
    from distillspec.models.pretrained import resolve_models

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


def cli(argv: list[str] | None = None) -> None:
    """The console script: a user's mistake is one line and exit status 2."""
    run_main(lambda: main(parse_job_args(__doc__, argv, ("target", "draft", "dataset", "run"), job="serve")))


if __name__ == "__main__":
    cli()
