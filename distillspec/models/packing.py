"""The frozen target's linear weights laid out once for a CPU's kernels, so that verifying ``gamma + 1`` positions
costs about one decoding step; and int8 weights (4-bit ones for its steps) for a draft that only proposes.

At batch 1 a decoding step is bound by reading the weights, so a few more rows (the positions a verification
scores) should cost little. In float32 on a CPU they do not: an eager ``Linear`` of 2-8 rows costs 1.5-2.5x the
one-row product, because the GEMM re-lays the whole weight out on every call. A :class:`PackedLinear` holds its
weight in the blocked layout oneDNN computes from (``torch.ops.mkldnn._reorder_linear_weight``, as inductor's
freezing pass does), laid out once when the model is loaded; 1-8 rows then cost 1.0-1.6x one row. On an x86 CPU with
AVX2 it holds the layout of the few-row kernel (:mod:`distillspec.models.few_rows`) instead, which keeps the rows'
inputs in cache while the weight streams past: faster at every row count of a step or a verification; with
``prepack=bfloat16`` it holds the weights rounded to bfloat16, which the kernel widens in registers. On CPUs that
compute bfloat16 natively the pair runs in bfloat16 instead (``dtype=auto``), whose products are flat in the rows
but read the weights below the memory's rate: such a target's weights go to the few-row kernel too, its rows
multiplied in bfloat16 (AVX512-BF16). Where that kernel cannot be had, on a CPU with AMX oneDNN's bfloat16 product of
a few rows reads its weight at half the rate of the same product as matrix-vector ones, which a
:class:`FewRowLinear` runs instead.

Only a frozen model is laid out (the target: it scores and verifies, never trains). A packed model drops its dense
weights, so it takes no more memory than the plain one, has no gradients and cannot be saved; a few-row one keeps
them.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Container

import torch
from torch import Tensor, nn

from distillspec.errors import DistillSpecError
from distillspec.models import few_rows
from distillspec.models.draft_vocab import DraftHead


def can_prepack(device: str | torch.device = "cpu") -> bool:
    """Whether this build of torch can prepack weights for ``device`` (a CPU with oneDNN)."""
    return torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()


def int8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """A float32 ``weight`` [out, in] as int8 codes with one scale per output row (its largest magnitude at 127):
    ``codes * scales[:, None]`` is about the weight."""
    scales = weight.abs().amax(1).clamp(min=1e-12) / 127
    return (weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8), scales


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is laid out once for a CPU's few-row products; ``forward`` takes
    any leading shape. The layout is the few-row kernel's (:mod:`distillspec.models.few_rows`: AVX2, its inputs a
    multiple of 8) where that kernel runs and ``kernel`` allows it, else the blocked one oneDNN computes from
    (``rows`` is the row count oneDNN's layout is tuned for; any count is computed correctly).

    ``kernel``: ``"auto"`` (the few-row kernel where it runs), ``"few_rows"`` (an error where it does not),
    ``"onednn"``. A bfloat16 weight, or ``weights=torch.bfloat16`` (a float32 weight rounded to it: half the bytes a
    product reads), takes the few-row kernel, which widens it to float32 in registers, the rows and sums float32; a
    bfloat16 model's rows go in as they are where the CPU has AVX512-BF16 (:func:`~distillspec.models.few_rows.
    bf16_rows`), multiplied in pairs into float32 sums. ``weights=torch.int8`` rounds a float32 or bfloat16 weight to
    int8 with a scale per output row (:func:`int8_rows`, as :class:`Int8Linear`'s), for the kernel's int8 products (the
    rows rounded to 16 bits, a scale each): a quarter of float32's bytes, half of bfloat16's, its products a little
    further from the weight's (``prepack=int4-int8``). The output is in the model's dtype. ``packed``: the weight in
    the few-row kernel's layout already (:func:`few_rows_layouts`: shared by another process)."""

    def __init__(
        self,
        linear: nn.Linear,
        rows: int = 8,
        kernel: str = "auto",
        weights: torch.dtype | None = None,
        packed: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.dtype = linear.weight.dtype  #: the model's: its activations in and out
        weight = linear.weight.detach()
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError(
                f"PackedLinear takes float32 or bfloat16 CPU weights, not {weight.dtype} on {weight.device}"
            )
        self.scales = None  #: an int8 weight's scale per output row (float32), which its products take
        if weights == torch.int8:
            weight, self.scales = int8_rows(weight.float())
        elif weights is not None:
            weight = weight.to(weights)
        if kernel not in ("auto", "few_rows", "onednn"):
            raise ValueError(f"kernel is auto, few_rows or onednn, not {kernel!r}")
        if weight.dtype in (torch.bfloat16, torch.int8) and kernel != "few_rows":
            raise ValueError(
                f"PackedLinear takes {weight.dtype} weights for the few-row kernel only (kernel='few_rows')"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # why the few-row kernel cannot take this layer (where it is wanted)
        why = few_rows.refusal(self.in_features, weight.dtype) if kernel != "onednn" else None
        if kernel == "few_rows" and why:
            raise DistillSpecError(f"the few-row kernel does not run here: {why}")
        self.kernel = "onednn" if kernel == "onednn" or why else "few_rows"
        #: a bfloat16 model's rows go to the kernel as they are (AVX512-BF16), else as float32
        self.bf16_rows = (
            self.dtype == weight.dtype == torch.bfloat16 and self.kernel == "few_rows" and few_rows.bf16_rows()
        )
        if packed is not None:  # laid out already, by another process that shares it (few-row kernel only)
            size = -(-self.out_features // 64) * 64 * self.in_features  # the rows padded to blocks of 64
            if self.kernel != "few_rows" or packed.dtype != weight.dtype or packed.numel() != size:
                raise ValueError(f"a {packed.dtype} layout of {packed.numel()} is not this weight's few-row layout")
            self.packed = packed
        elif self.kernel == "few_rows":
            self.packed = few_rows.pack(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if self.kernel == "few_rows":
            out = self._few_rows(rows)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def step_forward(self, x: Tensor) -> Tensor:
        """``forward`` of a decoding step's rows ``x`` [B, k, in] (contiguous) as the lean decoder's eager steps call
        it (:mod:`distillspec.decoding.kvcache`): the kernel's product without the module call and ``forward``'s other
        cases."""
        if self.kernel != "few_rows":
            return self.forward(x)
        return self._few_rows(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def step_product(self) -> tuple[object, int] | None:
        """:meth:`step_forward`'s product as the kernel's own step of a model's layers takes it
        (:func:`~distillspec.models.few_rows.step_product`), and the most rows it takes; None where the kernel does
        not take it."""
        if self.kernel != "few_rows":
            return None
        product = few_rows.step_product(
            self.packed,
            self.out_features,
            self.scales,
            self.bias,
            float_rows=not self.bf16_rows,
            bias_in_float=True,
            dtype=self.dtype,
        )
        return product, sys.maxsize

    def _few_rows(self, rows: Tensor) -> Tensor:
        """``rows`` [M, in] (contiguous) times the weight through the few-row kernel, in the model's dtype: float32
        sums; float32 rows but a bfloat16 model's where the CPU takes them (as :meth:`step_product` does)."""
        out = few_rows.matmul(rows if self.bf16_rows else rows.float(), self.packed, self.out_features, self.scales)
        if self.bias is not None:
            out += self.bias
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        rounded = (
            f", its weight in {str(self.packed.dtype).removeprefix('torch.')}"
            if self.packed.dtype != self.dtype
            else ""
        )
        rounded += " (a scale per output row)" if self.scales is not None else ""
        return f"{shape}, packed for {'the few-row kernel' if self.kernel == 'few_rows' else 'oneDNN'}{rounded}"


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> int:
    """Freeze ``model`` (eval mode, no gradients) and replace each of its linear layers (in place) by ``make(layer)``
    where that is not None. Returns how many were replaced."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Linear, DraftHead) and (new := make(child)) is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced


#: Up to this many rows (a decoding step, a verification of ``gamma + 1`` positions, the steps of a few sequences) a
#: :class:`FewRowLinear` multiplies its weight by the rows as columns; more (a prompt) go through ``F.linear``.
FEW_ROWS = 16


class FewRowLinear(nn.Module):
    """A frozen bfloat16 ``nn.Linear`` whose products of up to :data:`FEW_ROWS` rows run as ``W @ x``:
    ``torch.mv`` for one row, ``torch.mm(W, xᵀ)ᵀ`` for more. On a CPU with AMX, oneDNN's bfloat16 product of one row
    (``F.linear``) read the 1.5B Qwen target's weights at 4-13 GB/s and these forms at 10-17 GB/s (the 151,936-row
    head: 91 ms against 42 ms; a six-row product of its MLP's down projection: 6.5 ms against 2.3 ms). The prompt's
    logits are the same to the bit; a step's differ within bfloat16's rounding. It holds the same weight tensors
    (shared ones stay shared)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > FEW_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if rows.shape[0] == 1:
            out = torch.mv(self.weight, rows[0])[None]
        else:
            out = torch.mm(self.weight, rows.t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{shape}, few rows as matrix-vector products"


def layout_name(dtype: str, prepack: bool | str = True) -> str:
    """What :func:`prepack_linears` does to a target in ``dtype`` (``"float32"``, ``"bfloat16"``) as ``prepack``
    (resolved) says, for a console."""
    if prepack == "bfloat16":
        return "weights rounded to bfloat16 for the few-row kernel"
    if prepack == "int4":
        rest = layout_name(dtype, "bfloat16" if dtype == "float32" else True)
        six = ", on 6-bit grids in 6 bits" if dtype == "float32" else ""
        return f"layers on 4-bit grids in 4 bits{six} for the few-row kernel, the rest's {rest}"
    if prepack == "int4-int8":
        return (
            "layers on 4-bit grids in 4 bits for the few-row kernel, the rest's weights in int8 (a scale per output "
            "row) for the few-row kernel"
        )
    if dtype != "float32":
        return (
            "weights laid out for the few-row kernel"
            if few_rows.bf16_rows()
            else "few-row products as matrix-vector ones"
        )
    return "weights laid out for the few-row kernel" if few_rows.available() else "weights prepacked for oneDNN"


def prepack_linears(
    model: nn.Module,
    rows: int = 8,
    kernel: str = "auto",
    weights: torch.dtype | None = None,
    packed: dict[str, Tensor] | None = None,
) -> int:
    """Lay out every linear layer of ``model`` on a CPU (in place) for few-row products: a float32 one becomes a
    :class:`PackedLinear` (``kernel`` and ``weights`` as there: ``torch.bfloat16`` rounds its weight where the
    few-row kernel takes the layer; ``torch.int8`` rounds a float32 or bfloat16 one to int8 there), a bfloat16 one
    a :class:`PackedLinear` for the few-row kernel where it takes bfloat16 rows (AVX512-BF16; inputs a multiple of 8)
    and ``kernel`` is not ``"onednn"`` (a target that only scores batches of many rows), else a
    :class:`FewRowLinear`, whose products of more rows are oneDNN's; the model is frozen. ``packed``: layers' weights
    laid out already (:func:`few_rows_layouts`), by module name. Returns how many were laid out."""
    names = {id(module): name for name, module in model.named_modules()}
    packed = packed or {}

    def pack(linear: nn.Linear) -> nn.Module | None:
        if type(linear) is not nn.Linear or linear.weight.device.type != "cpu":
            return None
        if weights == torch.int8 and not few_rows.refusal(linear.in_features, torch.int8):
            return PackedLinear(linear, rows, "few_rows", torch.int8)
        if linear.weight.dtype == torch.float32:
            if weights is not None and not few_rows.refusal(linear.in_features, weights):
                return PackedLinear(linear, rows, "few_rows", weights)
            return PackedLinear(linear, rows, kernel)
        if linear.weight.dtype != torch.bfloat16:
            return None
        if bf16_few_rows(linear, kernel):
            return PackedLinear(linear, rows, "few_rows", packed=packed.get(names[id(linear)]))
        return FewRowLinear(linear)

    return replace_linears(model, pack)


def bf16_few_rows(linear: nn.Linear, kernel: str = "auto") -> bool:
    """Whether :func:`prepack_linears` lays a bfloat16 ``linear`` out for the few-row kernel (with ``kernel``)."""
    return kernel != "onednn" and few_rows.bf16_rows() and not few_rows.refusal(linear.in_features, torch.bfloat16)


def few_rows_layouts(model: nn.Module, but: Container[str] = ()) -> dict[str, Tensor]:
    """The few-row kernel's layout of each bfloat16 linear weight of ``model`` that :func:`prepack_linears` lays out for
    it, by module name, but for the modules named in ``but`` (those held in 4 or 6 bits: :func:`grid_layouts`): what a
    process that shares the model shares with it (the layout is as large as the weight), so that the processes that
    decode with it do not each lay out their own."""
    return {
        name: few_rows.pack(module.weight.detach())
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and name not in but
        and module.weight.dtype == torch.bfloat16
        and bf16_few_rows(module)
    }


#: Up to this many rows a weight-only :class:`Int8Linear` multiplies by its int8 weight directly (a decoding step);
#: more rows (a prompt) are multiplied by the int8 values as floats, the row scales applied to the product: the
#: weight-only kernel does not use the CPU's matrix units (for a 150-token prompt it ran 5x slower than dequantizing
#: first: 4864 x 896, bfloat16, AMX).
#: fbgemm's GEMM is a matrix kernel: it takes every row count.
INT8_ROWS = 16


#: Up to this many rows an :class:`Int8Linear` with int4 steps multiplies by its 4-bit weights (a drafting step, a few
#: streams' steps): the kernel reads half the int8 bytes but unpacks them without the CPU's matrix units, so its cost
#: grows with the rows (the 0.5B Qwen draft's step, AMX: 41 / 51 / 68 / 115 ms at 1 / 2 / 4 / 6 rows, fbgemm's
#: 57 / 76 / 77 / 89; docs/MEASUREMENTS.md); more rows (a prompt) take the int8 path.
INT4_ROWS = 4
#: ... and up to this many through the few-row kernel's 4-bit products (:func:`~distillspec.models.few_rows.int4`),
#: which read the weight once for every 4 rows (8 at AVX2): the 0.5B Qwen draft's step at 6 / 8 / 12 / 16 rows took
#: 20.0 / 23.8 / 30.1 / 38.2 ms against fbgemm's 25.9 / 28.0 / 31.8 / 36.5 (AMD EPYC, AVX512-VNNI)
INT4_FEW_ROWS = 12
#: Weights per 4-bit group (each group has its own scale and zero point): the granularity of llama.cpp's Q4_K blocks.
INT4_GROUP = 32


def int4_available() -> bool:
    """Whether this build of torch has the CPU kernel for 4-bit weights in groups (``_weight_int4pack_mm_for_cpu``)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@torch.no_grad()
def int4_groups(weight: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor]:
    """``weight`` [out, in] as 4-bit codes [out, in] (int32, 0-15) and ``scales_zeros`` [in / group, out, 2], as
    torch's int4 kernels take them: each group of ``group`` inputs of a row spans its min to max in 16 levels,
    ``(code - 8) * scale + zero``. (Shrinking a group's range to clip outliers, searched for the least squared error,
    changed no draft distribution of the GGUF-born 0.5B Qwen, whose file holds most layers in 5 bits and its head in
    8, which this rounds anew.)"""
    rows, cols = weight.shape
    if cols % group:
        raise ValueError(f"int4 groups of {group} do not divide {cols} inputs")
    if rows > 4096:  # a head: a chunk of rows at a time, to bound the float copies
        parts = [int4_groups(chunk, group) for chunk in weight.split(4096)]
        return torch.cat([codes for codes, _ in parts]), torch.cat([sz for _, sz in parts], 1)
    w = weight.float().reshape(rows, cols // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-10)
    codes = ((w - low) / scale).round().clamp(0, 15)
    scales_zeros = torch.cat([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    return codes.reshape(rows, cols).to(torch.int32), scales_zeros


#: How far a weight may lie from its group's grid (in the grid's steps) and count as on it: a 4-bit GGUF's layers,
#: dequantized to float32, lie on theirs to float32's rounding (about 1e-6 of a step).
GRID_TOLERANCE = 1e-3


@torch.no_grad()
def int4_grid(weight: Tensor, group: int = INT4_GROUP) -> tuple[Tensor, Tensor] | None:
    """``weight`` [out, in] as 4-bit codes and ``scales_zeros`` (as :func:`int4_groups` gives them) that hold it as it
    is, where each group of ``group`` inputs of a row lies on a grid of at most 16 evenly spaced levels: the layers
    of a 4-bit GGUF (Q4_0, Q4_1, Q4_K: codes 0-15 in groups of 32, each group with its own scale and offset),
    dequantized to float. Each group's grid is the one its values give (from its least value, in steps of its span
    over 15, 14, ... levels), so the codes are the file's up to a shift; only the scales and zero points are rounded
    where a kernel takes them in bfloat16. None where a group lies on no such grid (any other layer: a float one,
    a 6- or 8-bit one); a layer's first rows are checked first, so most such layers cost little."""
    rows, cols = weight.shape
    if cols % group or rows == 0:
        return None
    head = min(rows, 64)
    if rows > head and _grid(weight[:head], group) is None:
        return None
    parts = [_grid(chunk, group) for chunk in weight.split(4096)]  # bounds the float copies (a head's rows)
    if any(part is None for part in parts):
        return None
    return torch.cat([codes for codes, _ in parts]), torch.cat([sz for _, sz in parts], 1)


def _grid(weight: Tensor, group: int) -> tuple[Tensor, Tensor] | None:
    """:func:`int4_grid` of a chunk of rows: every group tried on 16 levels in one pass, in place (most groups of a
    4-bit layer span all 16), the rest on fewer."""
    rows, cols = weight.shape
    w = weight.float().reshape(-1, group)  # [groups, group]
    low = w.amin(-1, keepdim=True)
    span = w.amax(-1, keepdim=True) - low
    step = span / 15
    rel = w.sub(low).div_(step.clamp(min=torch.finfo(torch.float32).tiny))  # a group of one value: all zero
    codes = rel.round()
    left = (rel.sub_(codes).abs_().amax(-1) >= GRID_TOLERANCE).nonzero().squeeze(-1)
    del rel
    for levels in range(14, 0, -1):
        if len(left) == 0:
            break
        trial = span[left] / levels
        rel = (w[left] - low[left]) / trial
        rounded = rel.round()
        on = (rel - rounded).abs().amax(-1) < GRID_TOLERANCE
        step[left[on]], codes[left[on]] = trial[on], rounded[on]
        left = left[~on]
    if len(left):
        return None
    step = torch.where(step > 0, step, torch.ones_like(step))
    codes = codes.clamp_(0, 15).to(torch.int32).reshape(rows, cols)
    scales_zeros = torch.cat([step, low + 8 * step], -1).reshape(rows, cols // group, 2).transpose(0, 1)
    return codes, scales_zeros.contiguous()


#: Weights per step of a 6-bit grid (:func:`int6_grid`): the granularity of llama.cpp's Q6_K scales.
INT6_GROUP = 16


@torch.no_grad()
def int6_grid(weight: Tensor) -> tuple[Tensor, Tensor] | None:
    """``weight`` [out, in] as 6-bit codes [out, in] (uint8, 0-63) and ``steps`` [out, in / 16] (float32) that hold it
    as it is, ``(code - 32) * step``, where each group of 16 inputs of a row lies on such a grid: the 6-bit layers of a
    GGUF (Q6_K: codes -32 to 31 in groups of 16, each group's step the block's scale times its own 8-bit one, of
    either sign), dequantized to float, whose steps float32 holds exactly. Each group's step is its largest magnitude
    over the most levels (32, 31, ... 1) that put every value of the group on the grid (within
    :data:`GRID_TOLERANCE` of a step). None where a group lies on no such grid (a float layer, a 4- or 8-bit one) or
    the inputs are not whole groups of 32 (as the kernel rounds its rows). Found by the few-row kernel's module (its
    6-bit products are where such a layout is used), in parallel, stopping at the first group off its grid."""
    return few_rows.extension().int6_grid(weight.float(), GRID_TOLERANCE)


class Int4Linear(nn.Module):
    """A frozen target's linear layer whose weight lies on 4-bit grids (:func:`int4_grid`: a 4-bit GGUF's layers), held
    as those codes in the few-row kernel's layout (:func:`~distillspec.models.few_rows.pack_int4`; ``packed``,
    :meth:`layout`): a step reads about 0.31 of the bfloat16 weight's bytes, and every product (steps, verifications,
    prompts) goes through the kernel's 4-bit products, the rows rounded to 16 bits with a scale each through AVX512-VNNI
    and to 8 bits with a scale for each group of 32 inputs at AVX2, the sums float32. ``dtype`` (float32 or bfloat16,
    the model's) is its activations' in and out; the bias goes into the float32 sums before they are rounded to it, as
    :class:`PackedLinear`'s does. Built with ``prepack=int4`` (``auto`` where the kernel runs:
    :func:`~distillspec.models.loading.resolve_prepack`). The 1.5B Qwen target of a Q4_K_M GGUF holds 168 of its 197
    linear layers so, 1,111M weights (the file's 6-bit layers, the head among them, are :class:`Int6Linear` layers in a
    float32 target, else in the dtype): its next-token distributions (16-bit rows) were a mean TVD of 0.0012 from the
    file's model in float32 (0.0091 in bfloat16, where bfloat16 weights gave 0.0081), and its cached step took 0.41x the
    float32 few-row target's and 0.55x the bfloat16 one's on a 2-core AMD EPYC (docs/MEASUREMENTS.md)."""

    def __init__(self, linear: nn.Linear, packed: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = dtype  #: the model's
        self.register_buffer("packed", packed)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()
        self.register_buffer("bias", bias)

    @staticmethod
    def layout(linear: nn.Linear, weight: Tensor | None = None) -> Tensor | None:
        """``linear``'s weight as its file holds it (``weight``, float32: the file's values; default its own) in the
        kernel's 4-bit layout where it lies on 4-bit grids and the kernel takes its shape (outputs a multiple of
        16), else None."""
        if linear.out_features % 16 or linear.weight.device.type != "cpu":
            return None
        grid = int4_grid(linear.weight if weight is None else weight)
        return None if grid is None else few_rows.pack_int4(grid[0], grid[1].to(torch.bfloat16))

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = few_rows.matmul(rows, self.packed, self.out_features)
        if self.bias is not None:
            out += self.bias
        return out.to(self.dtype).reshape(*x.shape[:-1], self.out_features)

    step_forward = forward  #: a decoding step's rows, as the lean decoder's eager steps call them

    def step_product(self) -> tuple[object, int]:
        """:meth:`forward`'s product as the kernel's own step of a model's layers takes it
        (:func:`~distillspec.models.few_rows.step_product`), and the most rows it takes (any number)."""
        product = few_rows.step_product(
            self.packed, self.out_features, None, self.bias, float_rows=True, bias_in_float=True, dtype=self.dtype
        )
        return product, sys.maxsize

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{shape}, 4-bit codes in groups of {INT4_GROUP} for the few-row kernel"


class Int6Linear(Int4Linear):
    """A frozen target's linear layer whose weight lies on 6-bit grids (:func:`int6_grid`: a GGUF's Q6_K layers, the
    head of a Q4_K_M file among them), held as those codes, a byte each, and their steps (float32, exact) in the
    few-row kernel's layout (:func:`~distillspec.models.few_rows.pack_int6`; ``packed``, :meth:`layout`): a step reads
    0.625 of the bfloat16 weight's bytes, and every product goes through the kernel's 6-bit products (AVX2), the rows
    rounded to 8 bits with a scale for each group of 32 inputs, the sums float32; in and out as :class:`Int4Linear`'s.
    Built with ``prepack=int4`` for a float32 target (:func:`~distillspec.models.loading.load_model`), where the
    layers of its file that lie on no 4-bit grid would otherwise be rounded to bfloat16 and widened in registers."""

    @staticmethod
    def layout(linear: nn.Linear, weight: Tensor | None = None) -> Tensor | None:
        """``linear``'s weight as its file holds it (``weight``, float32: the file's values; default its own) in the
        kernel's 6-bit layout where it lies on 6-bit grids, else None."""
        if linear.weight.device.type != "cpu":
            return None
        grid = int6_grid(linear.weight if weight is None else weight)
        return None if grid is None else few_rows.pack_int6(*grid)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{shape}, 6-bit codes, a step for each {INT6_GROUP} inputs, for the few-row kernel"


def grid_layouts(
    model: nn.Module, weights: Callable[[str], Tensor | None] | None = None, six_bits: bool = False
) -> dict[str, Tensor]:
    """:meth:`Int4Linear.layout` of each linear layer of ``model`` that lies on 4-bit grids, by module name, found on
    the weights its files hold (``weights``: a parameter's name -> its float32 values, or None: the model's own, as
    a float32 model holds them), one layer at a time; with ``six_bits``, :meth:`Int6Linear.layout` of each that lies
    on 6-bit grids instead."""
    layouts = {}
    kinds = (Int4Linear, Int6Linear) if six_bits else (Int4Linear,)
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            weight = weights(f"{name}.weight") if weights is not None else None
            for kind in kinds:
                if (layout := kind.layout(module, weight)) is not None:
                    layouts[name] = layout
                    break
    return layouts


def grid_linears(model: nn.Module, dtype: torch.dtype, layouts: dict[str, Tensor]) -> int:
    """Replace each linear layer of ``model`` (in place) that ``layouts`` holds (:func:`grid_layouts`, by module name,
    found here or shared by another process) by an :class:`Int4Linear` or an :class:`Int6Linear` in ``dtype``, as its
    layout's shape says (a 6-bit one's has two dimensions); the others stay as they are, for :func:`prepack_linears`.
    Returns how many were replaced (the model is frozen)."""
    names = {id(module): name for name, module in model.named_modules()}

    def make(linear: nn.Linear) -> Int4Linear | None:
        layout = layouts.get(names[id(linear)])
        if layout is None:
            return None
        return (Int6Linear if layout.dim() == 2 else Int4Linear)(linear, layout, dtype)

    return replace_linears(model, make)


def fbgemm_available() -> bool:
    """Whether this build of torch has fbgemm's int8 GEMM (x86 CPUs), which :class:`Int8Linear` can run through."""
    return any(engine in torch.backends.quantized.supported_engines for engine in ("x86", "fbgemm"))


class Int8Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is held as int8 with one scale per output row, for a draft that only
    proposes: speculative decoding stays exact whatever the draft computes; a draft rounded this way is accepted
    about as often as before. A step reads a quarter of float32's bytes, half of bfloat16's.

    The product is weight-only, as gpt-fast's int8 mode. On an x86 CPU with AVX2 its steps (up to :data:`INT8_ROWS`
    rows) go through the few-row kernel (:mod:`distillspec.models.few_rows`; inputs a multiple of 32; AVX512-VNNI
    where the CPU has it), which rounds each row of activations to 16 bits, not 8, and reads the int8 weight at about
    the memory's rate: the 0.5B Qwen draft's step took 0.82x fbgemm's on a Zen 3 CPU (docs/MEASUREMENTS.md).
    Elsewhere they go through ``torch.ops.aten._weight_int8pack_mm``, its activations in bfloat16 where the model runs
    in float32 on a CPU: that kernel has no fast float32 path (on an AVX2-only CPU it ran 1.7-3.7x slower than the
    float32 product it replaces, and 1.8-3.6x faster with bfloat16 activations, which moved the 0.5B Qwen draft's
    distribution by a mean TVD of 0.012: ``python -m benchmarks.suites.int8``). More than :data:`INT8_ROWS` rows (a
    prompt) go through fbgemm where it is held (``weight_only_steps``, below), else are multiplied by the int8 values
    as floats, then the row scales, the weight-only kernels not using the CPU's matrix units.

    ``fbgemm=True`` runs every product through fbgemm's int8 GEMM instead (``quantized::linear_dynamic``, x86; the
    ``draft_int8=fbgemm`` setting): on such a CPU its products ran 2-3x faster again, the 0.5B draft's step 1.5x and
    its prompt 2.0x, but it rounds the activations to 7 bits. The GEMM takes one scale per call, so each row is
    divided by its largest magnitude first (and the product multiplied back): in effect one scale per token. With one
    scale spanning a prompt, whose first token takes the outlying activations of Qwen2.5-like models (the attention
    sink), the 0.5B Qwen draft's mean TVD from the float draft was 0.073; with a scale per token 0.038. With
    ``weight_only_steps`` as well (``draft_int8=true`` on a CPU with fbgemm) only the prompts go through fbgemm (the
    0.5B Qwen draft read one 2.5x faster than through the dequantized weight), and the steps stay weight-only.

    ``int4=True`` (``draft_int8=int4``) also holds the weight in 4 bits, each group of :data:`INT4_GROUP` inputs with
    its own scale and zero point (:func:`int4_groups`): a step reads half the int8 bytes. Where the few-row kernel takes
    them (:func:`~distillspec.models.few_rows.int4`: wherever it runs) up to :data:`INT4_FEW_ROWS` rows
    (drafting steps) go through its 4-bit products
    (:func:`~distillspec.models.few_rows.int4`; the rows rounded to 16 bits through AVX512-VNNI, to 8 bits a group of
    32 inputs at AVX2), elsewhere up to :data:`INT4_ROWS` through
    torch's CPU kernel (``_weight_int4pack_mm_for_cpu``; a float32 model's activations in bfloat16, as the weight-only
    kernel's: in float32 the 0.5B Qwen draft's step took 1,031 ms against fbgemm's 69). More rows (a prompt) take the
    int8 path above. With fbgemm beside it, the 0.5B Qwen draft's step
    took 51 ms against fbgemm's 76 (AMX), its mean TVD from the bfloat16 draft 0.061 against 0.039; where torch's
    kernels run at AVX2 it took 1.3x fbgemm's."""

    def __init__(
        self, linear: nn.Linear, fbgemm: bool = False, int4: bool = False, weight_only_steps: bool = False
    ) -> None:
        super().__init__()
        if int4 and not (int4_available() and linear.weight.device.type == "cpu"):
            raise DistillSpecError("draft_int8=int4 runs torch's CPU kernel for 4-bit weights: use draft_int8=fbgemm")
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype  #: the model's dtype: its activations, the scales and bias
        cpu_float32 = self.dtype == torch.float32 and weight.device.type == "cpu"
        self.step_dtype = torch.bfloat16 if cpu_float32 else self.dtype  #: the int8 kernel's activations
        self.fbgemm = fbgemm
        self.packed = None  #: fbgemm's packed weight, with ``fbgemm``
        #: int4 steps; a layer whose inputs are not whole groups, or whose outputs the kernel's tiles of 16 do not
        #: divide, keeps int8 ones
        self.int4 = int4 and self.in_features % INT4_GROUP == 0 and self.out_features % 16 == 0
        self.int4_packed = self.int4_scales_zeros = None  #: the 4-bit weight and its groups' scales, with ``int4``
        #: ... multiplied by the few-row kernel, its scales in its layout (where it takes them; bfloat16 or float32)
        self.int4_few_rows = self.int4 and self.step_dtype == torch.bfloat16 and few_rows.int4()
        self.int4_rows = INT4_FEW_ROWS if self.int4_few_rows else INT4_ROWS  #: the most rows its 4-bit steps take
        #: steps (up to INT8_ROWS rows) weight-only, not through fbgemm: asked for, or where there is no fbgemm
        self.weight_only_steps = weight_only_steps or not fbgemm
        #: ... through the few-row kernel where it runs: its layout of the weight and the rows' scales (float32)
        self.few_rows = self.weight_only_steps and weight.device.type == "cpu"
        self.few_rows = self.few_rows and few_rows.refusal(self.in_features, torch.int8) is None
        self.few_rows_packed = self.few_rows_scales = None
        #: the int8 weight as it is, where a product reads it (prompts without fbgemm, weight-only steps without the
        #: few-row kernel); else the buffer is empty, the kernels holding their own layouts of it: a weight-only draft
        #: with fbgemm for its prompts holds two int8 copies, not three
        self.holds_dense = not self.fbgemm or (self.weight_only_steps and not self.few_rows)
        shape = weight.shape if self.holds_dense else (0, weight.shape[1])
        self.register_buffer("weight", torch.empty(shape, dtype=torch.int8, device=weight.device))
        self.register_buffer("scales", torch.empty(weight.shape[0], dtype=self.dtype, device=weight.device))
        bias = None if linear.bias is None else linear.bias.detach().to(self.dtype).clone()
        self.register_buffer("bias", bias)
        self.load_dense(weight)

    @torch.no_grad()
    def load_dense(self, weight: Tensor, bias=None) -> None:
        """Quantize the float ``weight`` [out, in] (and take ``bias``) in place: a new draft version's weights. They are
        rounded to the model's dtype first, as loading that version in it rounds them: a version swapped in is the
        version loaded afresh. (Quantized from a trained draft's float32 weights instead, the bfloat16 0.5B Qwen
        draft's 4-bit steps were a mean TVD of 0.132 from its bfloat16 steps, against 0.088 loaded afresh.)"""
        weight = weight.to(device=self.weight.device, dtype=self.dtype).float()
        codes, scales = int8_rows(weight)
        if self.holds_dense:
            self.weight.copy_(codes)
        self.scales.copy_(scales.to(self.dtype))
        self.step_scales = scales.to(self.step_dtype)
        if bias is not None and self.bias is not None:
            self.bias.copy_(torch.as_tensor(bias).to(self.bias))
        if self.fbgemm:
            with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated; its int8 GEMM is not
                warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
                zero = torch.zeros(len(scales), dtype=torch.long)
                quantized = torch._make_per_channel_quantized_tensor(codes, scales.double(), zero, 0)
                self.packed = torch.ops.quantized.linear_prepack(quantized, None)  # the bias: after the row scales
        if self.few_rows:
            self.few_rows_packed, self.few_rows_scales = few_rows.pack(codes), scales.clone()
        if self.int4:
            codes, scales_zeros = int4_groups(weight)
            if self.int4_few_rows:  # the codes and their groups' scales in one layout
                self.int4_packed = few_rows.pack_int4(codes, scales_zeros.to(torch.bfloat16))
            else:
                self.int4_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
                self.int4_scales_zeros = scales_zeros.to(self.step_dtype)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(self.dtype)
        if (out := self._few_rows(rows)) is None:
            out = self._product(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def step_forward(self, x: Tensor) -> Tensor:
        """``forward`` of a decoding step's rows ``x`` [B, k, in] (in the model's dtype) as the lean decoder's eager
        steps call it (:mod:`distillspec.decoding.kvcache`): the few-row kernel's product without the module call and
        ``forward``'s other cases (which it takes where the kernel does not)."""
        out = self._few_rows(x.reshape(-1, self.in_features))
        if out is None:
            return self.forward(x)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def step_product(self) -> tuple[object, int] | None:
        """:meth:`step_forward`'s product as the kernel's own step of a model's layers takes it
        (:func:`~distillspec.models.few_rows.step_product`), and the most rows it takes (its 4-bit product where it
        has one); None where the kernel does not take its steps."""
        if self.int4_packed is not None:
            if not self.int4_few_rows:
                return None
            product = few_rows.step_product(
                self.int4_packed,
                self.out_features,
                None,
                self.bias,
                float_rows=False,
                bias_in_float=False,
                dtype=self.dtype,
            )
            return product, self.int4_rows
        if self.few_rows_packed is None:
            return None
        product = few_rows.step_product(
            self.few_rows_packed,
            self.out_features,
            self.few_rows_scales,
            self.bias,
            float_rows=True,
            bias_in_float=False,
            dtype=self.dtype,
        )
        return product, INT8_ROWS

    def _few_rows(self, rows: Tensor) -> Tensor | None:
        """``rows`` [M, in] (the model's dtype) times the weight through the few-row kernel, where a step of M rows
        takes it (4-bit products up to :attr:`int4_rows` rows, else weight-only int8 ones up to :data:`INT8_ROWS`), in
        the model's dtype; None where it does not (as :meth:`step_product` does, with the bias)."""
        if self.int4_packed is not None and rows.shape[0] <= self.int4_rows:  # its weight in 4 bits
            # the product in the rows' dtype (the model's); None: torch's 4-bit kernel (_product)
            return few_rows.matmul(rows, self.int4_packed, self.out_features) if self.int4_few_rows else None
        if self.few_rows_packed is not None and rows.shape[0] <= INT8_ROWS:  # a weight-only step, float32 in and out
            out = few_rows.matmul(rows.float(), self.few_rows_packed, self.out_features, self.few_rows_scales)
            return out.to(self.dtype)
        return None

    def _product(self, rows: Tensor) -> Tensor:
        """``rows`` [M, in] (the model's dtype) times the weight where the few-row kernel does not take them."""
        step = rows.shape[0] <= INT8_ROWS  # a drafting step (a few rows), not a prompt
        if self.int4_packed is not None and rows.shape[0] <= self.int4_rows:  # 4-bit steps through torch's kernel
            steps = rows.to(self.step_dtype).contiguous()
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                steps, self.int4_packed, INT4_GROUP, self.int4_scales_zeros
            )
            return out.to(self.dtype)
        if self.packed is not None and not (step and self.weight_only_steps):
            # fbgemm, float32 in and out; one scale per row (token), as above
            rows = rows.float()
            if rows.shape[0] == 1:  # a drafting step: the call's scale is the row's
                out = torch.ops.quantized.linear_dynamic(rows.contiguous(), self.packed, True)
            else:
                peaks = rows.abs().amax(1, keepdim=True).clamp(min=1e-30)
                out = torch.ops.quantized.linear_dynamic((rows / peaks).contiguous(), self.packed, True) * peaks
            return out.to(self.dtype)
        if not step:  # a prompt: the int8 values as floats, on the matrix kernels, then the scales
            return torch.nn.functional.linear(rows, self.weight.to(self.dtype)) * self.scales
        steps = rows.to(self.step_dtype).contiguous()
        return torch.ops.aten._weight_int8pack_mm(steps, self.weight, self.step_scales).to(self.dtype)

    def extra_repr(self) -> str:
        if not self.weight_only_steps:
            kernel = "fbgemm"
        elif self.few_rows:
            kernel = "weight-only steps through the few-row kernel"
        else:
            kernel = f"weight-only steps, {str(self.step_dtype).removeprefix('torch.')} activations"
        kernel += f"; steps in int4, groups of {INT4_GROUP}" if self.int4 else ""
        kernel += " through the few-row kernel" if self.int4_few_rows else ""
        kernel += "; prompts through fbgemm" if self.fbgemm and self.weight_only_steps else ""
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{shape}, int8 ({kernel})"


#: Sibling linear layers that read one input in the decoder layers of Llama-like models (Llama, Mistral, Qwen2: the
#: attention's q, k and v projections, the MLP's gate and up projections), and the name of their one product.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class FusedLinear(nn.Module):
    """Sibling linear layers that read one input as one product: ``linear`` over their rows stacked, each part's
    output a slice of its output. The lean decoder (:mod:`distillspec.decoding.kvcache`) calls the product itself;
    the parts stay where the model's own code calls them, as :class:`FusedPart` modules, and its calls of one input
    share one product: the first computes it, the others take their slices.

    A product has a cost of its own besides the bytes it reads, most of all through fbgemm: a drafting step of the
    0.5B Qwen draft through fbgemm makes 169 products unfused and 97 fused, and took 39.6 ms against 43.1 on a Zen 3
    CPU (docs/MEASUREMENTS.md), with the same logits to the bit: each output row's product and scale, and each input
    row's rounding, are its own. An :class:`Int8Linear` draft is fused (:func:`quantize_int8`); float drafts are
    not."""

    def __init__(self, linear: nn.Module, parts: dict[str, int]) -> None:
        super().__init__()
        self.linear = linear
        self.parts = parts  #: each part's name and its number of outputs, in the order of the stacked rows
        self.sizes = list(parts.values())
        self._last = threading.local()  #: per thread: the input of the last product, its slices, the parts served

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        """Every part's output for ``x``, in the order of :attr:`parts` (what the lean decoder calls)."""
        return self.linear(x).split(self.sizes, -1)

    def part(self, name: str, x: Tensor) -> Tensor:
        """Part ``name``'s output for ``x``: a slice of the product of ``x``, computed anew unless the last product
        was of this very tensor and had not served this part yet."""
        last = self._last
        if getattr(last, "input", None) is not x or name in last.served:
            last.input, last.served = x, set()
            last.outputs = dict(zip(self.parts, self(x), strict=True))
        last.served.add(name)
        out = last.outputs[name]
        if len(last.served) == len(self.parts):  # every part served: hold nothing until the next input
            last.input = last.outputs = None
        return out

    def __getstate__(self) -> dict:  # copies and pickles start with no last product (a thread-local holds none)
        state = self.__dict__.copy()
        del state["_last"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._last = threading.local()


class FusedPart(nn.Module):
    """Part ``name`` of a :class:`FusedLinear`, where the model's code calls it: its slice of the shared product. It
    holds no weights (they are the fused module's, saved once)."""

    def __init__(self, fused: FusedLinear, name: str, in_features: int, out_features: int) -> None:
        super().__init__()
        self.name, self.in_features, self.out_features = name, in_features, out_features
        self._fused = (fused,)  # not a submodule: the fused weights belong to the module that fused them

    def forward(self, x: Tensor) -> Tensor:
        return self._fused[0].part(self.name, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, a slice of a fused product"


def fuse_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """In each module of ``model`` that holds every part of a group of :data:`FUSED_PARTS` as plain ``nn.Linear``
    layers of one input size, dtype and bias: a :class:`FusedLinear` under the group's name, its product ``make`` of
    their rows stacked, and :class:`FusedPart` modules in the parts' places. Returns how many groups were fused."""
    fused = 0
    for module in list(model.modules()):
        for group, names in FUSED_PARTS.items():
            parts = [getattr(module, name, None) for name in names]
            if not all(type(p) is nn.Linear for p in parts):
                continue
            if len({(p.in_features, p.bias is None, p.weight.dtype, p.weight.device) for p in parts}) > 1:
                continue
            first = parts[0]
            stacked = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=False, device="meta")
            with torch.no_grad():
                stacked.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
                if first.bias is not None:
                    stacked.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
            product = FusedLinear(make(stacked), {name: p.out_features for name, p in zip(names, parts)})
            setattr(module, group, product)
            for name, p in zip(names, parts):
                setattr(module, name, FusedPart(product, name, p.in_features, p.out_features))
            fused += 1
    return fused


def quantize_int8(
    model: nn.Module, fbgemm: bool = False, int4: bool = False, fuse: bool = True, weight_only_steps: bool = False
) -> int:
    """Replace every linear layer of ``model`` (in place; its decoder layers and head, a draft vocabulary's too) by
    an :class:`Int8Linear` in the model's dtype (through fbgemm's int8 GEMM with ``fbgemm``, but for its steps with
    ``weight_only_steps``; its steps through 4-bit weights with ``int4``), with ``fuse`` the siblings that read one
    input as one (:func:`fuse_linears`); the model is frozen. Returns how many int8 layers it has."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    if fbgemm and not (fbgemm_available() and on_cpu):
        raise DistillSpecError(
            "draft_int8=fbgemm runs fbgemm's int8 GEMM, which x86 CPUs alone have (this "
            f"{'build of torch has none' if on_cpu else 'draft is not on the CPU'}): use draft_int8=true"
        )

    def int8_like(linear: nn.Linear) -> nn.Module:  # a draft vocabulary's head keeps its d2t map
        quantized = Int8Linear(linear, fbgemm, int4, weight_only_steps)
        if hasattr(linear, "d2t"):
            quantized.register_buffer("d2t", linear.d2t)
        return quantized

    return (fuse_linears(model, int8_like) if fuse else 0) + replace_linears(model, int8_like)  # (which freezes)
