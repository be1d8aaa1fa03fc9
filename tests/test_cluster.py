"""ray_cluster.yaml and the Grafana dashboard: checked with Ray's own tools."""

import copy
import json

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from actors.dashboard import SPECS
from distillspec import DistillSpecError

from .conftest import ROOT


@pytest.fixture(scope="module")
def cluster():
    return yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())


def test_ray_cluster_yaml_passes_rays_schema_and_checks(cluster):
    # What `ray up` does before it starts anything: merge the provider's defaults, then validate.
    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)  # Ray's JSON schema and its config checks
    assert prepared["available_node_types"][prepared["head_node_type"]]["resources"].get("GPU", 0) == 0


def test_gpu_workers_autoscale_from_zero_and_install_the_gpu_extra(cluster):
    workers = {k: v for k, v in cluster["available_node_types"].items() if k != cluster["head_node_type"]}
    assert workers and all(v["min_workers"] == 0 and v["resources"]["GPU"] >= 1 for v in workers.values())
    assert any('".[vllm]"' in c for c in cluster["setup_commands"])


def test_a_broken_cluster_yaml_is_refused(cluster):
    broken = copy.deepcopy(cluster)
    broken["available_node_types"]["gpu_1x"]["min_workers"] = "zero"
    with pytest.raises(Exception, match="zero"):
        validate_config(broken)


def test_grafana_dashboard_charts_every_pipeline_and_endpoint_metric():
    from cluster.serve_metrics import SERVE_SPECS

    dashboard = json.loads((ROOT / "cluster" / "grafana_dashboard.json").read_text())
    queries = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for name in [*SPECS, *SERVE_SPECS]:
        assert f"ray_{name}" in queries, name


def test_serve_config_passes_serves_schema_and_builds(tiny_garden):
    """cluster/serve_config.yaml is a valid Serve deploy config, and its builder makes the application."""
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from cluster.serve import build_app

    data = yaml.safe_load((ROOT / "cluster" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)
    app = schema.applications[0]
    assert app.import_path == "cluster.serve:build_app" and app.deployments[0].name == "Completions"
    args = {
        **app.args,
        "overrides": [*app.args["overrides"], f"target={tiny_garden.target}", f"draft={tiny_garden.draft}"],
    }
    assert isinstance(build_app(args), Application)
    with pytest.raises(DistillSpecError, match="unknown application args"):
        build_app({"overide": []})


def test_a_learner_that_cannot_be_placed_is_told_with_what_it_waits_for():
    """Ray Train waits for a worker's resources without a word: the job's console names the shortfall."""
    from cluster.pipeline import learner_wait_note

    note = learner_wait_note({"CPU": 1.0}, {"CPU": 0.75, "memory": 1e9}, 61.0)
    assert "asks for CPU 1 and the cluster has CPU 0.75 free" in note and "learner.cpus" in note and "61s" in note
    assert learner_wait_note({"CPU": 1.0}, {"CPU": 1.0}, 61.0) is None
    assert "GPU 1" in learner_wait_note({"CPU": 1.0, "GPU": 1.0}, {"CPU": 2.0}, 61.0)
