"""The cluster job on Ray's own autoscaler: ``ray_cluster.yaml``'s node types on Ray's fake multi-node provider (each
worker "node" a local raylet declaring its GPUs as logical resources), the job submitted as users submit it, in the
GPU dry run (GPU shares asked for, computation on CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from cluster.autoscaling import HEAD_TYPE, LocalAutoscalingCluster, local_config, nodes_by_type
from distillspec import DistillSpecError
from distillspec.config import load_config

from .conftest import ROOT

GPU_SETTINGS = ["device=cpu", "ray.gpu_dry_run=true", "learner.use_gpu=true", "rollout.gpus=1", "evaluator.gpus=0.5"]


def test_the_local_cluster_keeps_the_cluster_yamls_node_types():
    spec = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    config = local_config(ROOT / "ray_cluster.yaml", gcs_address="127.0.0.1:1")
    workers = {k: v for k, v in spec["available_node_types"].items() if k != spec["head_node_type"]}
    local = config["available_node_types"]
    assert set(local) == {*workers, HEAD_TYPE}
    for name, node in workers.items():
        assert local[name]["resources"]["GPU"] == node["resources"]["GPU"] > 0
        assert (local[name]["min_workers"], local[name]["max_workers"]) == (node["min_workers"], node["max_workers"])
        assert local[name]["min_workers"] == 0  # no GPU worker at the start
    assert "GPU" not in local[HEAD_TYPE]["resources"] and config["provider"]["type"] == "fake_multinode"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["device=cuda", "ray.gpu_dry_run=true", "learner.use_gpu=true"], "computes on CPU but device='cuda'"),
        (["ray.gpu_dry_run=true"], "no GPU share is asked for"),
        (["learner.use_gpu=true"], "set device=cuda, or ray.gpu_dry_run=true"),
    ],
)
def test_the_gpu_dry_run_is_refused_where_it_makes_no_sense(overrides, message):
    with pytest.raises(DistillSpecError, match=message):
        load_config(None, overrides)
    assert load_config(None, GPU_SETTINGS).ray.gpu_dry_run


@pytest.fixture(scope="module")
def autoscaling(ray_cluster):
    """``ray_cluster``: the session's own cluster; connecting to it turns on this process's Ray auth token, which the
    state API sends to the autoscaling cluster too."""
    cluster = LocalAutoscalingCluster(ROOT / "ray_cluster.yaml", head_cpus=1, worker_cpus=1, idle_timeout_minutes=0.2)
    cluster.start()
    yield cluster
    cluster.stop()


class NodeWatch:
    """Alive nodes by type, polled every second from the cluster's state API: a timeline of changes."""

    def __init__(self, cluster: LocalAutoscalingCluster) -> None:
        self.cluster, self.timeline, self.types, self.error = cluster, [], {}, None
        self.stopping, self.start = threading.Event(), time.monotonic()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopping.wait(1.0):
            try:
                now, types = nodes_by_type(self.cluster)
            except Exception as exc:  # the cluster's dashboard may be busy: try again
                self.error = f"{type(exc).__name__}: {exc}"
                continue
            self.types.update(types)
            if not self.timeline or self.timeline[-1][1] != now:
                self.timeline.append((round(time.monotonic() - self.start, 1), now))

    def workers(self) -> int:
        return sum(n for kind, n in self.timeline[-1][1].items() if kind != HEAD_TYPE) if self.timeline else -1

    def wait_for(self, condition, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.timeline and condition():
                return True
            time.sleep(1.0)
        return False


def test_the_cluster_job_scales_gpu_nodes_from_zero_survives_losing_nodes_and_scales_back(
    autoscaling, tiny_garden, tmp_path, monkeypatch
):
    """The job, submitted as users submit it, gets GPU nodes from zero and places its actors there. A lost node is
    replaced by the autoscaler: rollout actors are recreated, and the learner resumes from its last checkpoint; the
    ledger balances and the train log has every step once. Idle, the GPU nodes go away. (One job for all of it: a job
    on fresh nodes takes minutes to start here.)"""
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    from actors.learner import latest_step

    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # the CLI sends Ray's auth token
    watch = NodeWatch(autoscaling)
    assert watch.wait_for(lambda: watch.timeline[-1][1].get(HEAD_TYPE) == 1, 60), (watch.timeline, watch.error)
    assert watch.workers() == 0  # no GPU worker at the start
    out, steps, job = tmp_path / "run", 48, "autoscaling-test"
    submit = [
        sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", autoscaling.dashboard,
        "--submission-id", job, "--no-wait",
        "--", sys.executable, str(ROOT / "jobs" / "distill.py"),
        "--target", str(tiny_garden.target), "--draft", str(tiny_garden.draft),
        "--output-dir", str(out), *GPU_SETTINGS, "learner.cpus=0.5", "rollout.cpus=0.25", "rollout.workers=1",
        "evaluator.cpus=0.25", f"distill.steps={steps}", "distill.checkpoint_every=4", "evaluator.every=8",
        "distill.batch_size=4", "distill.max_new_tokens=8", "eval.max_new_tokens=8", "eval.batch_size=4",
        "eval.num_prompts=4", "eval.gammas=[2]", "eval.temperatures=[0]", "eval.speedup_prompts=0",
        "evaluator.prompts=4", "learner.take_timeout_s=300", "ray.log_to_driver=true",
    ]  # fmt: skip
    env = {**os.environ, "TQDM_DISABLE": "1"}
    for _ in range(10):  # the head's job agent takes a moment after the cluster starts
        done = subprocess.run(submit, capture_output=True, text=True, timeout=300, env=env, check=False)
        if "No available agent to submit job" not in done.stderr:
            break
        time.sleep(2)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    client = JobSubmissionClient(autoscaling.dashboard)

    def node_of(class_name: str) -> str | None:
        alive = list_actors(address=autoscaling.dashboard, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
        return next((a.node_id for a in alive if a.class_name == class_name), None)

    def wait(condition, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            status = client.get_job_status(job)
            assert status not in (JobStatus.FAILED, JobStatus.STOPPED), client.get_job_logs(job)[-4000:]
            assert time.monotonic() < deadline, client.get_job_logs(job)[-4000:]
            time.sleep(1.0)

    wait(lambda: (latest_step(out) or 0) >= 4, 600)
    rollout_node = node_of("RolloutActor")
    learner_node = node_of("RayTrainWorker")
    assert rollout_node and learner_node and rollout_node != learner_node
    killed = {"rollout": (rollout_node, autoscaling.kill_node(rollout_node), latest_step(out))}
    wait(lambda: (latest_step(out) or 0) >= killed["rollout"][2] + 8)
    learner_node = node_of("RayTrainWorker")
    killed["learner"] = (learner_node, autoscaling.kill_node(learner_node), latest_step(out))
    wait(lambda: client.get_job_status(job) == JobStatus.SUCCEEDED, 600)
    logs = client.get_job_logs(job)
    assert (out / "results.json").exists() and (out / "draft" / "config.json").exists()
    peak = max(sum(n for kind, n in c.items() if kind != HEAD_TYPE) for _, c in watch.timeline)
    assert peak >= 1, watch.timeline

    placed: dict[str, set[str]] = {}
    for actor in list_actors(address=autoscaling.dashboard, detail=True, limit=1000):
        placed.setdefault(actor.class_name, set()).add(watch.types.get(actor.node_id, "?"))
    for name in ("RolloutActor", "EvalActor", "RayTrainWorker"):
        assert placed.get(name) and HEAD_TYPE not in placed[name] and "?" not in placed[name], placed

    for role, (node, processes, step) in killed.items():
        print(f"\nkilled the {role}'s node {node[-5:]} ({processes} processes) at checkpoint step {step}")
    ledger = re.search(r"pipeline: .*", logs)
    resumed = re.findall(r"resumed from the checkpoint at step (\d+)", logs)
    refusals = json.loads((out / "results.json").read_text())["training"]["ledger"]["refusals"]
    print(ledger[0] if ledger else "no ledger line", f"\nthe learner resumed at steps {resumed}")
    print(f"refused batches: {refusals}")
    assert ledger and "(balanced)" in ledger[0], logs[-3000:]
    # The store owns every version's bytes: a rollout actor recreated on a new node loads the version current then,
    # not its initial weights. A batch may still go stale while a new process samples its first one (the learner
    # takes a step a second here), but none is older than the versions published before the first node was lost.
    for reason in refusals:
        made = re.fullmatch(r"version (-?\d+) is more than \d+ behind \d+", reason)
        assert made and int(made[1]) >= killed["rollout"][2], refusals
    assert resumed and int(resumed[-1]) >= killed["learner"][2], resumed
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log] == list(range(1, steps + 1))  # every step once
    assert node_of("RolloutActor") is None  # the job ended; its actors are gone

    idle = watch.wait_for(lambda: watch.workers() == 0, 180)
    watch.stopping.set()
    print("\nnodes by type over time (seconds since the watch began):")
    for t, counts in watch.timeline:
        print(f"  {t:7.1f} s  {counts}")
    print("the autoscaler's events:\n  " + "\n  ".join(autoscaling.events()))
    print(f"actors by node type: { {k: sorted(v) for k, v in placed.items()} }")
    assert idle, watch.timeline  # the idle GPU nodes were removed
    events = autoscaling.events()
    assert any("Adding" in e for e in events) and any("Removing" in e for e in events), events
