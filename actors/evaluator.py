"""The evaluation actor: measures alpha and tau of the latest draft on held-out prompts as versions arrive, raises
an alarm when alpha collapses after a weight sync, and is the serving gate's canary: a version becomes the serving
version only when its alpha, decoded as the Serve replicas decode (``serve.backend``), is not more than
``evaluator.canary_margin`` below the serving version's."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.queue import Queue
from tqdm.auto import tqdm

from actors.common import log, weights_name
from actors.dashboard import count, gauge
from actors.target import shared_target
from actors.weights import take
from actors.worker import setup_worker
from distillspec.config import EvalConfig, EvaluatorConfig, JobConfig, Models, VLLMConfig
from distillspec.errors import DistillSpecError
from distillspec.evaluation.measure import evaluate_sd
from distillspec.evaluation.study import measure_phase
from distillspec.integrity import TransferRefused
from distillspec.models.loading import load_arrays, load_decoding_draft, load_decoding_pair
from distillspec.serving.completer import canary_refusal
from distillspec.tasks.data import Example, Task
from distillspec.versions import DraftVersion, state_arrays

EVAL_TEMPERATURE = 1.0  #: sampling temperature of the periodic evaluation
PROGRESS_POLL_S = 2.0  #: how often the driver prints the lines of a job's measurement task


@dataclass(frozen=True)
class EvalSettings:
    """What the evaluation actor reads of the job's config."""

    models: Models
    evaluator: EvaluatorConfig
    eval: EvalConfig  #: the decoding of its measurements: eval.speedup_gamma, max_new_tokens, batch_size
    canary_backend: str  #: serve.backend: the canary decodes as the replicas do
    canary_gamma: int  #: serve.fixed_gamma
    canary_temperature: float  #: JobConfig.canary_temperature
    vllm: VLLMConfig
    run: str
    seed: int

    @classmethod
    def of(cls, cfg: JobConfig) -> EvalSettings:
        return cls(
            cfg.models,
            cfg.evaluator,
            cfg.eval,
            cfg.serve.backend,
            cfg.serve.fixed_gamma,
            cfg.canary_temperature,
            cfg.vllm,
            cfg.ray.run_name,
            cfg.seed,
        )


@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=2)
class EvalActor:
    def __init__(self, settings: EvalSettings, prompts: list[str]) -> None:
        setup_worker()
        s, m = settings, settings.models
        self.settings, self.prompts = s, prompts
        self.target, self.draft, self.tokenizer = load_decoding_pair(m, shared_target=shared_target(s.run))
        self.store = ray.get_actor(weights_name(s.run))
        self.version = -1
        self.held: DraftVersion | None = None  #: the store's entry of ``version``: what the gate promotes
        self.history: list[dict] = []
        self.alarms: list[str] = []
        #: the canary's alpha of the serving version on these prompts; a restarted evaluator takes it from the store
        self.serving_alpha: float | None = ray.get(self.store.follow.remote()).alpha
        self.canary = None  #: with serve.backend=vllm, the canary decodes with vLLM, as the replicas do
        if s.canary_backend == "vllm":
            from distillspec.serving.vllm_backend import VLLMGenerator  # noqa: PLC0415 (vLLM, optional)

            self.canary = VLLMGenerator(
                s.vllm,
                m.target,
                m.draft,
                self.tokenizer,
                max_new_tokens=s.eval.max_new_tokens,
                temperature=s.canary_temperature,
                gamma=s.canary_gamma,
                seed=s.seed,
            )
        self.stopped = threading.Event()

    def evaluate(self) -> dict | None:
        """Pull the latest weights and measure them (None when nothing was ever published)."""
        try:
            self.version, answer = take(self.store, self.version, functools.partial(load_arrays, self.draft))
            if answer.held is not None and answer.held.number == self.version:
                self.held = answer.held  # the store's entry of the version held: what the gate promotes
        except TransferRefused:
            pass  # logged and counted where it was found; measure the weights held
        if self.version < 0:
            return None
        rec = {
            "version": self.version,
            "step": self.held.step if self.held is not None else None,
            "time": time.time(),
            **self._measure(self.settings.eval.speedup_gamma),
        }
        run = self.settings.run
        gauge("distillspec_acceptance_rate", rec["alpha"], run=run)
        gauge("distillspec_block_efficiency", rec["tau"], run=run)
        gauge("distillspec_eval_version", self.version, run=run)
        if self.history and rec["alpha"] < self.history[-1]["alpha"] - self.settings.evaluator.alarm_drop:
            prev = self.history[-1]
            alarm = (
                f"alpha collapsed from {prev['alpha']:.3f} (version {prev['version']}) to {rec['alpha']:.3f} "
                f"(version {self.version}) after a weight sync"
            )
            log.error("ALARM: %s", alarm)
            self.alarms.append(alarm)
            count("distillspec_alpha_alarms", run=run)
        rec["canary"] = self.measure_canary(rec)
        rec["served"] = self.gate(rec)
        self.history.append(rec)
        return rec

    def _measure(self, gamma: int, temperature: float = EVAL_TEMPERATURE) -> dict:
        return evaluate_sd(
            self.target,
            self.draft,
            self.tokenizer,
            self.prompts,
            gamma=gamma,
            temperature=temperature,
            max_new_tokens=self.settings.eval.max_new_tokens,
            batch_size=self.settings.eval.batch_size,
            seed=self.settings.seed,
        )

    def measure_canary(self, rec: dict) -> dict:
        """Alpha of the evaluated version decoded as the replicas decode: at ``serve.fixed_gamma`` and the canary's
        temperature (:attr:`~distillspec.config.JobConfig.canary_temperature`), with this project's decoder or,
        with ``serve.backend=vllm``, vLLM's engine."""
        gamma, temperature = self.settings.canary_gamma, self.settings.canary_temperature
        if self.canary is not None:
            self.canary.load_draft(state_arrays(self.draft))
            counts = self.canary.measure([Example(prompt=p, reference="") for p in self.prompts])
            return {"backend": "vllm", "temperature": temperature, "alpha": counts.alpha, "tau": counts.tau}
        if (gamma, temperature) != (self.settings.eval.speedup_gamma, EVAL_TEMPERATURE):
            rec = self._measure(gamma, temperature)
        return {"backend": "hf", "temperature": temperature, "alpha": rec["alpha"], "tau": rec["tau"]}

    def gate(self, rec: dict) -> bool:
        """The canary: promote the measured version to serving, or refuse it with the reason."""
        alpha = rec["canary"]["alpha"]
        reason = canary_refusal(alpha, self.serving_alpha, self.settings.evaluator.canary_margin)
        if reason is not None:
            log.warning("serving gate refused version %d (%s)", self.version, reason)
            ray.get(self.store.refuse.remote(self.version, reason))
            return False
        ray.get(self.store.promote.remote(self.held, alpha))  # the store's entry: its bytes, not a copy
        self.serving_alpha = alpha
        return True

    def run(self) -> int:
        """Evaluate every ``evaluator.every`` versions until stopped; returns the number of evaluations."""
        every = self.settings.evaluator.every
        while not self.stopped.is_set() and every:
            latest = ray.get(self.store.status.remote()).latest
            if latest >= 0 and (not self.history or latest >= self.history[-1]["version"] + every):
                self.evaluate()
            else:
                self.stopped.wait(0.5)
        return len(self.history)

    def stop(self) -> None:
        self.stopped.set()

    def report(self) -> dict:
        return {"history": self.history, "alarms": self.alarms}


@ray.remote(max_retries=0)
def _measure_task(
    phase: str, cfg: JobConfig, draft: str, task: Task, threads: int, speed: bool, baseline: str | None, lines: Queue
) -> list[dict]:
    setup_worker(threads)
    target, model, tokenizer = load_decoding_pair(cfg.models, draft)
    before = None
    if baseline is not None:
        before = load_decoding_draft(baseline, device=cfg.device, dtype=model.dtype, int8=cfg.draft_int8)[0]
    return measure_phase(phase, cfg, target, model, tokenizer, task, speed=speed, baseline=before, report=lines.put)


def progress(phase: str) -> Callable[[str], None]:
    """A phase's measurement lines (``measure_phase``'s ``report``) as the driver prints them, above any progress
    bars."""
    return lambda line: tqdm.write(f"measure {phase}: {line}")


def measure_on_cluster(
    phase: str,
    cfg: JobConfig,
    draft: str,
    task: Task,
    *,
    threads: int = 1,
    speed: bool = True,
    baseline: str | None = None,
) -> list[dict]:
    """The job's before/after measurements (:func:`distillspec.evaluation.study.measure_phase`) of the pair
    ``cfg.target`` and ``draft`` as a Ray task with ``evaluator.cpus`` CPUs and ``evaluator.gpus`` GPUs (``threads``
    torch threads), so a driver on a head node without the job's device still measures on it; ``speed``/``baseline``:
    the wall-clock speedup, of ``draft`` alone or side by side with the ``baseline`` draft. Each measurement's line
    (alpha and tau of a setting, a race's speedup) is printed here as the task makes it, through a Ray queue. A
    user's mistake (a bad path, a tokenizer mismatch) comes back as the :class:`DistillSpecError` it is."""
    e = cfg.eval
    side = " side by side with the undistilled draft" if baseline else ""
    speedup = f", then the speedup on {min(e.num_prompts, e.speedup_prompts)} prompts{side}" if speed else ""
    speedup = speedup if e.speedup_prompts else ""
    print(
        f"measure {phase}: alpha and tau at gamma {e.gammas} x temperature {e.temperatures} on {e.num_prompts} "
        f"prompts{speedup} ..."
    )
    start = time.perf_counter()
    lines = Queue(actor_options={"num_cpus": 0})  # the task's progress, a line a measurement, printed here
    ref = _measure_task.options(num_cpus=cfg.evaluator.cpus, num_gpus=cfg.evaluator.gpus).remote(
        phase, cfg, draft, task, threads, speed, baseline, lines
    )
    try:
        done, show = False, progress(phase)
        while not done:
            done = bool(ray.wait([ref], timeout=PROGRESS_POLL_S)[0])
            while not lines.empty():
                show(lines.get_nowait())
        records = ray.get(ref)
        print(f"measure {phase}: done in {time.perf_counter() - start:.0f}s")
        return records
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, DistillSpecError):
            raise exc.cause from None
        raise
    finally:
        lines.shutdown()
