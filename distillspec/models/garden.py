"""The model garden: a tokenizer and a target/draft pair of Llama-architecture LMs trained from scratch.

The draft is trained on the same data as the target: it is the paper's fine-tuned, undistilled baseline.
Everything is saved with ``save_pretrained`` and cached under a hash of (task, config, seed).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from distillspec.config import DistillConfig, GardenConfig, ModelSize
from distillspec.files import cache_root
from distillspec.models.loading import native_bf16
from distillspec.tasks.data import Example, Task, chat_template
from distillspec.training.batches import Batch
from distillspec.training.learner import Learner
from distillspec.training.losses import lm_loss
from distillspec.training.rollout import encode_examples

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with one token per digit, saved as a transformers fast tokenizer that starts every text it
    encodes with its BOS token (the garden's models read their prompts so)."""
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
    return PreTrainedTokenizerFast(tokenizer_object=tok, add_bos_token=True, **SPECIAL)


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


def whole_example_loss(model: torch.nn.Module, batch: Batch, _target: object = None) -> torch.Tensor:
    """Next-token cross-entropy over every real token of the batch (prompt and reference)."""
    valid_next = batch.attention_mask.clone()
    valid_next[:, :-1] = batch.attention_mask[:, 1:]
    return lm_loss(model, batch, mask=valid_next * batch.attention_mask)


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
    with AVX512-BF16 or AMX, and on GPUs; about 18x slower on CPUs that emulate it (see :func:`native_bf16`).
    """
    rng = random.Random(seed)
    schedule = DistillConfig(lr=lr, steps=steps, warmup_steps=max(1, steps // 20))
    learner = Learner(model, None, schedule, objective=whole_example_loss, bf16=bf16)
    losses = []
    bar = tqdm(range(steps), desc=desc, leave=False)
    for _ in bar:
        batch = encode_examples(tokenizer, rng.sample(examples, min(batch_size, len(examples))), max_len)
        losses.append(learner.step(batch)["loss"])
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def _key(**parts) -> str:
    return hashlib.sha256(json.dumps({**parts, "version": 2}, sort_keys=True).encode()).hexdigest()[:12]


def garden_bf16(cfg: GardenConfig) -> bool:
    """Whether the garden trains under bfloat16 autocast: ``cfg.bf16``, or where it is null, where this CPU has it."""
    return native_bf16("cpu") if cfg.bf16 is None else cfg.bf16


def garden_keys(task_name: str, cfg: GardenConfig, seed: int) -> dict[str, str]:
    """Cache keys: the tokenizer's, and each model's (so a new draft size reuses the target)."""
    tok = _key(task=task_name, seed=seed, vocab_size=cfg.vocab_size, train_examples=cfg.train_examples)
    train = {k: getattr(cfg, k) for k in ("batch_size", "lr", "max_len")} | {"bf16": garden_bf16(cfg)}
    return {
        "tokenizer": tok,
        "target": _key(tok=tok, size=asdict(cfg.target), steps=cfg.target_steps, **train),
        "draft": _key(tok=tok, size=asdict(cfg.draft), steps=cfg.draft_steps, **train),
    }


def garden_dir(cfg: GardenConfig) -> Path:
    """``cfg.cache_dir``, or where unset ``garden/`` in the project's cache (:func:`~distillspec.models.pretrained.
    cache_root`)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_root() / "garden"


@dataclass
class Garden:
    target: Path
    draft: Path


#: The garden's chat template: each user turn in the task's prompt format ("<Label>: <content>\n<Label>:"), each
#: assistant turn as the reference follows it; system turns are dropped (the garden never saw one).
def build_garden(task: Task, cfg: GardenConfig, *, seed: int = 0, log=print) -> Garden:
    """Build (or reuse) the garden for ``task``: each of tokenizer, target and draft is cached on its own.

    Layout: ``cache_dir/<task>-<tokenizer key>/{tokenizer, target-<key>, draft-<key>}``; a model folder
    holds ``save_pretrained`` weights, the tokenizer and ``garden.json`` (written last: marks it complete).
    """
    keys = garden_keys(task.name, cfg, seed)
    root = garden_dir(cfg) / f"{task.name}-{keys['tokenizer']}"
    train = task.train[: cfg.train_examples] if cfg.train_examples else task.train
    if (root / "tokenizer" / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(root / "tokenizer")
    else:
        log(f"garden: training a {cfg.vocab_size}-token tokenizer on {len(train)} {task.name} examples")
        tokenizer = train_tokenizer([e.prompt + e.reference for e in train], cfg.vocab_size)
        tokenizer.chat_template = chat_template(task)
        tokenizer.save_pretrained(root / "tokenizer")
    bf16 = garden_bf16(cfg)
    folders = {role: root / f"{role}-{keys[role]}" for role in ("target", "draft")}
    if bf16 and not native_bf16("cpu") and not all((f / "garden.json").exists() for f in folders.values()):
        log(
            "garden: warning: garden.bf16=true on a CPU without AMX or AVX512-BF16 emulates bfloat16, about 18x slower "
            "than float32: leave garden.bf16 false"
        )
    paths = {}
    for role, size, steps in (("target", cfg.target, cfg.target_steps), ("draft", cfg.draft, cfg.draft_steps)):
        folder = paths[role] = folders[role]
        if (folder / "garden.json").exists():
            log(f"garden: reusing the {role} {folder}")
            add_chat_template(folder, chat_template(task))
            continue
        if role == "target" or not paths.get("target"):
            log(f"garden: building it in {root} (once: later runs on this machine reuse it)")
        start = time.perf_counter()
        torch.manual_seed(seed + (0 if role == "target" else 1))
        tokenizer.chat_template = tokenizer.chat_template or chat_template(task)
        model = make_model(size, tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        log(
            f"garden: training the {role} ({n_params / 1e6:.2f}M parameters, {steps} steps, "
            f"{'bfloat16 autocast' if bf16 else 'float32'}) on {task.name}"
        )
        losses = train_lm(
            model,
            tokenizer,
            train,
            steps=steps,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            max_len=cfg.max_len,
            seed=seed,
            bf16=bf16,
            desc=f"garden {role}",
        )
        model.eval().save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        meta = {
            "task": task.name,
            "role": role,
            "seed": seed,
            "size": asdict(size),
            "steps": steps,
            "parameters": n_params,
            "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "seconds": time.perf_counter() - start,
            "bf16": bf16,
            "config": asdict(cfg),
        }
        (folder / "garden.json").write_text(json.dumps(meta, indent=2))
        log(f"garden: built the {role} in {meta['seconds']:.0f}s (final loss {meta['final_loss']:.3f})")
    return Garden(target=paths["target"], draft=paths["draft"])


def add_chat_template(folder: Path, template: str | None) -> None:
    """Give a garden model built before gardens had a chat template its template (the tokenizer files only)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    if template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = template
        tokenizer.save_pretrained(folder)
