"""On-policy sampling with vLLM (``ray.backend=vllm``, the optional GPU extra; imported only when asked for).

Same contract as :class:`distillspec.distill.Sampler` for draft-generated batches: ``sampler()`` returns
``(source, Batch)``. Fixed-data and target-generated batches still come from the torch path.

Not yet exercised on a GPU by this project's tests (no GPU machine was lent when it was written).
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from distillspec.config import JobConfig
from distillspec.data import Example
from distillspec.distill import Batch, draw_source, encode_examples, make_batch, resolve_recipe
from distillspec.errors import DistillSpecError
from distillspec.models import encode_prompts


def _load_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:  # runs inside each vLLM worker
    worker.model_runner.model.load_weights(weights=weights)


class VLLMSampler:
    def __init__(self, cfg: JobConfig, train: list[Example], tokenizer: PreTrainedTokenizerBase, *, seed: int) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError:
            raise DistillSpecError(
                "ray.backend=vllm needs vLLM on a GPU node: pip install -e '.[vllm]' (or use ray.backend=hf)"
            ) from None
        if not torch.cuda.is_available():
            raise DistillSpecError("ray.backend=vllm needs a GPU: set ray.rollout_gpus=1, or use ray.backend=hf")
        self.recipe = resolve_recipe(cfg.distill)
        if self.recipe.lambda1 < 1.0 and self.recipe.lambda2 < 1.0:
            raise DistillSpecError("ray.backend=vllm samples the draft only: use a recipe without target samples")
        self.cfg, self.train, self.tokenizer = cfg, train, tokenizer
        self.rng = random.Random(seed)
        self.llm = LLM(model=cfg.draft, seed=seed, enforce_eager=True, gpu_memory_utilization=0.3)
        self.params = SamplingParams(
            temperature=cfg.distill.temperature, max_tokens=cfg.distill.max_new_tokens, seed=seed
        )

    def load_weights(self, model: PreTrainedModel) -> None:
        weights = [(k, v.detach().cuda()) for k, v in model.state_dict().items()]
        self.llm.collective_rpc(_load_weights, args=(weights,))

    def __call__(self) -> tuple[str, Batch]:
        source = draw_source(self.rng, self.recipe)
        examples = self.rng.sample(self.train, min(self.cfg.distill.batch_size, len(self.train)))
        if source == "fixed":
            return source, encode_examples(self.tokenizer, examples, 256)
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, [e.prompt for e in examples])
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids, prompt_mask)]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        conts = [list(o.outputs[0].token_ids) for o in outputs]
        width = max(1, *(len(c) for c in conts))
        pad = self.tokenizer.pad_token_id
        continuation = torch.tensor([c + [pad] * (width - len(c)) for c in conts])
        return source, make_batch(prompt_ids, prompt_mask, continuation, torch.tensor([len(c) for c in conts]))
