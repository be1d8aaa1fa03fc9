"""Rollout actors sample training batches from the current draft (and the target, via SD) into the buffer;
scoring actors add the target's distribution to a batch when the learner is not to compute it."""

from __future__ import annotations

import os
import time

import ray
import torch

from actors.common import buffer_name, log, prompts_name, scorer_name, setup_worker, weights_name
from actors.dashboard import gauge
from actors.weights import fetch
from distillspec.batches import RolloutBatch
from distillspec.config import JobConfig, resolve_recipe
from distillspec.data import Example
from distillspec.integrity import TransferRefused
from distillspec.losses import forward_logits, train_temperature
from distillspec.models import load_arrays, load_model, load_tokenizer
from distillspec.rollout import Sampler, needs_target_samples


@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=2)
class RolloutActor:
    """Samples training batches from the latest published draft. Ray restarts it when it dies, and retries
    the call it was serving."""

    def __init__(self, cfg: JobConfig, rank: int) -> None:
        setup_worker()
        r = cfg.ray
        buffer = ray.get_actor(buffer_name(r.run_name))
        train: list[Example] = ray.get(ray.get(buffer.examples.remote())[0])  # the training examples
        # Found by name, not passed in: an actor that Ray restarts must not depend on arguments in the object store.
        scorers = range(r.num_scorers) if r.target_logits == "scorer" else ()
        self.scorers = [ray.get_actor(scorer_name(r.run_name, i)) for i in scorers]
        self.cfg, self.rank = cfg, rank
        d = cfg.distill
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        seed = cfg.seed * 100_003 + 7919 * (rank + 1) + (os.getpid() if restarted else 0)
        if cfg.ray.backend == "vllm":  # the engines hold the draft; new versions load into them in place
            from distillspec.vllm_backend import VLLMGenerator  # the optional extra, imported only when asked for

            self.draft, self.tokenizer = None, load_tokenizer(cfg.draft)
            self.engine = VLLMGenerator(
                cfg.vllm,
                cfg.target,
                cfg.draft,
                self.tokenizer,
                max_new_tokens=d.max_new_tokens,
                temperature=d.temperature,
                gamma=d.sample_gamma,
                seed=seed,
                max_prompt_tokens=d.max_prompt_tokens,
            )
            self.sampler = Sampler(None, None, self.tokenizer, train, d, seed=seed, generate=self.engine)
        else:
            self.draft, self.tokenizer = load_model(cfg.draft, device=cfg.device)
            target = None
            if needs_target_samples(resolve_recipe(d)):
                target = load_model(cfg.target, device=cfg.device, dtype=cfg.target_dtype)[0]
            self.sampler = Sampler(target, self.draft, self.tokenizer, train, d, seed=seed)
        self.store = ray.get_actor(weights_name(cfg.ray.run_name))
        self.prompts = ray.get_actor(prompts_name(cfg.ray.run_name)) if cfg.ray.online else None
        self.version = -1  #: the draft version this actor samples with
        self.made = 0
        self.sampled: list[dict] = []  #: version, source and the buffer's answer of each batch made
        log.info("rollout %d up (pid %d%s)", rank, os.getpid(), ", restarted" if restarted else "")

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> int:
        """Sample into the buffer until it closes; returns the number of batches made. Each batch is sampled only
        once the buffer holds a slot for it."""
        buffer = ray.get_actor(buffer_name(self.cfg.ray.run_name))
        while ray.get(buffer.reserve.remote(self.rank, timeout_s=5.0)):
            batch, seconds = self.sample()
            status = ray.get(buffer.put.remote([ray.put(batch)], self.rank))
            self.sampled.append({"version": batch.version, "source": batch.source, "status": status})
            rows, run, name = batch.rows, self.cfg.ray.run_name, str(self.rank)
            gauge("distillspec_rollout_samples_per_s", rows / seconds, run=run, actor=name)
            gauge("distillspec_rollout_tokens_per_s", batch.tokens / seconds, run=run, actor=name)
            if status == "closed":
                break
        return self.made

    def sample(self) -> tuple[RolloutBatch, float]:
        """One batch from the latest draft, and the seconds it took."""
        self.sync()
        if self.prompts is not None:
            self.sampler.train = self.served_prompts()
        start = time.perf_counter()
        source, tokens = self.sampler()
        batch = RolloutBatch.from_batch(tokens, version=self.version, source=source)
        if self.scorers:
            batch = ray.get(self.scorers[self.made % len(self.scorers)].score.remote(batch))
        self.made += 1
        return batch, time.perf_counter() - start

    def served_prompts(self) -> list[Example]:
        """Online distillation: the latest prompts the endpoint served (waits until there are enough)."""
        r = self.cfg.ray
        while len(prompts := ray.get(self.prompts.sample.remote(self.cfg.distill.batch_size))) < r.online_min_prompts:
            time.sleep(0.5)
        return [Example(prompt=p, reference="") for p in prompts]

    def sync(self) -> None:
        """Take the store's latest draft version, if newer: into the torch draft, or into the vLLM engines."""
        try:
            version, arrays = fetch(self.store, self.version)
            if arrays is not None:
                if self.draft is not None:
                    load_arrays(self.draft, arrays)
                else:
                    self.engine.load_draft(arrays)
            self.version = version
        except TransferRefused:
            pass  # logged and counted where it was found; sample with the weights held

    def stats(self) -> dict:
        """The version this actor samples with and, with vLLM, its in-place weight loads."""
        loads = self.engine.loads if self.draft is None else None
        return {
            "version": self.version,
            "made": self.made,
            "sampled": self.sampled,
            "weight_loads": loads,
            "pid": os.getpid(),
        }


@ray.remote(max_restarts=-1, max_task_retries=-1)
class ScorerActor:
    """Runs the frozen target over a batch and returns its distribution: full logits or top-k log-probs
    (with ``ray.backend=vllm``, vLLM's prompt log-probs: top-k only)."""

    def __init__(self, cfg: JobConfig) -> None:
        setup_worker()
        self.topk, self.temperature = cfg.ray.topk, train_temperature(cfg.distill.temperature)
        self.target = self.engine = None
        if cfg.ray.backend == "vllm":
            from distillspec.vllm_backend import start_engine  # the optional extra, imported only when asked for

            self.engine = start_engine(cfg.vllm, cfg.target, seed=cfg.seed)
        else:
            self.target, _ = load_model(cfg.target, device=cfg.device, dtype=cfg.target_dtype)

    @torch.inference_mode()
    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with the target's distribution attached."""
        if self.engine is not None:
            from distillspec.vllm_backend import prompt_topk  # loaded by __init__ already

            batch.set_target_topk(prompt_topk(self.engine, batch.batch(), self.topk))
            return batch
        batch.set_target(forward_logits(self.target, batch.batch(self.target.device)), self.topk, self.temperature)
        return batch
