"""The one training step of the project: the :class:`Learner` owns the draft, its optimizer and schedule, and the
recipe; ``step(batch)`` computes the loss, steps the optimizer and returns the log record.

The single-process loop (:class:`Distiller`, ``ray.mode=sync``), the Ray Train worker
(``actors/learner.py``) and the garden trainer (:func:`distillspec.models.garden.train_lm`) all step through it, and all
save and resume through :func:`save_checkpoint` / :func:`load_checkpoint` (one checkpoint format).

Every log record has the keys of :data:`LOG_KEYS`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from distillspec.config import DistillConfig, resolve_recipe
from distillspec.errors import DistillSpecError
from distillspec.files import RecordLog, write_folder
from distillspec.models.loading import load_model
from distillspec.models.packing import INT4_GROUP, int4_groups
from distillspec.tasks.data import Example
from distillspec.training.batches import Batch
from distillspec.training.divergences import TopKLogprobs
from distillspec.training.losses import kd_loss
from distillspec.training.rollout import Sampler

#: The keys of a learner's log record: the step, the batch (its source, tokens, the draft version that sampled it
#: and its lag behind the learner), the loss and learning rate, when (seconds since the start), and the time spent
#: getting the batch (sampling it, or waiting for it) and updating on it.
LOG_KEYS = ("step", "source", "loss", "tokens", "lr", "version", "lag", "time", "wait_s", "compute_s")

#: A training objective: the loss of ``model`` on ``batch`` (the target's logits, when given, come with the batch).
Objective = Callable[[torch.nn.Module, Batch, "Tensor | TopKLogprobs | None"], Tensor]


def make_optimizer(
    model: torch.nn.Module, lr: float, steps: int, warmup_steps: int, params: list[Tensor] | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the weights that train (``requires_grad``; or ``params``), with linear warm-up and cosine decay to
    0 at ``steps``."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    return optimizer, get_cosine_schedule_with_warmup(optimizer, min(warmup_steps, steps), steps)


def freeze_all_but_layers(model: torch.nn.Module, top: int | None = None) -> int:
    """Only the decoder layers (``...layers.N...``) of ``model`` train (``distill.train=layers``), or only the last
    ``top`` of them (``distill.train=top:K``): the embeddings, final norm and head stay frozen. Returns the count of
    weights that train."""
    pattern = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    numbers = {int(m.group(1)) for name, _ in model.named_parameters() if (m := pattern.search(name))}
    if not numbers:
        raise DistillSpecError("distill.train: the draft has no '...layers.N...' weights to train")
    if top is not None and top > len(numbers):
        raise DistillSpecError(f"distill.train=top:{top}: the draft has {len(numbers)} decoder layers")
    lowest = max(numbers) - top + 1 if top is not None else min(numbers)
    trained = 0
    for name, p in model.named_parameters():
        m = pattern.search(name)
        p.requires_grad_(m is not None and int(m.group(1)) >= lowest)
        trained += p.numel() if p.requires_grad else 0
    return trained


class LoRAGradients(torch.autograd.Function):
    """The identity on a linear layer's output ``y``, whose backward pass adds LoRA's gradients to ``A`` and ``B``
    from ``g = dL/dy`` and the layer's input ``x``: ``dB = g^T (x A^T)`` and ``dA = (g B)^T x``, which are ``dW A^T``
    and ``B^T dW`` for the weight's ``dW = g^T x``, computed without ``dW``. ``g`` goes on to ``x`` through the merged
    weight alone, which holds ``B A``."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, x: Tensor, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(x, a, b)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, Tensor, Tensor]:
        x, a, b = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]).to(a.dtype), g.reshape(-1, g.shape[-1]).to(a.dtype)
        return g, None, (g2 @ b).T @ x2, g2.T @ (x2 @ a.T)


class LoRAHook:
    """The forward hook of one adapted layer: :class:`LoRAGradients` on its output while gradients are on. A copy of
    the draft (``copy.deepcopy``, pickling) is an ordinary model: its copy of the hook holds no factors and passes the
    layer's output through, where a copy of the factors would take gradients no optimizer steps."""

    def __init__(self, a: Tensor | None = None, b: Tensor | None = None) -> None:
        self.a, self.b = a, b

    def __call__(self, layer: torch.nn.Module, inputs: tuple[Tensor, ...], y: Tensor) -> Tensor | None:
        if self.a is None or not torch.is_grad_enabled():
            return None
        return LoRAGradients.apply(y, inputs[0].detach(), self.a, self.b)

    def __reduce__(self) -> tuple[type, tuple]:
        return LoRAHook, ()


class LoRA:
    """Low-rank adaptation (Hu et al., 2021, arXiv 2106.09685) of every linear weight in ``model``'s decoder layers
    (``distill.train=lora:R``), kept merged: each such weight ``W`` [out, in] is ``W0 + B A`` at every step, with
    ``A`` [R, in] (Kaiming-uniform, as LoRA starts it) and ``B`` [out, R] (zeros, so the draft starts as it is) the
    only weights the optimizer holds. The forward pass is the merged weight's; a hook on each adapted layer gives
    ``A`` and ``B`` LoRA's gradients (:class:`LoRAGradients`), and no weight of the draft has a gradient: the backward
    pass carries ``dL/dx`` down through the layers and never forms a ``dW`` [out, in]. The draft stays an ordinary
    model: sampling, publishing and saving see the same weights under the same names, no adapter to merge
    (``peft``'s adapter layers would rename the weights they wrap, for every consumer of a draft version to merge
    back). The optimizer's state is ``R * (in + out)`` numbers a weight instead of ``out * in``. Everything else stays
    frozen. Under DDP the model is not wrapped (none of its weights train): :meth:`gradients` averages the factors'
    gradients over the workers."""

    name = "lora"  #: its key in a learner's state

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        pattern = re.compile(r"(?:^|\.)layers\.\d+\.")
        layers = [
            m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and pattern.search(name + ".")
        ]
        if not layers:
            raise DistillSpecError("distill.train=lora: the draft has no linear weights in '...layers.N...' to adapt")
        self.weights = [m.weight for m in layers]
        if (dtype := self.weights[0].dtype) != torch.float32:
            raise DistillSpecError(
                f"distill.train=lora: the draft's weights are {dtype}; LoRA moves them by steps too small for any "
                f"but float32 to hold (load the draft in float32: bfloat16 autocast, distill.bf16, still computes "
                f"in bfloat16)"
            )
        for p in model.parameters():
            p.requires_grad_(False)
        self.a: list[Tensor] = []
        self.b: list[Tensor] = []
        seed = torch.Generator().manual_seed(0)  # the same A on every DDP worker
        for layer, w in zip(layers, self.weights):
            a = torch.empty(rank, w.shape[1])
            torch.nn.init.kaiming_uniform_(a, a=5**0.5, generator=seed)
            a = torch.nn.Parameter(a.to(w.device))
            b = torch.nn.Parameter(torch.zeros(w.shape[0], rank, device=w.device))
            self.a.append(a)
            self.b.append(b)
            layer.register_forward_hook(LoRAHook(a, b))
        self.merged = self.factors()

    @property
    def params(self) -> list[Tensor]:
        return [*self.a, *self.b]

    def factors(self) -> list[tuple[Tensor, Tensor]]:
        return [(a.detach().clone(), b.detach().clone()) for a, b in zip(self.a, self.b)]

    def gradients(self) -> None:
        """Under DDP, the factors' gradients averaged over the workers (after the backward pass)."""
        average_gradients(self.params)

    @torch.no_grad()
    def merge(self) -> None:
        """Move each weight by ``B A`` less the ``B A`` merged before (after an optimizer step)."""
        for w, (a0, b0), a, b in zip(self.weights, self.merged, self.a, self.b):
            w.add_((b @ a - b0 @ a0).to(w.dtype))
        self.merged = self.factors()

    def state_dict(self) -> dict[str, list[Tensor]]:
        return {"a": [a.detach().clone() for a in self.a], "b": [b.detach().clone() for b in self.b]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, list[Tensor]]) -> None:
        """``A`` and ``B`` as saved (the weights they moved come with the checkpoint's draft, already merged)."""
        for p, saved in zip([*self.a, *self.b], [*state["a"], *state["b"]]):
            p.copy_(saved)
        self.merged = self.factors()


class ScaleGradients(torch.autograd.Function):
    """The identity on a linear layer's output ``y``, whose backward pass adds the gradients of its 4-bit groups'
    scales and zero points (:class:`GridScales`) from ``g = dL/dy`` and the layer's input ``x``: with the weight's
    ``dW = g^T x`` [out, in] in groups of :data:`~distillspec.models.packing.INT4_GROUP` inputs, ``d scale`` is each
    group's sum of ``dW * (code - 8)`` and ``d zero`` its sum of ``dW``, formed a chunk of rows at a time (a head's
    ``dW`` is as large as its weight). ``g`` goes on to ``x`` through the weight, which holds the grids."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, x: Tensor, codes: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
        ctx.save_for_backward(x, codes, scale, zero)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, Tensor, Tensor]:
        x, codes, scale, zero = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]).float(), g.reshape(-1, g.shape[-1]).float()
        d_scale, d_zero = torch.empty_like(scale), torch.empty_like(zero)
        for start in range(0, codes.shape[0], GRID_CHUNK_ROWS):
            rows = slice(start, start + GRID_CHUNK_ROWS)
            dw = (g2[:, rows].T @ x2).view(*codes[rows].shape)  # [rows, groups, INT4_GROUP]
            d_zero[rows] = dw.sum(-1)
            d_scale[rows] = dw.mul_(codes[rows]).sum(-1)
        return g, None, None, d_scale, d_zero


class ScaleHook:
    """The forward hook of one layer on 4-bit grids: :class:`ScaleGradients` on its output while gradients are on; a
    copy of the draft holds no grids and passes the output through (as :class:`LoRAHook`)."""

    def __init__(self, codes: Tensor | None = None, scale: Tensor | None = None, zero: Tensor | None = None) -> None:
        self.codes, self.scale, self.zero = codes, scale, zero

    def __call__(self, layer: torch.nn.Module, inputs: tuple[Tensor, ...], y: Tensor) -> Tensor | None:
        if self.codes is None or not torch.is_grad_enabled():
            return None
        return ScaleGradients.apply(y, inputs[0].detach(), self.codes, self.scale, self.zero)

    def __reduce__(self) -> tuple[type, tuple]:
        return ScaleHook, ()


#: Rows of a layer's ``dW`` that :class:`ScaleGradients` forms at a time.
GRID_CHUNK_ROWS = 8192


class GridScales:
    """The draft as its 4-bit decoding copy holds it, only each group's scale and zero point training
    (``distill.train=scales``; PEQA, Kim et al., 2023, arXiv 2305.14152): every linear weight of its decoder layers
    and its head whose inputs are whole groups of :data:`~distillspec.models.packing.INT4_GROUP` is rounded once by
    :func:`~distillspec.models.packing.int4_groups` (each group of a row on 16 levels, ``(code - 8) * scale + zero``),
    its codes fixed (a head tied to the input embeddings stays as it is); ``scale`` and ``zero`` [out, groups] are the
    only weights the optimizer holds. The weight stays merged (``(code - 8) * scale + zero`` after every step), so the
    draft is an ordinary model on 4-bit grids whose groups span codes 0 to 15: a 4-bit decoding copy
    (``draft_int8=int4``, the default for a large draft on a CPU) finds the same grids and holds the weights that
    trained, where a draft trained in float32 is rounded anew and a short distillation's change is a hundredth of that
    rounding (docs/MEASUREMENTS.md). The draft starts as its decoding copy, not as its file. The optimizer's state is
    two numbers a group of 32 weights; the backward pass forms each layer's ``dW`` a chunk at a time
    (:class:`ScaleGradients`) and keeps none. Under DDP as :class:`LoRA`."""

    name = "scales"  #: its key in a learner's state

    def __init__(self, model: torch.nn.Module) -> None:
        pattern = re.compile(r"(?:^|\.)layers\.\d+\.")
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and head.weight is getattr(model.get_input_embeddings(), "weight", None):
            head = None  # tied to the input embeddings, which rounding it would round: it stays as it is
        layers = [
            m
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
            and (pattern.search(name + ".") or m is head)
            and m.in_features % INT4_GROUP == 0
        ]
        if not layers:
            raise DistillSpecError(
                f"distill.train=scales: the draft has no linear weights in '...layers.N...' or its head whose inputs "
                f"are whole groups of {INT4_GROUP}"
            )
        self.weights = [m.weight for m in layers]
        if (dtype := self.weights[0].dtype) != torch.float32:
            raise DistillSpecError(f"distill.train=scales: the draft's weights are {dtype}; load it in float32")
        for p in model.parameters():
            p.requires_grad_(False)
        self.codes: list[Tensor] = []
        self.scale: list[Tensor] = []
        self.zero: list[Tensor] = []
        for layer, w in zip(layers, self.weights):
            codes, scales_zeros = int4_groups(w.detach())
            rows, cols = w.shape
            self.codes.append(codes.sub_(8).to(torch.int8).view(rows, cols // INT4_GROUP, INT4_GROUP))
            self.scale.append(torch.nn.Parameter(scales_zeros[..., 0].T.contiguous()))
            self.zero.append(torch.nn.Parameter(scales_zeros[..., 1].T.contiguous()))
            layer.register_forward_hook(ScaleHook(self.codes[-1], self.scale[-1], self.zero[-1]))
        self.merge()

    @property
    def params(self) -> list[Tensor]:
        return [*self.scale, *self.zero]

    def gradients(self) -> None:
        """Under DDP, the gradients averaged over the workers (after the backward pass)."""
        average_gradients(self.params)

    @torch.no_grad()
    def merge(self) -> None:
        """Each weight from its codes, scales and zero points (after an optimizer step), a chunk of rows at a time."""
        for w, codes, scale, zero in zip(self.weights, self.codes, self.scale, self.zero):
            for start in range(0, len(w), GRID_CHUNK_ROWS):
                rows = slice(start, start + GRID_CHUNK_ROWS)
                grid = codes[rows].float().mul_(scale[rows, :, None]).add_(zero[rows, :, None])
                w[rows] = grid.view(w[rows].shape)

    def state_dict(self) -> dict[str, list[Tensor]]:
        return {"scale": [p.detach().clone() for p in self.scale], "zero": [p.detach().clone() for p in self.zero]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, list[Tensor]]) -> None:
        """The scales and zero points as saved, and the codes that put the checkpoint's draft on their grids (the
        draft's own rounding finds a group whose scale crossed 0 with its codes the other way up)."""
        for w, codes, scale, zero, saved_scale, saved_zero in zip(
            self.weights, self.codes, self.scale, self.zero, state["scale"], state["zero"]
        ):
            scale.copy_(saved_scale)
            zero.copy_(saved_zero)
            step = torch.where(scale == 0, 1.0, scale)[..., None]
            codes.copy_((w.view(codes.shape) - zero[..., None]).div_(step).round_().clamp_(-8, 7))
        self.merge()


def average_gradients(params: list[Tensor]) -> None:
    """Under DDP (a process group of several workers), ``params``' gradients averaged over the workers."""
    if torch.distributed.is_initialized() and (world := torch.distributed.get_world_size()) > 1:
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world


def freeze_all_but_head(model: PreTrainedModel) -> int:
    """Only the output layer of ``model`` trains (``distill.train=head``; a head tied to the input embeddings trains
    them too). Returns the count of weights that train."""
    head = {id(p) for p in model.get_output_embeddings().parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in head)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class Learner:
    """The draft being trained, its optimizer and schedule, and its objective (default: the recipe's divergence
    to ``target``, Eq. 2).

    ``model`` is what the forward pass runs through when it is not the draft itself (a DDP wrapper of it in Ray
    Train); ``objective`` replaces the distillation loss (the garden trains its models from data with it);
    ``bf16`` runs the forward pass under bfloat16 autocast (the weights stay float32); None: ``cfg.bf16``.
    """

    def __init__(
        self,
        draft: PreTrainedModel,
        target: PreTrainedModel | None,
        cfg: DistillConfig,
        *,
        model: torch.nn.Module | None = None,
        objective: Objective | None = None,
        bf16: bool | None = None,
        max_grad_norm: float = 1.0,
    ) -> None:
        self.draft, self.target, self.cfg = draft, target, cfg
        self.model = draft if model is None else model
        self.recipe = resolve_recipe(cfg)
        self.objective = objective or self.kd_objective
        self.bf16, self.max_grad_norm = bool(cfg.bf16) if bf16 is None else bf16, max_grad_norm
        #: the weights that train where the draft's own do not (``distill.train=lora:R`` or ``scales``)
        self.adapter: LoRA | GridScales | None = None
        if cfg.train.startswith("lora:"):
            self.adapter = LoRA(draft, int(cfg.train.removeprefix("lora:")))
        elif cfg.train == "scales":
            self.adapter = GridScales(draft)
        elif cfg.train == "head":
            freeze_all_but_head(draft)
        elif cfg.train != "all":
            freeze_all_but_layers(draft, int(cfg.train.removeprefix("top:")) if cfg.train.startswith("top:") else None)
        params = None if self.adapter is None else self.adapter.params
        self.optimizer, self.scheduler = make_optimizer(draft, cfg.lr, cfg.steps, cfg.warmup_steps, params)
        self.step_count = 0
        if target is not None:
            target.eval()
            for p in target.parameters():
                p.requires_grad_(False)

    def kd_objective(self, model: torch.nn.Module, batch: Batch, target_logits: Tensor | TopKLogprobs | None) -> Tensor:
        """D(p || q_theta) of the recipe's divergence over the continuation (the target scores the batch here
        unless its logits came with it)."""
        if self.target is None and target_logits is None:
            raise DistillSpecError("a batch came without the target's scores to a learner that holds no target")
        return kd_loss(
            model,
            self.target,
            batch,
            self.recipe,
            temperature=self.cfg.temperature,
            beta=self.cfg.beta,
            target_logits=target_logits,
        )

    def step(
        self,
        batch: Batch,
        *,
        target_logits: Tensor | TopKLogprobs | None = None,
        source: str = "fixed",
        version: int | None = None,
        current: int | None = None,
        wait_s: float = 0.0,
        start: float | None = None,
    ) -> dict[str, Any]:
        """One optimizer step on ``batch``: loss, backward, clip, optimizer and scheduler step. Returns the record
        (:data:`LOG_KEYS`); ``version`` is the draft version that sampled the batch and ``current`` the version
        this step starts from (both default to the step count: the versions of a run that never restarted), their
        difference the batch's lag; ``start`` is the ``time.perf_counter()`` the record's ``time`` counts from."""
        t0 = time.perf_counter()
        device = self.draft.device
        batch = batch.to(device)
        target_logits = None if target_logits is None else target_logits.to(device)
        self.model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.objective(self.model, batch, target_logits)
        loss.backward()
        if self.adapter is not None:
            self.adapter.gradients()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.adapter is not None:
            self.adapter.merge()
        self.model.eval()
        current = self.step_count if current is None else current
        version = current if version is None else version
        self.step_count += 1
        now = time.perf_counter()
        return {
            "step": self.step_count,
            "source": source,
            "loss": loss.item(),
            "tokens": batch.tokens,
            "lr": self.scheduler.get_last_lr()[0],
            "version": version,
            "lag": current - version,
            "time": now - (t0 if start is None else start),
            "wait_s": wait_s,
            "compute_s": now - t0,
        }

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, step and the adapter's weights (the draft's weights are saved apart, in
        ``save_pretrained`` format)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step_count,
            **({self.adapter.name: self.adapter.state_dict()} if self.adapter is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.adapter is not None:
            self.adapter.load_state_dict(state[self.adapter.name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = state["step"]


LOG_FILE = "train_log.jsonl"  #: a run's training records as they are made, in its output folder


def save_checkpoint(
    folder: str | Path,
    learner: Learner,
    tokenizer: PreTrainedTokenizerBase,
    log: RecordLog,
    *,
    seconds: float,
    extra: dict[str, Any] | None = None,
) -> Path:
    """The checkpoint format: ``draft/`` (``save_pretrained``, with the tokenizer), ``state.pt`` (the learner's
    state and the seconds trained), ``step.json`` (the step, and how many records of the run's ``log`` it covers),
    and one JSON file per ``extra`` entry. Written whole or not at all (:func:`~distillspec.files.write_folder`): a
    crash leaves the previous checkpoint."""

    def fill(tmp: Path) -> None:
        learner.draft.save_pretrained(tmp / "draft")
        tokenizer.save_pretrained(tmp / "draft")
        torch.save({**learner.state_dict(), "seconds": seconds}, tmp / "state.pt")
        (tmp / "step.json").write_text(json.dumps({"step": learner.step_count, "log_records": len(log)}))
        for name, value in (extra or {}).items():
            (tmp / f"{name}.json").write_text(json.dumps(value))

    return write_folder(folder, fill)


def checkpoint_log(folder: str | Path, log_path: str | Path) -> RecordLog:
    """The run's records as of the checkpoint in ``folder`` (those the run appended after it are cut off)."""
    folder = Path(folder)
    saved = json.loads((folder / "step.json").read_text())
    if "log_records" in saved:
        return RecordLog(log_path, saved["log_records"])
    log = RecordLog(log_path)  # a checkpoint that holds its records itself (train_log.json)
    for record in json.loads((folder / "train_log.json").read_text()):
        log.append(record)
    return log


def load_checkpoint(folder: str | Path, learner: Learner) -> float:
    """Restore ``learner`` (draft weights, optimizer, scheduler, step) from :func:`save_checkpoint`'s folder;
    returns the seconds trained (the run's log as of that checkpoint: :func:`checkpoint_log`)."""
    folder = Path(folder)
    saved, _ = load_model(str(folder / "draft"), device=str(learner.draft.device))
    learner.draft.load_state_dict(saved.state_dict())
    state = torch.load(folder / "state.pt", weights_only=True)
    learner.load_state_dict(state)
    return state["seconds"]


class Distiller:
    """Algorithm A.2 in one process: each ``step()`` samples a batch (:class:`~distillspec.training.rollout.Sampler`),
    then the :class:`Learner` updates the draft on it."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        train: list[Example],
        cfg: DistillConfig,
        **kw: Any,
    ) -> None:
        """The arguments of :class:`~distillspec.training.rollout.Sampler` (``train``: the prompts)."""
        self.sampler = Sampler(target, draft, tokenizer, train, cfg, **kw)
        self.learner = Learner(draft, target, cfg)
        self.target, self.draft, self.cfg, self.recipe = target, draft, cfg, self.learner.recipe
        self.start = time.perf_counter()

    @property
    def step_count(self) -> int:
        return self.learner.step_count

    def step(self) -> dict[str, Any]:
        """Sample a batch, update on it; returns the learner's record (``wait_s``: the sampling)."""
        t0 = time.perf_counter()
        source, batch = self.sampler()
        return self.learner.step(batch, source=source, wait_s=time.perf_counter() - t0, start=self.start)

    def run(self, steps: int | None = None, callback: Callable[[dict], None] | None = None) -> list[dict]:
        records = []
        for _ in range(self.cfg.steps if steps is None else steps):
            records.append(self.step())
            if callback is not None:
                callback(records[-1])
        return records
