"""A local autoscaling cluster built from ``ray_cluster.yaml``: Ray's real autoscaler over its fake multi-node
provider, which starts each worker "node" as a local raylet with the resources its type declares (GPUs as logical
resources). For dry runs of a cluster job (``ray.gpu_dry_run=true``) on a machine without GPUs:

    python -m cluster.autoscaling up                    # prints the address; workers come when a job needs them
    RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:<dashboard port> --working-dir . -- \\
        python jobs/distill.py device=cpu ray.gpu_dry_run=true learner.use_gpu=true rollout.gpus=1 evaluator.gpus=0.5
    python -m cluster.autoscaling status                # nodes by type
    python -m cluster.autoscaling down

The worker node types keep their names, ``min_workers``, ``max_workers`` and GPU counts; CPUs and memory are scaled
down to this machine. The fake provider names the head type ``ray.head.default``; the head has no GPU. The cluster
lives in its own temp folder, so ``down`` stops only its processes (not another Ray cluster on the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml
from ray.util.state import list_nodes

from distillspec.errors import DistillSpecError

HEAD_TYPE = "ray.head.default"  #: the fake provider's name for the head's type
STATE = Path(os.environ.get("DISTILLSPEC_AUTOSCALING_STATE", "/tmp/distillspec-autoscaling.json"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_processes(attr: str, match: Callable[[Any], bool]) -> int:
    """Kill every process whose psutil ``attr`` (``cmdline``, ``environ``) ``match`` accepts; returns how many."""
    mine = []
    for proc in psutil.process_iter([attr]):
        try:
            if match(proc.info[attr]):
                mine.append(proc)
        except (psutil.Error, TypeError):
            continue
    for proc in mine:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(mine, timeout=10)
    return len(mine)


def local_config(
    cluster_yaml: str | Path,
    *,
    gcs_address: str,
    head_cpus: float = 1,
    worker_cpus: float = 1,
    object_store_memory: int = 150_000_000,
    idle_timeout_minutes: float = 0.25,
) -> dict:
    """The autoscaler config of the local cluster: ``cluster_yaml``'s worker node types (names, min/max workers,
    GPUs) with ``worker_cpus`` CPUs each, and a head with ``head_cpus`` CPUs and no GPU."""
    spec = yaml.safe_load(Path(cluster_yaml).read_text())
    head = spec["head_node_type"]
    workers = {}
    for name, node in spec["available_node_types"].items():
        if name == head:
            continue
        gpus = node.get("resources", {}).get("GPU", 0)
        workers[name] = {
            "resources": {"CPU": worker_cpus, "GPU": gpus, "object_store_memory": object_store_memory},
            "node_config": {},
            "min_workers": node.get("min_workers", 0),
            "max_workers": node.get("max_workers", spec.get("max_workers", 2)),
        }
    return {
        "cluster_name": f"{spec['cluster_name']}-local",
        "max_workers": spec.get("max_workers", 2),
        "upscaling_speed": spec.get("upscaling_speed", 1.0),
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            **workers,
            HEAD_TYPE: {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
        },
        "head_node_type": HEAD_TYPE,
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class LocalAutoscalingCluster:
    """Start, inspect and stop one local autoscaling cluster (see the module docstring)."""

    def __init__(self, cluster_yaml: str | Path = "ray_cluster.yaml", *, head_cpus: float = 1, **scale) -> None:
        self.cluster_yaml, self.head_cpus, self.scale = Path(cluster_yaml), head_cpus, scale
        self.port, self.dashboard_port = free_port(), free_port()
        self.temp_dir = Path(f"/tmp/rayas-{self.port}")  # short: Unix socket paths have a length limit
        self.ip = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self) -> None:
        config = local_config(self.cluster_yaml, gcs_address=self.address, head_cpus=self.head_cpus, **self.scale)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        config_file = self.temp_dir / "autoscaling.yaml"
        config_file.write_text(yaml.safe_dump(config))
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"}
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
            f"--node-ip-address={self.ip}", f"--port={self.port}", f"--temp-dir={self.temp_dir}",
            f"--autoscaling-config={config_file}", f"--num-cpus={self.head_cpus}", "--num-gpus=0",
            "--object-store-memory=150000000", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}", "--disable-usage-stats",
            # Ports of its own, beside another Ray cluster on this machine (e.g. a test session's).
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
            f"--ray-client-server-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            self.stop()
            raise DistillSpecError(f"the local autoscaling cluster did not start: {done.stderr.strip()[-800:]}")

    def stop(self) -> int:
        """Kill this cluster's processes (found by its temp folder); returns how many."""
        return kill_processes("cmdline", lambda cmdline: any(str(self.temp_dir) in part for part in cmdline or []))

    def events(self) -> list[str]:
        """The autoscaler's launches and terminations so far, with their timestamps (from its monitor log)."""
        log = self.temp_dir / "session_latest" / "logs" / "monitor.log"
        if not log.exists():
            return []
        lines = log.read_text(errors="replace").splitlines()
        return [line for line in lines if ":event_summary:Adding" in line or ":event_summary:Removing" in line]

    def node_type(self, resources: dict[str, float], head: bool) -> str:
        """The node type of a node of this cluster, from its resources (the types differ in their GPU counts)."""
        if head:
            return HEAD_TYPE
        by_gpus = {
            node["resources"].get("GPU", 0): name
            for name, node in local_config(self.cluster_yaml, gcs_address=self.address)["available_node_types"].items()
        }
        return by_gpus.get(resources.get("GPU", 0), "?")

    def kill_node(self, node_id: str) -> int:
        """Kill a worker node of this cluster as a lost machine goes: its raylet and every process it started
        (found by the node id the fake provider gives them); returns how many."""
        return kill_processes("environ", lambda env: (env or {}).get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id)

    def to_dict(self) -> dict:
        return {"cluster_yaml": str(self.cluster_yaml), "port": self.port, "dashboard_port": self.dashboard_port}

    @classmethod
    def from_dict(cls, d: dict) -> LocalAutoscalingCluster:
        cluster = cls(d["cluster_yaml"])
        cluster.port, cluster.dashboard_port = d["port"], d["dashboard_port"]
        cluster.temp_dir = Path(f"/tmp/rayas-{cluster.port}")
        return cluster


def nodes_by_type(cluster: LocalAutoscalingCluster) -> tuple[dict[str, int], dict[str, str]]:
    """The cluster's alive nodes counted by type, and the type of every node seen (dead ones too) by node id.
    The state API needs Ray's auth token: ``RAY_AUTH_MODE=token``."""
    counts: dict[str, int] = {}
    types: dict[str, str] = {}
    for node in list_nodes(address=cluster.dashboard, detail=True):
        kind = types[node.node_id] = cluster.node_type(node.resources_total, node.is_head_node)
        if node.state == "ALIVE":
            counts[kind] = counts.get(kind, 0) + 1
    return counts, types


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--cluster-yaml", default="ray_cluster.yaml")
    args = parser.parse_args(argv)
    if args.command == "up":
        if STATE.exists():
            sys.exit(f"error: a local autoscaling cluster is up ({STATE}): run `python -m cluster.autoscaling down`")
        cluster = LocalAutoscalingCluster(args.cluster_yaml)
        try:
            cluster.start()
        except DistillSpecError as exc:
            sys.exit(f"error: {exc}")
        STATE.write_text(json.dumps(cluster.to_dict()))
        print(f"address {cluster.address}; dashboard and jobs {cluster.dashboard}")
        return
    if not STATE.exists():
        sys.exit("error: no local autoscaling cluster is up")
    cluster = LocalAutoscalingCluster.from_dict(json.loads(STATE.read_text()))
    if args.command == "status":
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        print(json.dumps(nodes_by_type(cluster)[0]))
        print("\n".join(cluster.events()))
    else:
        print(f"stopped {cluster.stop()} processes")
        STATE.unlink()
        time.sleep(0.5)


if __name__ == "__main__":
    main()
