"""The asynchronous pipeline on a real (shared, local) Ray cluster with tiny real models."""

from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
import yaml

from actors.buffer import BufferActor
from actors.common import weights_name
from actors.evaluator import EvalActor, EvalSettings
from actors.learner import checkpoint_steps, latest_step
from actors.weights import WeightStore, publish
from cluster.connect import metrics_url
from cluster.pipeline import Pipeline
from distillspec.config import JobConfig, load_config
from distillspec.errors import DistillSpecError
from distillspec.models.loading import load_model, load_tokenizer
from distillspec.training.batches import BatchHeader, RolloutBatch, ServedSample
from jobs import distill

from .conftest import run_here, start_job

PIPELINE_TINY = [
    "distill.batch_size=4",
    "distill.max_new_tokens=8",
    "eval.max_new_tokens=8",
    "eval.batch_size=4",
    "evaluator.prompts=4",
    "learner.take_timeout_s=120",
]


def job_config(garden, out: Path, *overrides: str) -> JobConfig:
    return load_config(
        None,
        [f"target={garden.target}", f"draft={garden.draft}", f"output_dir={out}", *PIPELINE_TINY, *overrides],
    )


def scrape(name: str) -> list[float]:
    """Values of a ``ray_<name>`` series in this node's Prometheus export."""
    text = urllib.request.urlopen(metrics_url(), timeout=10).read().decode()
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"ray_{name}{{")]


def test_pipeline_trains_publishes_evaluates_and_balances(ray_cluster, tiny_garden, task, tmp_path):
    cfg = job_config(tiny_garden, tmp_path, "distill.steps=8", "distill.checkpoint_every=4", "evaluator.every=3")
    pipeline = Pipeline(cfg, task, tmp_path)
    try:
        result = pipeline.run()
        store_version = ray.get(pipeline.store.status.remote()).latest
        # one copy of the target for the scorer and the evaluator (ray.share_target), read from the object store
        shared = ray.get(ray.get(pipeline.store.shared_target.remote())[0])
    finally:
        pipeline.shutdown()
    assert shared.name == cfg.target and shared.dtype == "float32" and shared.arrays
    assert [r["step"] for r in result.train_log] == list(range(1, 9))
    assert all(np.isfinite(r["loss"]) and 0 <= r["lag"] <= cfg.buffer.max_policy_lag for r in result.train_log)
    ledger = result.ledger
    assert ledger["balanced"] and ledger["consumed"] == 8 and ledger["held"] == 0, ledger
    assert store_version == 8
    versions = [e["version"] for e in result.evaluations]
    assert versions == sorted(versions) and len(versions) >= 2 and versions[-1] == 8
    assert all(0 <= e["alpha"] <= 1 and 1 <= e["tau"] <= 6 for e in result.evaluations)
    assert load_model(str(result.draft_dir))[0].config.num_hidden_layers == 2
    assert list((tmp_path / "learner").glob("checkpoint_*/draft"))
    # The evaluation actor's gauges reach the node's Prometheus export (reported every few seconds).
    deadline = time.time() + 30
    while not scrape("distillspec_acceptance_rate") and time.time() < deadline:
        time.sleep(1)
    assert scrape("distillspec_acceptance_rate") and scrape("distillspec_learner_loss")


def test_killed_rollout_actor_is_replaced_and_ledger_balances(ray_cluster, tiny_garden, task, tmp_path):
    # Top-k target log-probs on the way (the large-vocabulary path): from a scoring actor for the draft's samples,
    # from the rollout actor itself for the target's (speculative decoding scored them). The rollouts sample with the
    # draft's int8 decoding copy, into which each new version is quantized.
    cfg = job_config(
        tiny_garden,
        tmp_path,
        "distill.steps=14",
        "distill.checkpoint_every=0",
        "distill.lambda1=0",
        "distill.lambda2=0.5",
        "evaluator.every=0",
        "learner.target_logits=scorer",
        "scorer.topk=16",
        "rollout.decoding_copy=true",
        "draft_int8=true",
    )
    pipeline = Pipeline(cfg, task, tmp_path)
    box = {}
    runner = threading.Thread(target=lambda: box.update(result=pipeline.run()))
    try:
        old_pid = ray.get(pipeline.rollouts[0].pid.remote())
        runner.start()
        while ray.get(pipeline.buffer.ledger.remote())["consumed"] < 3:
            time.sleep(0.2)
        ray.kill(pipeline.rollouts[0], no_restart=False)  # Ray restarts it and retries its call
        runner.join(timeout=300)
        new_pid = ray.get(pipeline.rollouts[0].pid.remote())
        versions = [ray.get(r.stats.remote())["version"] for r in pipeline.rollouts]
    finally:
        pipeline.shutdown()
    result = box["result"]
    assert new_pid != old_pid
    assert max(versions) > 0  # new versions reached the decoding copies
    assert len(result.train_log) == 14 and all(np.isfinite(r["loss"]) for r in result.train_log)
    assert {r["source"] for r in result.train_log} == {"draft", "target"}
    assert result.ledger["balanced"] and result.ledger["consumed"] == 14, result.ledger


def online_config(garden, out: Path, *overrides: str) -> JobConfig:
    """An online run of 3 steps, one rollout actor, no evaluator."""
    online = ["distill.steps=3", "distill.checkpoint_every=0", "evaluator.every=0", "rollout.workers=1"]
    return job_config(garden, out, *online, "rollout.online=true", *overrides)


def test_online_batches_mix_served_prompts_with_the_data_sets(ray_cluster, tiny_garden, task, tmp_path):
    cfg = online_config(tiny_garden, tmp_path, "rollout.online_min_prompts=2", "rollout.online_mix=0.5")
    pipeline = Pipeline(cfg, task, tmp_path)
    try:
        ray.get(pipeline.prompt_log.add.remote(["1+1=", "2+2=", "3+3="]))  # what an endpoint would have served
        result = pipeline.run()
        stats = ray.get(pipeline.rollouts[0].stats.remote())
    finally:
        pipeline.shutdown()
    assert len(result.train_log) == 3 and result.ledger["balanced"], result.ledger
    rows = stats["online_rows"]  # 2 served and 2 of the data set's a batch (a batch may still be in the making)
    assert rows["served"] == rows["data"] >= 2 * 3 and stats["made"] >= 3, stats


def served_samples(n: int, vocab: int, k: int = 4, temperature: float = 1.0) -> list[ServedSample]:
    """What an endpoint with serve.record_samples=k would send: prompts, completions, the target's top-k at each."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(n):
        tokens = rng.integers(0, vocab, 3 + i % 4).tolist()
        top = np.sort(np.log(rng.dirichlet(np.ones(k + 1), len(tokens))[:, :k]), 1)[:, ::-1].astype(np.float32)
        ids = np.stack([rng.choice(vocab, k, replace=False) for _ in tokens])
        samples.append(ServedSample(rng.integers(0, vocab, 5).tolist(), tokens, ids, top.copy(), temperature))
    return samples


def test_online_batches_of_served_samples_need_no_sampling_nor_scoring(ray_cluster, tiny_garden, task, tmp_path):
    cfg = online_config(
        tiny_garden, tmp_path, "rollout.online_samples=true", "distill.recipe=seqkd", "learner.target_logits=scorer"
    )
    pipeline = Pipeline(cfg, task, tmp_path)
    vocab = len(load_tokenizer(cfg.target))
    try:
        log = pipeline.prompt_log
        ray.get(log.add_samples.remote(served_samples(2, vocab, temperature=0.0)))  # another temperature: not taken
        ray.get(log.add_samples.remote(served_samples(3 * 4 + 1, vocab)))  # 3 batches of 4, one left over
        result = pipeline.run()
        stats, held = ray.get(pipeline.rollouts[0].stats.remote()), ray.get(log.stats.remote())
    finally:
        pipeline.shutdown()
    assert len(result.train_log) == 3 and result.ledger["balanced"], result.ledger
    assert {r["source"] for r in result.train_log} == {"target"} and all(
        np.isfinite(r["loss"]) for r in result.train_log
    )
    assert stats["online_rows"] == {"served": 0, "data": 0, "samples": held["samples_taken"]}, (stats, held)
    assert stats["version"] >= 0  # holding no draft, it still stamps its batches with the latest version
    assert held["samples_taken"] >= 3 * 4 and held["samples_received"] == 15
    assert held["samples_held"] == 15 - held["samples_taken"]
    # The feed waiting for a fourth batch's samples ended with the run (told to stop), its batches all reported.
    assert len(pipeline.sampled) == stats["made"] >= 3, (pipeline.sampled, stats)


def test_a_pipeline_and_an_endpoint_the_cluster_cannot_hold_together_are_refused(ray_cluster, tiny_garden, tmp_path):
    """The online suite's job (no evaluator) and its endpoint's replica of 0.5 CPU on a fixed cluster of 2 CPUs: a
    learner (1 CPU) and two rollouts (0.25 each) fit beside the replica; a scoring actor (0.25) more does not, and the
    learner would wait for the whole budget. Refused, naming both asks and the knobs; on a cluster an autoscaler may
    grow, a warning."""
    from benchmarks.suites.traffic import job_settings
    from cluster.pipeline import check_resources

    def suite_job(*overrides: str) -> JobConfig:
        garden = [f"target={tiny_garden.target}", f"draft={tiny_garden.draft}", f"output_dir={tmp_path}"]
        return load_config(None, job_settings([*garden, "serve.replica.cpus=0.5", *overrides], 60))

    check_resources(suite_job(), strict=True, endpoint=True)  # 1.5 CPUs and 0.5
    scored = suite_job("learner.target_logits=scorer")
    check_resources(scored, strict=True)
    with pytest.raises(DistillSpecError, match=r"asks for 1\.75 CPUs and its endpoint 0\.5 .* has 2: .*serve\.replica"):
        check_resources(scored, strict=True, endpoint=True)
    with pytest.warns(UserWarning, match="waiting for the autoscaler"):
        check_resources(scored, strict=False, endpoint=True)
    check_resources(suite_job("learner.target_logits=scorer", "serve.replica.cpus=0.25"), strict=True, endpoint=True)


def test_buffer_refuses_malformed_and_oversized_batches_with_reasons(ray_cluster):
    store = WeightStore.remote("refusals")
    buffer = BufferActor.options(name="refusals-buffer").remote(
        capacity=4, max_policy_lag=1, max_batch_tokens=64, vocab_size=100, run="refusals", store=store
    )
    ones = np.ones((2, 8), dtype=np.int64)

    def batch(**change) -> RolloutBatch:
        return RolloutBatch(
            **{"input_ids": ones, "attention_mask": ones, "loss_mask": ones, **change}, version=0, source="draft"
        )

    cases = [
        (
            batch(
                input_ids=np.ones((16, 8), dtype=np.int64), attention_mask=np.ones((16, 8)), loss_mask=np.ones((16, 8))
            ),
            "128 tokens > max_tokens 64",
        ),
        ({"input_ids": ones}, "a batch must be a RolloutBatch, got dict"),
        (batch(input_ids=np.full((2, 8), 100)), "token ids outside [0, 100)"),
        (batch(loss_mask=np.zeros((2, 8), dtype=np.int64)), "no position to learn from"),
    ]
    for bad, reason in cases:
        assert reason in ray.get(buffer.put.remote([ray.put(bad)]))
    assert ray.get(buffer.put.remote([ray.put(batch())])) == "ok"
    assert ray.get(buffer.take.remote(1, 5, 0.1)) == []  # the learner moves on: version 0 is now stale
    ray.get(store.publish.remote(5, [ray.put({})]))  # and the store holds version 5
    assert "behind" in ray.get(buffer.put.remote([ray.put(batch())]))
    ledger = ray.get(buffer.ledger.remote())
    assert ledger["refused"] == 5 and ledger["dropped"] == 1 and ledger["balanced"]
    assert [r for r in ledger["refusals"] if "max_tokens" in r]
    ray.kill(buffer)


@ray.remote(num_cpus=0)
class Producer:
    """A rollout actor whose batches are large enough to live in the object store (not inline in a reply)."""

    def __init__(self) -> None:
        self.calls = 0

    @ray.method(num_returns=2)
    def sample(self, max_tokens: int, vocab_size: int) -> tuple[BatchHeader, RolloutBatch]:
        self.calls += 1
        ids = np.ones((64, 512), dtype=np.int64)  # 256 KiB per array
        batch = RolloutBatch(ids, ids, ids, version=0, source="draft")
        return batch.header(max_tokens=max_tokens, vocab_size=vocab_size), batch

    def count(self) -> int:
        return self.calls


def test_buffer_pulls_a_batch_only_for_a_free_slot_and_keeps_it_when_its_producer_dies(ray_cluster):
    store = WeightStore.remote("pull")
    buffer = BufferActor.remote(
        capacity=1, max_policy_lag=4, max_batch_tokens=10**6, vocab_size=100, run="pull", store=store
    )
    producer = Producer.remote()
    feed = buffer.feed.remote(producer, 0, 2)
    deadline = time.monotonic() + 30
    while ray.get(buffer.ledger.remote())["held"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert ray.get(producer.count.remote()) == 1  # the buffer is full: it has not asked for a second batch
    ray.kill(producer, no_restart=True)  # the batch it returned is the buffer's: it outlives its producer
    (ref,) = ray.get(buffer.take.remote(1, 0, 5.0))
    assert ray.get(ref).rows == 64
    with pytest.raises(ray.exceptions.RayError):  # a slot opened; the dead producer's error ends the feed
        ray.get(feed, timeout=60)
    ledger = ray.get(buffer.ledger.remote())
    assert ledger["produced"] == ledger["consumed"] == 1 and ledger["balanced"], ledger
    ray.kill(buffer)


@ray.remote(num_cpus=0)
class Marker:
    """A scoring actor that attaches a distribution to each batch it scores, or fails."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    @ray.method(num_returns=2)
    def score(self, batch: RolloutBatch, max_tokens: int, vocab_size: int) -> tuple[BatchHeader, RolloutBatch]:
        if self.fail:
            raise ValueError("the scorer broke")
        batch.target_logits = np.zeros((batch.rows, 1, 4), np.float32)
        return batch.header(max_tokens=max_tokens, vocab_size=vocab_size), batch


def test_buffer_chains_a_scorer_to_the_rollout_and_holds_what_it_scored(ray_cluster):
    store = WeightStore.remote("chain")
    buffer = BufferActor.remote(
        capacity=2, max_policy_lag=4, max_batch_tokens=10**6, vocab_size=100, run="chain", store=store
    )
    (answer,) = ray.get(buffer.feed.remote(Producer.remote(), 0, 1, [Marker.remote()]))
    assert answer["status"] == "ok"
    (ref,) = ray.get(buffer.take.remote(1, 0, 5.0))
    assert ray.get(ref).target_logits.shape == (64, 1, 4)  # the scorer's copy, the one the buffer owns
    with pytest.raises(ray.exceptions.RayError, match="the scorer broke"):  # a scorer's error ends the feed
        ray.get(buffer.feed.remote(Producer.remote(), 0, 1, [Marker.remote(fail=True)]), timeout=60)
    ray.kill(buffer)


def test_buffer_put_waits_while_full_and_take_while_empty(ray_cluster):
    store = WeightStore.remote("waits")
    buffer = BufferActor.remote(
        capacity=1, max_policy_lag=4, max_batch_tokens=64, vocab_size=100, run="waits", store=store
    )
    ones = np.ones((2, 4), dtype=np.int64)
    batch = RolloutBatch(ones, ones, ones, version=0, source="draft")
    start = time.monotonic()
    assert ray.get(buffer.take.remote(1, 0, 0.5)) == []  # nothing came: it waited its time-out
    assert time.monotonic() - start >= 0.5
    waiting_take = buffer.take.remote(1, 0, 30.0)
    time.sleep(0.3)
    assert ray.get(buffer.put.remote([ray.put(batch)])) == "ok"
    assert len(ray.get(waiting_take)) == 1  # woken by the put
    assert ray.get(buffer.put.remote([ray.put(batch)])) == "ok"
    waiting_put = buffer.put.remote([ray.put(batch)])  # full: it waits for room
    ready, _ = ray.wait([waiting_put], timeout=0.5)
    assert not ready
    assert len(ray.get(buffer.take.remote(1, 0, 1.0))) == 1
    assert ray.get(waiting_put) == "ok"  # woken by the take
    assert len(ray.get(buffer.take.remote(1, 0, 1.0))) == 1
    closing_take = buffer.take.remote(1, 0, 30.0)
    time.sleep(0.3)
    ray.get(buffer.close.remote())
    assert ray.get(closing_take) is None
    ledger = ray.get(buffer.ledger.remote())
    assert ledger["consumed"] == 3 and ledger["balanced"], ledger
    ray.kill(buffer)


def test_weight_sync_alarm_when_alpha_collapses(ray_cluster, tiny_garden, task):
    import torch

    # The draft is a copy of the target (alpha ~ 1) until noise replaces its weights.
    overrides = [
        f"draft={tiny_garden.target}",
        "ray.run_name=alarm",
        "evaluator.alarm_drop=0.1",
        "eval.speedup_gamma=3",
    ]
    cfg = job_config(tiny_garden, Path("unused"), *overrides)
    store = WeightStore.options(name=weights_name("alarm")).remote("alarm")
    draft, _ = load_model(str(tiny_garden.target))
    publish(store, draft, 0)
    evaluator = EvalActor.remote(EvalSettings.of(cfg), [e.prompt for e in task.test[:8]])
    good = ray.get(evaluator.evaluate.remote())
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p))
    publish(store, draft, 1)
    bad = ray.get(evaluator.evaluate.remote())
    report = ray.get(evaluator.report.remote())
    restarted = EvalActor.remote(
        EvalSettings.of(cfg), [e.prompt for e in task.test[:8]]
    )  # knows the serving alpha from the store
    assert not ray.get(restarted.evaluate.remote())["served"]
    gate = ray.get(store.status.remote())._asdict()
    ray.kill(evaluator)
    ray.kill(restarted)
    ray.kill(store)
    assert good["alpha"] > 0.9 and bad["alpha"] < good["alpha"] - 0.1
    assert len(report["alarms"]) == 1 and "collapsed" in report["alarms"][0]
    # The canary: the good version became the serving one; the worse one was refused with its reason.
    assert good["served"] and not bad["served"]
    assert gate["latest"] == 1 and gate["serving"] == 0
    assert [r["version"] for r in gate["refused"]] == [1] and gate["refused"][0]["reason"].startswith("canary: alpha")


def test_resume_step_is_the_checkpoint_ray_train_registered(tmp_path):
    """A directory the controller never registered (a job killed mid-report) is no resume point, but it still
    stops a rerun that did not ask to resume from overwriting it."""
    run = tmp_path / "learner"
    for step, name in [(3, "checkpoint_a"), (6, "checkpoint_b")]:
        (run / name).mkdir(parents=True)
        (run / name / "step.json").write_text(json.dumps({"step": step}))
    assert checkpoint_steps(tmp_path) == [3, 6] and latest_step(tmp_path) is None
    snapshot = {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_a", "metrics": {"step": 3}}}
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    assert latest_step(tmp_path) == 3
    del snapshot["latest_checkpoint_result"]["metrics"]
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    assert latest_step(tmp_path) == 3


def test_stopped_job_resumes_from_its_checkpoint(ray_cluster, tiny_garden, tmp_path, capsys, monkeypatch):
    """A killed job reruns from its Ray Train checkpoint (the draft trains as a LoRA: its factors are in the
    checkpoint too)."""
    out, steps, every = tmp_path / "run", 20, 2
    args = [
        "--target", str(tiny_garden.target), "--draft", str(tiny_garden.draft), "--output-dir", str(out),
        f"ray.address={ray_cluster}", *PIPELINE_TINY, f"distill.steps={steps}", f"distill.checkpoint_every={every}",
        "distill.train=lora:4", "rollout.workers=1",
        "evaluator.every=0", "eval.gammas=[2]", "eval.temperatures=[0]", "eval.num_prompts=4",
        "eval.speedup_prompts=0", "ray.run_name=resume", "ray.log_to_driver=true",
    ]  # fmt: skip
    first = start_job(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while latest_step(out) is None and time.time() < deadline:
        assert first.poll() is None, first.stdout.read()[-3000:]
        time.sleep(0.5)
    first.send_signal(signal.SIGKILL)  # a crash: no cleanup
    first.wait()
    # Ray kills the dead driver's actors a moment later; until then the learner may report one more checkpoint.
    saved, quiet_since = latest_step(out), time.time()
    while time.time() - quiet_since < 5 and time.time() < deadline + 60:
        time.sleep(0.5)
        if (now := latest_step(out)) != saved:
            saved, quiet_since = now, time.time()
    assert saved is not None and every <= saved < steps, saved

    # A rerun that changed the recipe would mix two runs in one checkpoint: refused in one line, the checkpoint kept.
    other = run_here(lambda: distill.cli([*args, "distill.divergence=fkl"]), capsys, monkeypatch)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert "holds a checkpoint of another run (distill.divergence" in other.stderr
    assert latest_step(out) == saved

    second = start_job(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output, _ = second.communicate(timeout=900)
    assert second.returncode == 0, output[-3000:]
    # The rerun resumes from the checkpoint Ray Train registered last: the one seen above, or a later one the dying
    # learner managed to register after it.
    resumed = re.search(r"resuming the learner from its checkpoint at step (\d+)", output)
    assert resumed and saved <= int(resumed[1]) < steps, output[-3000:]
    assert f"learner rank 0: resumed from the checkpoint at step {resumed[1]}" in output  # what the learner did
    assert "measure before: as the run before this one measured it" in output  # the killed run's, kept
    before = json.loads((out / "before.json").read_text())["records"]
    kept = [r for r in json.loads((out / "results.json").read_text())["records"] if r["phase"] == "before"]
    assert [r["alpha"] for r in kept] == [r["alpha"] for r in before]
    log = json.loads((out / "train_log.json").read_text())
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    assert yaml.safe_load((out / "config.yaml").read_text())["ray"]["address"] == ray_cluster


def test_measurements_run_as_a_ray_task_and_user_errors_come_back_plain(
    ray_cluster, tiny_garden, task, tmp_path, capsys
):
    """The job's before/after measurements run on the cluster (a head node may lack the job's GPU), each
    measurement's line printed by the driver as the task makes it; a bad draft path surfaces as the DistillSpecError
    a user can read, not a Ray traceback."""
    from actors.evaluator import measure_on_cluster
    from distillspec import DistillSpecError

    cfg = job_config(
        tiny_garden, tmp_path, "eval.gammas=[2]", "eval.temperatures=[0]", "eval.num_prompts=4", "eval.speedup_gamma=2"
    )
    records = measure_on_cluster("before", cfg, cfg.draft, task, threads=1)
    assert [(r["phase"], r["gamma"], r["temperature"]) for r in records] == [("before", 2, 0.0)]
    assert 0.0 <= records[0]["alpha"] <= 1.0 and records[0]["measured_speedup"] > 0
    out, rec = capsys.readouterr().out, records[0]
    assert f"measure before: gamma 2, T = 0: alpha {rec['alpha']:.3f}, tau {rec['tau']:.2f} (1/1, " in out
    assert "measure before: racing the undistilled draft against the target alone on " in out
    assert f"the undistilled draft, gamma 2, T = 0: {rec['measured_speedup']:.2f}x the target alone\n" in out
    with pytest.raises(DistillSpecError, match="does not exist") as err:
        measure_on_cluster("after", cfg, str(tmp_path / "no-such-draft"), task)
    assert type(err.value) is DistillSpecError and "Traceback" not in str(err.value)


def test_gpu_jobs_need_a_gpu_share_for_every_model_holder(tiny_garden, tmp_path):
    from cluster.pipeline import check_devices
    from distillspec import DistillSpecError

    check_devices(job_config(tiny_garden, tmp_path))  # CPU: nothing to ask
    ok = ["device=cuda", "learner.use_gpu=true", "rollout.gpus=0.25", "evaluator.gpus=0.25"]
    check_devices(job_config(tiny_garden, tmp_path, *ok))
    with pytest.raises(DistillSpecError, match="evaluator.gpus=0.0"):
        check_devices(job_config(tiny_garden, tmp_path, *ok[:-1]))
    with pytest.raises(DistillSpecError, match="target_logits=learner"):
        check_devices(job_config(tiny_garden, tmp_path, *ok, "learner.target_logits=scorer"))


def test_a_float16_version_is_half_the_bytes_and_loads_into_each_consumers_dtype(ray_cluster, tiny_garden):
    """learner.version_dtype=float16 (the default): a version travels in half the bytes of float32; a float32, a
    bfloat16 and an int8 consumer each load it into their own weights, within float16's rounding."""
    from actors.weights import take
    from distillspec.models.loading import load_arrays, load_decoding_draft
    from distillspec.versions import state_arrays

    draft = load_model(str(tiny_garden.draft))[0]
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01)  # a trained version: not the consumers' weights
    half, full = state_arrays(draft, "float16"), state_arrays(draft)
    assert sum(a.nbytes for a in half.values()) * 2 == sum(a.nbytes for a in full.values())
    store = WeightStore.remote("half")
    publish(store, draft, 1, dtype="float16")
    consumers = {
        "float32": load_model(str(tiny_garden.draft))[0],
        "bfloat16": load_model(str(tiny_garden.draft), dtype=torch.bfloat16)[0],
        "int8": load_decoding_draft(str(tiny_garden.draft), device="cpu", dtype=torch.float32, int8=True)[0],
    }
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = draft(ids).logits
        for name, consumer in consumers.items():
            assert take(store, -1, functools.partial(load_arrays, consumer))[0] == 1
            got = consumer(ids).logits.float()
            assert torch.allclose(got, want, atol={"float32": 1e-3, "bfloat16": 0.05, "int8": 0.1}[name]), name
    ray.kill(store)


def test_a_corrupted_weight_transfer_is_refused_where_the_weights_are_loaded(ray_cluster, tiny_garden):
    from actors.weights import take
    from distillspec.integrity import TransferRefused, checksums
    from distillspec.models.loading import load_arrays
    from distillspec.versions import state_arrays

    store = WeightStore.remote("integrity")
    draft, consumer = load_model(str(tiny_garden.draft))[0], load_model(str(tiny_garden.draft))[0]
    publish(store, draft, 1)
    pull = lambda held: take(store, held, functools.partial(load_arrays, consumer))[0]
    assert pull(-1) == 1  # an intact transfer loads
    held = {k: v.clone() for k, v in consumer.state_dict().items()}
    arrays = state_arrays(draft)
    name = next(k for k, a in arrays.items() if a.size > 1)
    scrambled = {**arrays, name: np.random.default_rng(0).permutation(arrays[name].ravel()).reshape(arrays[name].shape)}
    ray.get(store.publish.remote(2, [ray.put(scrambled)], None, checksums(arrays)))  # one tensor mangled in transit
    with pytest.raises(TransferRefused):
        pull(1)  # refused before loading: the consumer keeps version 1, bit for bit
    assert all(torch.equal(held[k], v) for k, v in consumer.state_dict().items())
    ray.get(store.publish.remote(3, [ray.put(arrays)], None, checksums(arrays)))
    assert pull(1) == 3  # the next intact version loads
    ray.kill(store)


def test_a_restarted_learner_publishes_new_version_numbers(ray_cluster):
    """A learner restarted from its checkpoint publishes steps it published before: the store gives them new
    numbers (a number never names two drafts), a consumer holding the old number takes the new draft, and the
    numbers go on from there by the learner's steps."""
    from actors.weights import take

    store = WeightStore.remote("numbers")
    weights = [ray.put({"w": np.full(2, step, dtype=np.float32)}) for step in range(7)]
    assert [ray.get(store.publish.remote(step, [weights[step]])) for step in (0, 2, 4, 6)] == [0, 2, 4, 6]
    ray.get(store.roll_back.remote(6, "rollback: live alpha fell"))  # refused for good
    held = ray.get(store.status.remote()).latest
    assert ray.get(store.publish.remote(4, [weights[4]])) == 7  # the checkpoint of step 4, published again
    assert ray.get(store.status.remote())[:3] == (7, -1, 4)
    arrays: dict = {}
    assert take(store, held, arrays.update)[0] == 7 and arrays["w"].tolist() == [4.0, 4.0]
    assert ray.get(store.publish.remote(5, [weights[5]])) == 8  # its steps, shifted by the same 3
    assert ray.get(store.publish.remote(6, [weights[6]], serving=True)) == 9  # not 6: rolled back
    assert ray.get(store.status.remote()).serving == 9
    ray.kill(store)


def test_a_version_outlives_its_publisher(ray_cluster, tiny_garden):
    """The store owns the bytes of the versions it keeps: a consumer that starts after the publisher died (a rollout
    actor restarted after the learner's node went, a replica started after the job ended) loads the version."""
    from actors.weights import take
    from distillspec.models.loading import load_arrays

    @ray.remote(num_cpus=0)
    class Publisher:
        def publish(self, store: ray.actor.ActorHandle, draft: str) -> None:
            publish(store, load_model(draft)[0], 7)

    store, publisher = WeightStore.remote("outlives"), Publisher.remote()
    ray.get(publisher.publish.remote(store, str(tiny_garden.draft)))
    ray.kill(publisher, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(publisher.publish.remote(store, str(tiny_garden.draft)))  # it is gone
    consumer = load_model(str(tiny_garden.draft))[0]
    with torch.no_grad():
        for p in consumer.parameters():
            p.zero_()
    assert take(store, -1, functools.partial(load_arrays, consumer))[0] == 7
    assert torch.equal(consumer.lm_head.weight, load_model(str(tiny_garden.draft))[0].lm_head.weight)
    ray.kill(store)


def test_a_consumer_keeps_its_version_when_the_bytes_never_come(ray_cluster):
    """A version whose bytes cannot be read (Ray restores no spilled object once the disk is 95% full): the consumer
    keeps the version it holds and tries again at its next check, rather than waiting for ever."""
    from actors.weights import Follow, take
    from distillspec.versions import DraftVersion

    @ray.remote(num_cpus=0)
    def never() -> None:
        time.sleep(600)

    pending = never.remote()
    loaded = []
    answer = Follow(DraftVersion(5, 5, [pending], None), None, [])
    assert take(None, 3, loaded.append, answer=answer, timeout_s=1.0) == (3, answer)
    assert not loaded
    ray.cancel(pending, force=True)


def test_the_weight_store_rolls_serving_back_past_refused_versions(ray_cluster):
    """The store's side of a rollback, as several replicas see it: serving returns to the newest earlier version
    that was neither refused nor rolled back; every replica learns the rolled-back versions from ``follow``."""
    store = WeightStore.remote("rollback")
    refs = [ray.put({"w": np.zeros(2, dtype=np.float32)})]
    assert ray.get(store.follow.remote()) == (None, None, [])
    for version in (1, 2, 3):
        ray.get(store.publish.remote(version, refs))
        ray.get(store.promote.remote(ray.get(store.follow.remote("latest")).held, version / 10))  # its canary alpha
    ray.get(store.refuse.remote(2, "integrity: a replica found it mangled"))  # not the serving one: serving stays
    assert ray.get(store.status.remote()).serving == 3
    assert ray.get(store.roll_back.remote(3, "rollback: live alpha fell")) == 1  # past the refused version 2
    assert ray.get(store.roll_back.remote(3, "rollback: a second replica saw it too")) == 1  # counted once
    gate = ray.get(store.status.remote())._asdict()
    follow = ray.get(store.follow.remote())  # one call: the version to serve, its weights and canary alpha, rollbacks
    assert (follow.version, follow.alpha, follow.rolled_back) == (1, 0.1, [3])
    assert ray.get(follow.held.weights[0])["w"].tolist() == [0.0, 0.0]  # the store's own copy of the bytes
    assert gate["rolled_back"] == [3]
    assert [(r["version"], r["reason"].split(":")[0]) for r in gate["refused"]] == [(2, "integrity"), (3, "rollback")]
    assert ray.get(store.roll_back.remote(1, "rollback: and this one")) == -1  # nothing earlier: the start draft
    assert ray.get(store.status.remote()).latest == 3  # rollouts keep training on the latest version
    ray.kill(store)
