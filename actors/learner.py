"""The learner: a Ray Train ``TorchTrainer`` whose workers take batches from the buffer, compute the divergence
against the target and update the draft (DDP across workers: gloo on CPU, NCCL on GPU).

Rank 0 publishes each new version to the weight store and writes checkpoints through Ray Train (the draft in
``save_pretrained`` format, optimizer, scheduler, step, the learner's log and the buffer's ledger). A restarted
run (same ``output_dir``) or a restarted worker group resumes from the latest checkpoint.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from actors.common import buffer_name, log, weights_name
from actors.dashboard import gauge
from actors.target import load_target
from actors.weights import publish
from actors.worker import setup_worker
from distillspec.config import DistillConfig, JobConfig, LearnerConfig, Models
from distillspec.errors import DistillSpecError
from distillspec.files import RecordLog
from distillspec.models.loading import load_model
from distillspec.training.batches import RolloutBatch
from distillspec.training.learner import LOG_FILE, Learner, checkpoint_log, load_checkpoint, save_checkpoint
from distillspec.training.losses import train_temperature

RUN_DIR = "learner"  #: Ray Train's run folder under output_dir (checkpoints live there)
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  #: Ray Train's record of the registered checkpoints, in RUN_DIR


@dataclass(frozen=True)
class LearnerSettings:
    """What a learner worker reads of the job's config."""

    models: Models
    distill: DistillConfig
    learner: LearnerConfig
    run: str
    gpu_dry_run: bool  #: ray.gpu_dry_run: hold GPU shares, compute on CPU
    scored: bool  #: every batch comes with the target's scores (JobConfig.batches_come_scored)

    @classmethod
    def of(cls, cfg: JobConfig) -> LearnerSettings:
        return cls(cfg.models, cfg.distill, cfg.learner, cfg.ray.run_name, cfg.ray.gpu_dry_run, cfg.batches_come_scored)


def take_batch(buffer: ray.actor.ActorHandle, version: int, timeout_s: float) -> RolloutBatch:
    """The next batch for the learner at ``version``: waits for one, raises when none comes for ``timeout_s``."""
    refs = ray.get(buffer.take.remote(1, version, timeout_s))
    if refs is None:
        raise DistillSpecError("the buffer was closed before training ended: rollouts stopped (see the driver)")
    if not refs:
        raise DistillSpecError(
            f"the learner got no batch for {timeout_s:.0f} s: are the rollout actors alive? "
            "(see the Ray dashboard's actor logs; learner.take_timeout_s sets this limit)"
        )
    return ray.get(refs[0])


def _agree(flag: bool, device: torch.device) -> bool:
    """True on every worker when it is true on any (so DDP workers stop at the same step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)  # NCCL reduces tensors on the GPU only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _from_rank_0(value: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every worker."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def learner_loop(config: dict) -> None:
    """Ray Train's ``train_loop_per_worker``."""
    s: LearnerSettings = config["settings"]
    m, distill = s.models, s.distill
    setup_worker(s.learner.threads or max(1, round(s.learner.cpus)))
    rank = ray.train.get_context().get_world_rank()
    # A dry run holds GPU shares but computes on CPU.
    device = torch.device("cpu") if s.gpu_dry_run else ray.train.torch.get_device()
    run = s.run
    buffer, store = ray.get_actor(buffer_name(run)), ray.get_actor(weights_name(run))

    # With scoring actors, or served samples alone, every batch comes scored: the learner holds no copy of the target.
    target = None
    if s.learner.target_logits == "learner" and not s.scored:
        target = load_target(m, run, str(device), scores_only=True)
    draft, tokenizer = load_model(m.draft, device=str(device))
    learner = Learner(draft, target, distill)
    records, seconds_before = None, 0.0  # the run's log (rank 0 keeps it)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            seconds_before = load_checkpoint(d, learner)
            records = checkpoint_log(d, config["log"]) if rank == 0 else None
        log.info("learner rank %d: resumed from the checkpoint at step %d", rank, learner.step_count)
    if rank == 0 and records is None:
        records = RecordLog(config["log"])

    # An adapter (LoRA, the grids' scales) trains no weight of the draft's for DDP to average: its gradients are
    # averaged in the step.
    strategy = None if learner.adapter is not None else "ddp"
    learner.model = ray.train.torch.prepare_model(draft, move_to_device=device, parallel_strategy=strategy)
    dtype = s.learner.version_dtype
    # The store numbers versions: this learner's are its steps shifted by a constant (not 0 after a restart:
    # distillspec.versions.VersionNumbers), which the buffer's staleness and the lag compare. Rank 0 publishes and
    # tells the other ranks.
    first = publish(store, draft, learner.step_count, dtype=dtype) if rank == 0 else learner.step_count
    shift = _from_rank_0(first - learner.step_count, device)
    start = time.perf_counter() - seconds_before
    rate = Rate()
    budget = distill.time_budget_s
    temperature = train_temperature(distill.temperature)

    last = records.records[-1] if rank == 0 and records.records else None

    def save(final: bool) -> None:
        metrics = {"step": learner.step_count, "final": final, **(last or {})}
        if rank != 0:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as d:
            ledger = ray.get(buffer.ledger.remote())
            seconds = time.perf_counter() - start
            save_checkpoint(d, learner, tokenizer, records, seconds=seconds, extra={"ledger": ledger})
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))

    steps = distill.steps
    while learner.step_count < steps and not _agree(bool(budget) and time.perf_counter() - start > budget, device):
        t_take = time.perf_counter()
        batch = take_batch(buffer, learner.step_count + shift, s.learner.take_timeout_s)
        record = learner.step(
            batch.batch(device),
            target_logits=batch.target(temperature, device),
            source=batch.source,
            version=batch.version,
            current=learner.step_count + shift,
            wait_s=time.perf_counter() - t_take,
            start=start,
        )
        if rank == 0 and learner.step_count % s.learner.publish_every == 0:
            publish(store, draft, learner.step_count, record, dtype=dtype)
        last = record
        if rank == 0:
            records.append(record)
        gauge("distillspec_learner_loss", record["loss"], run=run)
        for name, value in rate.add(batch.rows, record["tokens"]).items():
            gauge(f"distillspec_learner_{name}_per_s", value, run=run)
        every = distill.checkpoint_every
        if every and learner.step_count % every == 0 and learner.step_count < steps:
            save(final=False)
    save(final=True)


class Rate:
    """Samples/s and tokens/s over windows of about two seconds."""

    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s, self.t0, self.samples, self.tokens = window_s, time.perf_counter(), 0, 0

    def add(self, samples: int, tokens: int) -> dict[str, float]:
        """Count a batch; returns the rates when a window closes, else nothing."""
        self.samples, self.tokens = self.samples + samples, self.tokens + tokens
        elapsed = time.perf_counter() - self.t0
        if elapsed < self.window_s:
            return {}
        rates = {"samples": self.samples / elapsed, "tokens": self.tokens / elapsed}
        self.t0, self.samples, self.tokens = time.perf_counter(), 0, 0
        return rates


def worker_resources(cfg: JobConfig) -> dict[str, float]:
    """What each learner worker asks Ray for."""
    return {"CPU": cfg.learner.cpus, **({"GPU": 1} if cfg.learner.use_gpu else {})}


def make_trainer(cfg: JobConfig, storage: Path) -> TorchTrainer:
    return TorchTrainer(
        learner_loop,
        train_loop_config={"settings": LearnerSettings.of(cfg), "log": str(storage.resolve() / LOG_FILE)},
        torch_config=TorchConfig(backend="gloo" if cfg.ray.gpu_dry_run or not cfg.learner.use_gpu else "nccl"),
        scaling_config=ScalingConfig(
            num_workers=cfg.learner.workers,
            use_gpu=cfg.learner.use_gpu,
            resources_per_worker=worker_resources(cfg),
        ),
        run_config=RunConfig(
            name=RUN_DIR,
            storage_path=str(storage.resolve()),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=cfg.learner.max_failures),
        ),
    )


def checkpoint_steps(storage: Path) -> list[int]:
    """The steps of every learner checkpoint directory under ``storage`` (registered or not)."""
    return sorted(json.loads(p.read_text())["step"] for p in (storage / RUN_DIR).glob("checkpoint_*/step.json"))


def latest_step(storage: Path) -> int | None:
    """The step of the checkpoint Ray Train resumes from under ``storage``, or None when it would start afresh.

    Ray Train resumes from the last checkpoint its controller registered (its snapshot file), not from the newest
    directory: a job killed while a checkpoint was being reported leaves a directory that was never registered.
    """
    snapshot = storage / RUN_DIR / SNAPSHOT_FILE
    try:
        latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]
    except (OSError, ValueError, KeyError):
        return None
    if not latest:
        return None
    step = latest.get("metrics", {}).get("step")
    if step is None:  # a snapshot from another Ray version: read the checkpoint itself
        step_file = storage / RUN_DIR / latest["checkpoint_dir_name"] / "step.json"
        step = json.loads(step_file.read_text())["step"] if step_file.exists() else None
    return step
