"""The driver of the asynchronous pipeline: it starts the actors, runs the Ray Train learner, and gathers
what they produced.

    buffer --sample()--> rollout actors --batch (ref)--> scorers (score(sample()), when they score)
      |   <--header, batch (ref)--------------------------+
      +--take--> learner (TorchTrainer) --publish--> weight store --latest--> rollout actors, evaluation actor
                                                          ^   |
                        evaluation actor --promote/refuse-+   +--serving (the version the canary passed)--> replicas

The buffer asks each rollout actor for a batch only when it holds a slot for it, so what is sampled is fresh; the
rollout actors sample with the latest version, and Serve replicas follow the one the evaluation actor promoted.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm.auto import tqdm
from transformers import AutoConfig

from actors.buffer import BufferActor
from actors.common import buffer_name, prompts_name, scorer_name, weights_name
from actors.evaluator import EvalActor, EvalSettings
from actors.learner import RUN_DIR, checkpoint_steps, latest_step, make_trainer, worker_resources
from actors.prompts import PromptLog
from actors.rollout import RolloutActor, RolloutSettings, ScorerActor, ScorerSettings
from actors.target import share_target
from actors.weights import WeightStore, publish
from distillspec.config import JobConfig
from distillspec.errors import DistillSpecError
from distillspec.files import write_folder, write_json
from distillspec.models.loading import load_model
from distillspec.tasks.data import Task
from distillspec.training.learner import LOG_FILE, checkpoint_log

EVALUATIONS = "evaluations.json"  #: the periodic evaluations so far, in output_dir (a resumed run keeps them)


@dataclass
class PipelineResult:
    draft_dir: Path  #: the distilled draft (save_pretrained format)
    train_log: list[dict]
    ledger: dict
    evaluations: list[dict]
    alarms: list[str]
    resumed_from: int | None
    seconds: float
    #: seconds from creating the actors to the first batch, the learner ready, its first step (``first_step_s``)
    startup: dict = field(default_factory=dict)


def check_devices(cfg: JobConfig) -> None:
    """With ``device=cuda`` every model-holding part of the pipeline needs a GPU share, or it fails on load."""
    if not cfg.device.startswith("cuda"):
        return
    for key, value in (
        ("learner.use_gpu", cfg.learner.use_gpu),
        ("rollout.gpus", cfg.rollout.gpus),
        ("evaluator.gpus", cfg.evaluator.gpus),
    ):
        if not value:
            raise DistillSpecError(
                f"device={cfg.device!r} runs the pipeline's models on GPUs, but {key}={value!r}: set "
                "learner.use_gpu=true, rollout.gpus and evaluator.gpus > 0 (fractions share a GPU, e.g. 0.25), "
                "or device=cpu"
            )
    if cfg.learner.target_logits == "scorer":
        raise DistillSpecError(
            f"device={cfg.device!r}: the scoring actors run on CPUs; use learner.target_logits=learner (the learner's "
            "frozen target copy on its GPU)"
        )


def pipeline_asks(cfg: JobConfig) -> dict[str, float]:
    """The CPUs and GPUs the pipeline's actors and learner workers ask Ray for, together."""
    learner = worker_resources(cfg)
    cpus = cfg.learner.workers * learner["CPU"] + cfg.rollout.workers * cfg.rollout.cpus
    cpus += (cfg.evaluator.cpus if cfg.evaluator.every else 0) + (
        cfg.scorer.workers * cfg.scorer.cpus if cfg.learner.target_logits == "scorer" else 0
    )
    gpus = cfg.learner.workers * learner.get("GPU", 0) + cfg.rollout.workers * cfg.rollout.gpus
    gpus += cfg.evaluator.gpus if cfg.evaluator.every else 0
    return {"CPU": cpus, "GPU": gpus}


def endpoint_asks(cfg: JobConfig) -> dict[str, float]:
    """The CPUs and GPUs an endpoint of ``cfg.serve`` asks for at its fewest replicas."""
    replicas = cfg.serve.autoscaling.min_replicas
    return {"CPU": replicas * cfg.serve.replica.cpus, "GPU": replicas * cfg.serve.replica.gpus}


def check_resources(cfg: JobConfig, strict: bool, endpoint: bool = False) -> None:
    """A request the cluster cannot meet would wait forever: refuse it on a fixed (local) cluster, warn otherwise
    (an autoscaler may add nodes). With ``endpoint``, an endpoint of ``cfg.serve`` runs beside the pipeline on the
    cluster and counts with it."""
    need = pipeline_asks(cfg)
    beside = endpoint_asks(cfg) if endpoint else {"CPU": 0.0, "GPU": 0.0}
    have = ray.cluster_resources()
    for kind, fix in (
        ("CPU", "lower learner.cpus, rollout.cpus, scorer.cpus, evaluator.cpus or the worker counts"),
        ("GPU", "set learner.use_gpu=false, rollout.gpus=0 and evaluator.gpus=0, or use a cluster with GPUs"),
    ):
        total = need[kind] + beside[kind]
        if total > have.get(kind, 0) + 1e-9:
            asks, knobs = f"{need[kind]:g} {kind}s", fix
            if beside[kind]:
                asks, knobs = f"{asks} and its endpoint {beside[kind]:g}", f"{fix} (or serve.replica.{kind.lower()}s)"
            message = f"the pipeline asks for {asks} but the cluster has {have.get(kind, 0):g}: {knobs}"
            if strict:
                raise DistillSpecError(message)
            warnings.warn(message + " (waiting for the autoscaler)", stacklevel=2)


def wait_for_names(names: list[str], timeout_s: float = 30.0) -> None:
    """Named actors of a run that just died linger while Ray cleans up; a live run's never go."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise DistillSpecError(
                    f"a pipeline named {name.rsplit('-', 1)[0]!r} is running on this cluster: wait for it to end, "
                    "or give this one another ray.run_name"
                )
            time.sleep(0.5)


class Pipeline:
    """Starts the pipeline's actors for one run; ``run()`` trains and returns a :class:`PipelineResult`."""

    def __init__(self, cfg: JobConfig, task: Task, out: Path, *, fixed_cluster: bool = True) -> None:
        self.created = time.perf_counter()  #: the start-up milestones count from here
        self.startup: dict[str, float] = {}  #: first_batch_s, learner_ready_s, first_step_s
        self.cfg, self.task, self.out = cfg, task, Path(out).resolve()
        r = cfg.ray
        self.resumed_from = latest_step(self.out)
        # The evaluations of the run so far: a resumed run's curves keep them (the console adds each new one).
        self.evaluations_file = self.out / EVALUATIONS
        self.earlier: list[dict] = []
        if self.resumed_from is not None and self.evaluations_file.exists():
            self.earlier = [
                e
                for e in json.loads(self.evaluations_file.read_text())
                if e.get("step", e["version"]) <= self.resumed_from
            ]
        saved = checkpoint_steps(self.out)
        if saved and not cfg.learner.resume:
            raise DistillSpecError(
                f"{self.out / RUN_DIR} holds a learner checkpoint (step {saved[-1]}): "
                "set learner.resume=true to go on from it, or give another --output-dir"
            )
        check_resources(cfg, strict=fixed_cluster)
        wait_for_names([weights_name(r.run_name), buffer_name(r.run_name)])
        vocab = AutoConfig.from_pretrained(cfg.draft).vocab_size  # the config alone, not the weights
        # The stores live beside the driver (on a cluster: the head), not on a worker node that may go away.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        target = share_target(cfg.models) if r.share_target else None  # loads beside the actors' start
        self.store = WeightStore.options(name=weights_name(r.run_name), scheduling_strategy=here).remote(
            r.run_name, target
        )
        # A thread per rollout actor pulls its batches (BufferActor.feed), beside the learner's and the console's calls.
        self.buffer = BufferActor.options(
            name=buffer_name(r.run_name), scheduling_strategy=here, max_concurrency=16 + cfg.rollout.workers
        ).remote(
            capacity=cfg.buffer.capacity,
            max_policy_lag=cfg.buffer.max_policy_lag,
            max_batch_tokens=cfg.buffer.max_batch_tokens,
            vocab_size=vocab,
            run=r.run_name,
            store=self.store,
            examples=[ray.put(task.train)],  # the rollout actors read them there (a restarted one again)
        )
        self.prompt_log = None
        if cfg.rollout.online:  # the Serve endpoint (serve.record_prompts) fills it; the rollouts sample from it
            wait_for_names([prompts_name(r.run_name)])
            self.prompt_log = PromptLog.options(name=prompts_name(r.run_name), scheduling_strategy=here).remote(
                r.run_name, cfg.rollout.online_window
            )
            ray.get(self.prompt_log.stats.remote())
        self.scorers = []
        if cfg.learner.target_logits == "scorer":
            names = [scorer_name(r.run_name, i) for i in range(cfg.scorer.workers)]
            wait_for_names(names)
            self.scorers = [
                ScorerActor.options(name=n, num_cpus=cfg.scorer.cpus).remote(ScorerSettings.of(cfg)) for n in names
            ]

        rollout = RolloutSettings.of(cfg)  # each actor is given the part of the config it reads
        self.rollouts = [
            RolloutActor.options(num_cpus=cfg.rollout.cpus, num_gpus=cfg.rollout.gpus).remote(rollout, i)
            for i in range(cfg.rollout.workers)
        ]
        prompts = [e.prompt for e in task.test[: cfg.evaluator.prompts]]
        self.evaluator = (
            EvalActor.options(num_cpus=cfg.evaluator.cpus, num_gpus=cfg.evaluator.gpus).remote(
                EvalSettings.of(cfg), prompts
            )
            if cfg.evaluator.every
            else None
        )
        # Every actor is created before any is waited for: their processes start (and import torch) side by side;
        # the rollout actors find the buffer and the store by name, before those are up.
        ray.get([self.store.status.remote(), self.buffer.ledger.remote()])

    def watch(self) -> None:
        """Beside the learner: a rollout actor's failure (one Ray cannot cure by restarting it) closes the buffer,
        so the learner stops at once, and is kept for :meth:`run` to report."""
        pending = list(self.runs)
        while pending and not self.stopping.is_set():
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # a RayTaskError carries the actor's own exception as its cause
                    cause = getattr(exc, "cause", None) or exc
                    self.feed_error = f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]}"
                    self.stopping.set()
                    ray.get(self.buffer.close.remote())
                    return

    def run(self) -> PipelineResult:
        start = time.perf_counter()
        self.stopping, self.sampled, self.feed_error = threading.Event(), [], None
        self.runs = [self.buffer.feed.remote(actor, i, 0, self.scorers) for i, actor in enumerate(self.rollouts)]
        watcher = threading.Thread(target=self.watch, name="rollout-watcher", daemon=True)
        watcher.start()
        eval_run = self.evaluator.run.remote() if self.evaluator else None
        console = threading.Thread(target=self._console, name="console", daemon=True)
        console.start()
        try:
            result = make_trainer(self.cfg, self.out).fit()
        except Exception as exc:
            if self.feed_error is not None:
                raise DistillSpecError(f"a rollout actor failed: {self.feed_error}") from exc
            raise DistillSpecError(f"the learner failed: {str(exc).splitlines()[0][:300]}") from exc
        finally:
            self.stopping.set()
            watcher.join()
            console.join()
            ledger = ray.get(self.buffer.close.remote())
            for rollout in self.rollouts:  # a batch waiting for the endpoint's traffic is not made
                rollout.stop.remote()
            try:  # each feed returns once the buffer is closed, after the batch it was pulling
                self.sampled = [s for feed in ray.get(self.runs, timeout=60) for s in feed]
            except (ray.exceptions.RayError, TimeoutError):
                pass  # a feed that failed is the watcher's report
            if self.evaluator is not None:
                ray.get(self.evaluator.stop.remote())
                ray.get(eval_run)
        if self.feed_error is not None:
            raise DistillSpecError(f"a rollout actor failed: {self.feed_error}")
        draft_dir = self.out / "draft"
        with result.checkpoint.as_directory() as d:
            write_folder(draft_dir, lambda tmp: shutil.copytree(Path(d) / "draft", tmp, dirs_exist_ok=True))
            train_log = checkpoint_log(d, self.out / LOG_FILE).records
        if train_log and ray.get(self.store.status.remote()).step != train_log[-1]["step"]:
            # the learner publishes every learner.publish_every steps: the final draft, for the evaluator and replicas
            step, dtype = train_log[-1]["step"], self.cfg.learner.version_dtype
            publish(self.store, load_model(str(draft_dir))[0], step, dtype=dtype)
        report = {"history": [], "alarms": []}
        if self.evaluator is not None:
            ray.get(self.evaluator.evaluate.remote())  # the final version
            report = ray.get(self.evaluator.report.remote())
        return PipelineResult(
            draft_dir=draft_dir,
            train_log=train_log,
            ledger=ledger,
            evaluations=self.earlier + report["history"],
            alarms=report["alarms"],
            resumed_from=self.resumed_from,
            seconds=time.perf_counter() - start,
            startup=self.startup,
        )

    def _console(self, every_s: float = 1.0) -> None:
        """The live console: one progress bar for the learner (step of total, loss, latest alpha and tau, draft
        version, policy lag, buffer fill, samples/s), and each periodic evaluation as it arrives."""
        total, shown, start = self.cfg.distill.steps, 0, time.perf_counter()
        bar = tqdm(total=total, desc="distill", unit="step", dynamic_ncols=True)
        latest: dict = {}
        while not self.stopping.wait(every_s):
            try:
                status = ray.get(self.store.status.remote(), timeout=10)
                version, step, record = status.latest, status.step, status.record
                ledger = ray.get(self.buffer.ledger.remote(), timeout=10)
                history = ray.get(self.evaluator.report.remote(), timeout=10)["history"] if self.evaluator else []
            except (ray.exceptions.RayError, TimeoutError):
                continue
            if len(history) > shown:
                write_json(self.evaluations_file, self.earlier + history)
            for evaluation in history[shown:]:
                canary = evaluation.get("canary")
                gate = ""
                if canary:
                    how = f" ({canary['backend']}, T={canary['temperature']:g})" if "temperature" in canary else ""
                    verdict = "serving" if evaluation["served"] else "refused"
                    gate = f"; canary{how} alpha {canary['alpha']:.3f}: {verdict}"
                bar.write(
                    f"evaluation at version {evaluation['version']}: alpha {evaluation['alpha']:.3f}, "
                    f"tau {evaluation['tau']:.2f}{gate}"
                )
                latest = evaluation
            shown = len(history)
            self._startup(step, ledger, bar)
            bar.n = max(0, min(step, total))
            record = record or {}
            batch = self.cfg.distill.batch_size
            bar.set_postfix_str(
                ", ".join(
                    part
                    for part in (
                        f"loss {record['loss']:.4f}" if "loss" in record else "",
                        f"alpha {latest['alpha']:.3f} tau {latest['tau']:.2f}" if latest else "",
                        f"v{version} lag {record.get('lag', 0)}",
                        f"buffer {ledger['held']}/{self.cfg.buffer.capacity}",
                        f"{bar.n * batch / max(1e-9, time.perf_counter() - start):.0f} samples/s",
                    )
                    if part
                ),
                refresh=False,
            )
            bar.refresh()
        bar.close()

    def _startup(self, step: int, ledger: dict, bar: tqdm) -> None:
        """Note when the first batch was sampled, when the learner was ready (its models loaded: it publishes the
        version it starts from) and when its first step landed; say the three in one line at the first step. While
        the learner is not ready, say every minute from its first what it waits for where the cluster lacks it."""
        now, first = time.perf_counter() - self.created, self.resumed_from or 0
        if ledger["produced"] > 0:
            self.startup.setdefault("first_batch_s", now)
        if step < first and now >= self.startup.get("next_wait_note_s", 60.0):
            self.startup["next_wait_note_s"] = now + 60.0
            note = learner_wait_note(worker_resources(self.cfg), ray.available_resources(), now)
            if note:
                bar.write(note)
        if step >= first:
            self.startup.setdefault("learner_ready_s", now)
        if "first_step_s" not in self.startup and step > first:
            self.startup["first_step_s"] = now
            batch, ready = self.startup.get("first_batch_s", now), self.startup["learner_ready_s"]
            bar.write(
                f"first learner step {now:.0f}s after the pipeline's actors were created (first batch sampled at "
                f"{batch:.0f}s, learner ready at {ready:.0f}s)"
            )

    def shutdown(self) -> None:
        extra = [a for a in (self.evaluator, self.prompt_log) if a is not None]
        for actor in [*self.rollouts, *self.scorers, self.buffer, self.store, *extra]:
            ray.kill(actor, no_restart=True)


def learner_wait_note(ask: dict[str, float], free: dict[str, float], waited_s: float) -> str | None:
    """What a learner worker that is not placed yet waits for: its ``ask`` (resources a worker) where the cluster's
    ``free`` resources fall short of it (Ray Train waits for them without a word), else None."""
    short = {k: v for k, v in ask.items() if v > free.get(k, 0.0) + 1e-9}
    if not short:
        return None
    has = ", ".join(f"{k} {free.get(k, 0.0):g}" for k in short)
    wants = ", ".join(f"{k} {v:g}" for k, v in short.items())
    return (
        f"the learner has waited {waited_s:.0f}s for its resources: a worker asks for {wants} and the cluster has "
        f"{has} free beside the rollout actors, scorers and any endpoint; add a node (the autoscaler does where "
        f"one can be added), or lower learner.cpus, rollout.workers, rollout.cpus, scorer.cpus or an endpoint's "
        f"serve.replica.cpus"
    )
