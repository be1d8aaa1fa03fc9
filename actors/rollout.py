"""Rollout actors sample training batches from the current draft (and the target, via SD) into the buffer;
scoring actors add the target's distribution to a batch when the learner is not to compute it."""

from __future__ import annotations

import os
import time

import ray
import torch

from actors.common import log, prompts_name, setup_worker, weights_name
from actors.metrics import gauge
from actors.weights import fetch, load_arrays
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
from distillspec.models import load_model, load_tokenizer


@ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=2)
class RolloutActor:
    """Samples training batches from the latest published draft. Ray restarts it when it dies, and retries
    the call it was serving."""

    def __init__(self, cfg: JobConfig, train: list[Example], rank: int, scorers: list | None = None) -> None:
        setup_worker()
        self.cfg, self.rank, self.scorers = cfg, rank, scorers or []
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
                gamma=cfg.eval.speedup_gamma,
                seed=seed,
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
        """Take the store's latest draft version, if newer: into the torch draft, or into the vLLM engines."""
        version, arrays = fetch(self.store, self.version)
        if arrays is not None:
            if self.draft is not None:
                load_arrays(self.draft, arrays)
            else:
                self.engine.load_draft(arrays)
        self.version = version

    def stats(self) -> dict:
        """The version this actor samples with and, with vLLM, its in-place weight loads."""
        loads = self.engine.loads if self.draft is None else None
        return {"version": self.version, "made": self.made, "weight_loads": loads, "pid": os.getpid()}


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
    def score(self, arrays: dict) -> dict:
        if self.engine is not None:
            from distillspec.vllm_backend import prompt_topk  # loaded by __init__ already

            top = prompt_topk(self.engine, batch_from_arrays(arrays), self.topk)
            return {"target_topk_logprobs": top.logprobs.numpy(), "target_topk_indices": top.indices.numpy()}
        batch = batch_from_arrays(arrays, self.target.device)
        return target_to_arrays(forward_logits(self.target, batch), self.topk, self.temperature)
