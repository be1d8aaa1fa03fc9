"""Rollout actors sample training batches from the current draft (and the target, via SD) into the buffer;
scoring actors add the target's distribution to a batch when the learner is not to compute it."""

from __future__ import annotations

import os
import time

import ray
import torch

from actors.common import log, prompts_name, setup_worker, weights_name
from actors.metrics import gauge
from actors.weights import pull
from distillspec.config import JobConfig
from distillspec.data import Example
from distillspec.distill import (
    Sampler,
    batch_from_arrays,
    batch_to_arrays,
    forward_logits,
    needs_target_samples,
    resolve_recipe,
    target_to_arrays,
    train_temperature,
)
from distillspec.models import load_model


@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=2)
class RolloutActor:
    """Samples training batches from the latest published draft. Ray restarts it when it dies, and retries
    the call it was serving."""

    def __init__(self, cfg: JobConfig, train: list[Example], rank: int, scorers: list | None = None) -> None:
        setup_worker()
        self.cfg, self.rank, self.scorers = cfg, rank, scorers or []
        recipe = resolve_recipe(cfg.distill)
        self.draft, self.tokenizer = load_model(cfg.draft, device=cfg.device)
        target = (
            load_model(cfg.target, device=cfg.device, dtype=cfg.target_dtype)[0]
            if needs_target_samples(recipe)
            else None
        )
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        seed = cfg.seed * 100_003 + 7919 * (rank + 1) + (os.getpid() if restarted else 0)
        if cfg.ray.backend == "vllm":
            from actors.vllm_sampler import VLLMSampler  # the optional GPU extra, imported only when asked for

            self.sampler = VLLMSampler(cfg, train, self.tokenizer, seed=seed)
        else:
            self.sampler = Sampler(target, self.draft, self.tokenizer, train, cfg.distill, seed=seed)
        self.store = ray.get_actor(weights_name(cfg.ray.run_name))
        self.prompts = ray.get_actor(prompts_name(cfg.ray.run_name)) if cfg.ray.online else None
        self.version = -1
        self.made = 0
        log.info("rollout %d up (pid %d%s)", rank, os.getpid(), ", restarted" if restarted else "")

    def pid(self) -> int:
        return os.getpid()

    @ray.method(num_returns=2)
    def sample(self) -> tuple[dict, dict]:
        """One batch from the latest draft: ``(meta, arrays)``. Two returns, so the driver reads the small meta
        and passes the arrays on as a reference; both are owned by the caller and outlive this actor."""
        self.sync()
        if self.prompts is not None:
            self.sampler.train = self.served_prompts()
        start = time.perf_counter()
        source, batch = self.sampler()
        arrays = batch_to_arrays(batch)
        if self.scorers:
            scorer = self.scorers[self.made % len(self.scorers)]
            arrays.update(ray.get(scorer.score.remote(arrays)))
        seconds = time.perf_counter() - start
        self.made += 1
        rows, run, name = batch.input_ids.shape[0], self.cfg.ray.run_name, str(self.rank)
        gauge("distillspec_rollout_samples_per_s", rows / seconds, run=run, actor=name)
        gauge("distillspec_rollout_tokens_per_s", batch.tokens / seconds, run=run, actor=name)
        meta = {"version": self.version, "source": source, "rows": rows, "tokens": batch.tokens, "seconds": seconds}
        return meta, arrays

    def served_prompts(self) -> list[Example]:
        """Online distillation: the latest prompts the endpoint served (waits until there are enough)."""
        r = self.cfg.ray
        while len(prompts := ray.get(self.prompts.sample.remote(self.cfg.distill.batch_size))) < r.online_min_prompts:
            time.sleep(0.5)
        return [Example(prompt=p, reference="") for p in prompts]

    def sync(self) -> None:
        version = pull(self.store, self.draft, self.version)
        if version != self.version and hasattr(self.sampler, "load_weights"):
            self.sampler.load_weights(self.draft)
        self.version = version


@ray.remote(max_restarts=-1, max_task_retries=-1)
class ScorerActor:
    """Runs the frozen target over a batch and returns its distribution: full logits or top-k log-probs."""

    def __init__(self, cfg: JobConfig) -> None:
        setup_worker()
        self.target, _ = load_model(cfg.target, device=cfg.device, dtype=cfg.target_dtype)
        self.topk, self.temperature = cfg.ray.topk, train_temperature(cfg.distill.temperature)

    @torch.inference_mode()
    def score(self, arrays: dict) -> dict:
        batch = batch_from_arrays(arrays, self.target.device)
        return target_to_arrays(forward_logits(self.target, batch), self.topk, self.temperature)
