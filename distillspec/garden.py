"""The model garden: a tokenizer and a target/draft pair of Llama-architecture LMs trained from scratch.

The draft is trained on the same data as the target: it is the paper's fine-tuned, undistilled baseline.
Everything is saved with ``save_pretrained`` and cached under a hash of (task, config, seed).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from distillspec.config import GardenConfig, ModelSize
from distillspec.data import Example, Task
from distillspec.distill import encode_examples, lm_loss, make_optimizer

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with one token per digit, saved as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)


def make_model(size: ModelSize, tokenizer: PreTrainedTokenizerFast, *, max_positions: int = 1024) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.d_model,
        num_hidden_layers=size.n_layers,
        num_attention_heads=size.n_heads,
        num_key_value_heads=size.n_heads,
        intermediate_size=size.d_ff,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def train_lm(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[Example],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    max_len: int,
    seed: int,
    bf16: bool = True,
    desc: str = "train",
) -> list[float]:
    """Next-token training on whole examples (prompt and reference). Returns the loss per step.

    ``bf16`` runs the forward pass under bfloat16 autocast (weights stay float32): ~2x faster on CPUs
    with AVX512-BF16 or AMX, and on GPUs.
    """
    rng = random.Random(seed)
    optimizer, scheduler = make_optimizer(model, lr, steps, warmup_steps=max(1, steps // 20))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, leave=False)
    for _ in bar:
        batch = encode_examples(tokenizer, rng.sample(examples, min(batch_size, len(examples))), max_len)
        valid_next = batch.attention_mask.clone()
        valid_next[:, :-1] = batch.attention_mask[:, 1:]
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(model, batch, mask=valid_next * batch.attention_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def garden_key(task_name: str, cfg: GardenConfig, seed: int) -> str:
    spec = {k: v for k, v in asdict(cfg).items() if k != "cache_dir"}
    blob = json.dumps({"task": task_name, "seed": seed, "garden": spec, "version": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_garden(task: Task, cfg: GardenConfig, *, seed: int = 0, log=print) -> Path:
    """Build (or reuse) the garden for ``task``; returns its folder with ``target/`` and ``draft/``."""
    root = Path(cfg.cache_dir) / f"{task.name}-{garden_key(task.name, cfg, seed)}"
    if (root / "garden.json").exists():
        log(f"garden: reusing {root}")
        return root
    root.mkdir(parents=True, exist_ok=True)
    train = task.train[: cfg.train_examples] if cfg.train_examples else task.train
    start = time.perf_counter()
    log(f"garden: training a {cfg.vocab_size}-token tokenizer on {len(train)} {task.name} examples")
    tokenizer = train_tokenizer([e.prompt + e.reference for e in train], cfg.vocab_size)
    meta: dict = {"task": task.name, "seed": seed, "config": asdict(cfg), "models": {}}
    for role, size, steps in (("target", cfg.target, cfg.target_steps), ("draft", cfg.draft, cfg.draft_steps)):
        torch.manual_seed(seed + (0 if role == "target" else 1))
        model = make_model(size, tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"garden: training the {role} ({n_params / 1e6:.2f}M parameters, {steps} steps)")
        losses = train_lm(
            model,
            tokenizer,
            train,
            steps=steps,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            max_len=cfg.max_len,
            seed=seed,
            bf16=cfg.bf16,
            desc=f"garden {role}",
        )
        model.eval().save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
        meta["models"][role] = {"parameters": n_params, "final_loss": sum(losses[-20:]) / len(losses[-20:])}
    meta["build_seconds"] = time.perf_counter() - start
    (root / "garden.json").write_text(json.dumps(meta, indent=2))  # written last: marks the garden complete
    log(f"garden: built {root} in {meta['build_seconds']:.0f}s")
    return root
