"""Serve's autoscaling on the test session's cluster: replicas scale up under a ramp of concurrent requests and back
down when it stops, no request fails, and a replica that starts late serves the run's current draft version."""

from __future__ import annotations

import threading
import time

import requests

from distillspec.config import load_config

from .conftest import free_port

RUN = "autoscale-test"


def running_replicas() -> int:
    from ray import serve

    status = serve.status().applications["scaling"].deployments["Completions"]
    return status.replica_states.get("RUNNING", 0)


def test_replicas_follow_the_load_and_late_ones_serve_the_current_draft(ray_cluster, tiny_garden):
    import ray
    from ray import serve

    from actors.common import NAMESPACE, weights_name
    from actors.weights import WeightStore, publish
    from cluster.serve import bind
    from distillspec.models.loading import load_model

    store = WeightStore.options(name=weights_name(RUN), namespace=NAMESPACE).remote(RUN)
    draft = load_model(str(tiny_garden.draft))[0]
    publish(store, draft, 7, serving=True)  # the run's current version: every replica, early or late, must serve it
    port = free_port()
    cfg = load_config(
        None,
        [
            f"target={tiny_garden.target}", f"draft={tiny_garden.draft}", f"ray.run_name={RUN}",
            "serve.autoscaling.min_replicas=1", "serve.autoscaling.max_replicas=2",
            "serve.autoscaling.target_ongoing_requests=1", "serve.autoscaling.upscale_delay_s=1",
            "serve.autoscaling.downscale_delay_s=4", "serve.autoscaling.look_back_period_s=11",
            "serve.replica.cpus=0.2", "serve.batching.max_batch_size=2", "serve.follow.sync_every_s=0.5",
            "serve.gamma=2",
        ],
    )  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(bind(cfg), name="scaling", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1/completions"
    counts, versions, errors, stop, by_replica = [], [], [], threading.Event(), {}
    start = time.monotonic()

    def watch() -> None:
        while not stop.is_set():
            n = running_replicas()
            if not counts or counts[-1][1] != n:
                counts.append((round(time.monotonic() - start, 1), n))
            time.sleep(0.5)

    def client() -> None:
        while not stop.is_set():
            try:
                r = requests.post(url, json={"prompt": "12+7=", "max_tokens": 16, "temperature": 0}, timeout=120)
                if r.status_code != 200:
                    errors.append(r.text)
                else:
                    sd = r.json()["distillspec"]
                    versions.append(sd["draft_version"])
                    by_replica.setdefault(sd["replica"], set()).add(sd["draft_version"])
            except requests.RequestException as exc:
                errors.append(str(exc))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    clients = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    try:
        for c in clients:  # the ramp: one more concurrent client every second
            c.start()
            time.sleep(1.0)
        deadline = time.monotonic() + 120
        while max(n for _, n in counts) < 2 and time.monotonic() < deadline:
            time.sleep(1.0)
        time.sleep(5.0)
        peak = max(n for _, n in counts)
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=150)
    deadline = time.monotonic() + 120
    while running_replicas() > 1 and time.monotonic() < deadline:
        time.sleep(1.0)
    final = running_replicas()
    serve.shutdown()
    ray.kill(store)
    print(f"\nreplicas over time (s, running): {counts + [(round(time.monotonic() - start, 1), final)]}")
    print(f"requests {len(versions)} ok, {len(errors)} failed; versions served by each replica {by_replica}")
    assert peak >= 2 and final == 1, counts
    assert not errors, errors[:3]
    assert len(versions) > 20 and set(versions) == {7}  # late replicas too serve the current version
    assert len(by_replica) >= 2 and all(v == {7} for v in by_replica.values()), by_replica
