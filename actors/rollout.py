"""Rollout actors sample training batches from the current draft (and the target, via SD) for the buffer;
scoring actors add the target's distribution to a batch when the learner is not to compute it (the buffer chains the
two: ``score(sample())``). Each returns the batch with its header, checked where the batch is made."""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass

import ray
import torch

from actors.common import Stopped, buffer_name, log, prompts_name, weights_name
from actors.dashboard import gauge
from actors.target import load_target
from actors.weights import take
from actors.worker import setup_worker
from distillspec.config import DistillConfig, JobConfig, Models, RolloutConfig, VLLMConfig, resolve_recipe
from distillspec.errors import DistillSpecError
from distillspec.integrity import TransferRefused
from distillspec.models.loading import load_arrays, load_tokenizer
from distillspec.tasks.data import Example
from distillspec.training.batches import Batch, BatchHeader, RolloutBatch
from distillspec.training.losses import forward_logits, train_temperature
from distillspec.training.rollout import Sampler, load_rollout_draft, online_rows, served_batch


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout actor reads of the job's config."""

    models: Models
    distill: DistillConfig
    rollout: RolloutConfig
    vllm: VLLMConfig
    run: str  #: the run's name: the actors it finds (buffer, weight store, prompt log)
    seed: int
    topk: int  #: target samples come with the target's top-k (scorer.topk where scorers score; 0: none)
    scored: bool  #: every batch is served samples, scored already (JobConfig.batches_come_scored)

    @classmethod
    def of(cls, cfg: JobConfig) -> RolloutSettings:
        topk = cfg.scorer.topk if cfg.learner.target_logits == "scorer" else 0
        scored = cfg.batches_come_scored
        return cls(cfg.models, cfg.distill, cfg.rollout, cfg.vllm, cfg.ray.run_name, cfg.seed, topk, scored)


@dataclass(frozen=True)
class ScorerSettings:
    """What a scoring actor reads of the job's config."""

    models: Models
    topk: int
    temperature: float  #: the divergence's temperature (distill.temperature)
    backend: str  #: hf | vllm (rollout.backend)
    vllm: VLLMConfig
    run: str  #: the run's name: the target's weights it shares
    seed: int
    scored: bool  #: every batch comes scored (JobConfig.batches_come_scored): the scorer holds no target

    @classmethod
    def of(cls, cfg: JobConfig) -> ScorerSettings:
        temperature, scored = train_temperature(cfg.distill.temperature), cfg.batches_come_scored
        s = cfg.scorer
        return cls(cfg.models, s.topk, temperature, cfg.rollout.backend, cfg.vllm, cfg.ray.run_name, cfg.seed, scored)


@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=2)
class RolloutActor:
    """Samples training batches from the latest published draft when the buffer asks for one. Ray restarts it when it
    dies, and retries the call it was serving."""

    def __init__(self, settings: RolloutSettings, rank: int) -> None:
        setup_worker()
        s, m = settings, settings.models
        buffer = ray.get_actor(buffer_name(s.run))
        train: list[Example] = ray.get(ray.get(buffer.examples.remote())[0])  # the training examples
        self.settings, self.rank, self.stopped = s, rank, threading.Event()
        d = s.distill
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        seed = s.seed * 100_003 + 7919 * (rank + 1) + (os.getpid() if restarted else 0)
        online = {  # online distillation: served prompts, and served completions for the target's samples
            "prompts": self.served_prompts if s.rollout.online else None,
            "served": self.served_samples if s.rollout.online_samples else None,
        }
        if s.scored:  # served samples alone: nothing to sample, no model to hold
            self.draft, self.tokenizer, self.engine = None, load_tokenizer(m.draft), None
            self.sampler = Sampler(None, None, self.tokenizer, train, d, seed=seed, generate=self.nothing, **online)
        elif s.rollout.backend == "vllm":  # the engines hold the draft; new versions load into them in place
            from distillspec.serving.vllm_backend import VLLMGenerator  # noqa: PLC0415 (vLLM, optional)

            self.draft, self.tokenizer = None, load_tokenizer(m.draft)
            self.engine = VLLMGenerator(
                s.vllm,
                m.target,
                m.draft,
                self.tokenizer,
                max_new_tokens=d.max_new_tokens,
                temperature=d.temperature,
                gamma=d.sample_gamma,
                seed=seed,
                max_prompt_tokens=d.max_prompt_tokens,
            )
            self.sampler = Sampler(None, None, self.tokenizer, train, d, seed=seed, generate=self.engine, **online)
        else:
            self.draft, self.tokenizer = load_rollout_draft(m, d.bf16, s.rollout.decoding_copy)
            self.engine, target = None, None
            if resolve_recipe(d).draws_target_samples and not s.rollout.online_samples:
                target = load_target(m, s.run)
            self.sampler = Sampler(target, self.draft, self.tokenizer, train, d, seed=seed, topk=s.topk, **online)
        self.store = ray.get_actor(weights_name(s.run))
        self.prompts = ray.get_actor(prompts_name(s.run)) if s.rollout.online else None
        #: online: the data set, the prompts drawn (served and the data set's) and the served samples taken
        self.dataset, self.rows = train, {"served": 0, "data": 0, "samples": 0}
        self.version = -1  #: the draft version this actor samples with
        self.made = 0
        log.info("rollout %d up (pid %d%s)", rank, os.getpid(), ", restarted" if restarted else "")

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        """The pipeline is done (its buffer closed): a batch still waiting for served prompts or samples is not made
        (its ``sample`` raises :class:`~actors.common.Stopped`), so the run ends now, not when traffic comes."""
        self.stopped.set()

    def wait(self, what: str) -> None:
        """Half a second of a wait for the endpoint's traffic, or :class:`~actors.common.Stopped` once told to stop."""
        if self.stopped.wait(0.5):
            raise Stopped(f"rollout {self.rank}: the pipeline stopped while it waited for {what}")

    @ray.method(num_returns=2)
    def sample(self, max_tokens: int, vocab_size: int) -> tuple[BatchHeader, RolloutBatch]:
        """One batch from the latest draft, and its header checked against the buffer's limits: the buffer calls this
        (:meth:`actors.buffer.BufferActor.feed`) when it holds a slot for the batch, and owns the answer."""
        self.sync()
        start = time.perf_counter()
        source, tokens = self.sampler()
        batch = RolloutBatch.from_batch(tokens, version=self.version, source=source)
        self.made += 1
        seconds, run, name = time.perf_counter() - start, self.settings.run, str(self.rank)
        gauge("distillspec_rollout_samples_per_s", batch.rows / seconds, run=run, actor=name)
        gauge("distillspec_rollout_tokens_per_s", batch.tokens / seconds, run=run, actor=name)
        return batch.header(max_tokens=max_tokens, vocab_size=vocab_size), batch

    def served_prompts(self) -> list[Example]:
        """Online distillation: recent prompts the endpoint served (waits until the log holds enough), with the data
        set's beside them as ``rollout.online_mix`` says."""
        r = self.settings.rollout
        served, data = online_rows(self.settings.distill.batch_size, r.online_mix)
        while not (prompts := ray.get(self.prompts.sample.remote(served, r.online_min_prompts))):
            self.wait("served prompts")
        replayed = self.sampler.rng.sample(self.dataset, min(data, len(self.dataset)))
        # one assignment: stats() runs on another thread of this actor and must not see one count moved alone
        rows = self.rows
        self.rows = {**rows, "served": rows["served"] + len(prompts), "data": rows["data"] + len(replayed)}
        return [Example(prompt=p, reference="") for p in prompts] + replayed

    def served_samples(self) -> Batch:
        """Online distillation on served completions (``rollout.online_samples``): a batch of the newest
        ``distill.batch_size`` the endpoint recorded at this run's temperature with the target's scores (waits until
        the log holds as many; each trains once)."""
        d = self.settings.distill
        while not (samples := ray.get(self.prompts.take_samples.remote(d.batch_size, d.temperature))):
            self.wait("served samples")
        self.sync()  # the batch is made now, not when the wait began: its version is the latest, not a stale one
        self.rows = {**self.rows, "samples": self.rows["samples"] + len(samples)}
        return served_batch(samples, self.tokenizer.pad_token_id, d.max_prompt_tokens, d.max_new_tokens)

    @staticmethod
    def nothing(source: str, examples: list[Example]) -> Batch:
        raise DistillSpecError(f"a rollout actor of served samples alone was asked to sample from the {source}")

    def sync(self) -> None:
        """Take the store's latest draft version, if newer: into the torch draft, or into the vLLM engines; with
        neither (served samples alone), the version's number only: the version the batches are made at."""
        if self.draft is None and self.engine is None:
            held = ray.get(self.store.follow.remote("latest")).held
            self.version = self.version if held is None else held.number
            return
        load = functools.partial(load_arrays, self.draft) if self.draft is not None else self.engine.load_draft
        try:
            self.version = take(self.store, self.version, load)[0]
        except TransferRefused:
            pass  # logged and counted where it was found; sample with the weights held

    def stats(self) -> dict:
        """The version this actor samples with, the batches it made, online the served and data-set prompts it drew
        and the served samples it took, and with vLLM its in-place weight loads."""
        loads = self.engine.loads if self.engine is not None else None
        return {
            "version": self.version,
            "made": self.made,
            "online_rows": self.rows,
            "weight_loads": loads,
            "pid": os.getpid(),
        }


@ray.remote(max_restarts=-1, max_task_retries=-1)
class ScorerActor:
    """Runs the frozen target over a batch and returns its distribution: full logits or top-k log-probs
    (with ``rollout.backend=vllm``, vLLM's prompt log-probs: top-k only)."""

    def __init__(self, settings: ScorerSettings) -> None:
        setup_worker()
        s, m = settings, settings.models
        self.topk, self.temperature = s.topk, s.temperature
        self.target = self.engine = None
        if s.scored:  # every batch comes scored (served samples alone): nothing to load
            pass
        elif s.backend == "vllm":
            from distillspec.serving.vllm_backend import start_engine  # noqa: PLC0415 (vLLM, optional)

            self.engine = start_engine(s.vllm, m.target, seed=s.seed)
        else:
            self.target = load_target(m, s.run, scores_only=True)

    @torch.inference_mode()  # outermost: its wrapper copies the method's Ray options (num_returns) from the inner one
    @ray.method(num_returns=2)
    def score(self, batch: RolloutBatch, max_tokens: int, vocab_size: int) -> tuple[BatchHeader, RolloutBatch]:
        """``batch`` with the target's distribution attached, and its header checked against the buffer's limits
        (the buffer chains this to a rollout actor's :meth:`RolloutActor.sample`). A batch of the target's samples
        comes scored already (speculative decoding computed the target's top-k of each token): it passes as it is."""
        if batch.scored:
            return batch.header(max_tokens=max_tokens, vocab_size=vocab_size), batch
        if self.engine is None and self.target is None:
            raise DistillSpecError("a batch came unscored to a scorer of served samples, which holds no target")
        if self.engine is not None:
            from distillspec.serving.vllm_backend import prompt_topk  # noqa: PLC0415 (vLLM, optional)

            batch.set_target_topk(prompt_topk(self.engine, batch.batch(), self.topk))
        else:
            logits = forward_logits(self.target, batch.batch(self.target.device))
            batch.set_target(logits, self.topk, self.temperature)
        return batch.header(max_tokens=max_tokens, vocab_size=vocab_size), batch
