"""Float32 linear weights prepacked once for the CPU's matrix kernels (oneDNN), so that verifying ``gamma + 1``
positions costs about one decoding step.

At batch 1 a decoding step is bound by reading the weights, so a few more rows (the positions a verification
scores) should cost little. In float32 on a CPU they do not: an eager ``Linear`` of 2-8 rows costs 1.5-2.5x the
one-row product, because the GEMM re-lays the whole weight out on every call. A :class:`PackedLinear` holds its
weight in the blocked layout oneDNN computes from (``torch.ops.mkldnn._reorder_linear_weight``, as inductor's
freezing pass does), laid out once when the model is loaded; 1-8 rows then cost about the same. On CPUs that compute
bfloat16 natively the pair runs in bfloat16 instead (``dtype=auto``), whose products are already flat in the rows.

Only a frozen model is packed (the target: it scores and verifies, never trains): the dense weight is dropped, so
the packed model takes no more memory than the plain one, has no gradients and cannot be saved.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from distillspec.models.draft_vocab import DraftHead


def can_prepack(device: str | torch.device = "cpu") -> bool:
    """Whether this build of torch can prepack weights for ``device`` (a CPU with oneDNN)."""
    return torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose float32 weight is prepacked for oneDNN; ``forward`` takes any leading shape.

    ``rows`` is the row count the layout is tuned for (any count is computed correctly)."""

    def __init__(self, linear: nn.Linear, rows: int = 8) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear takes float32 CPU weights, not {weight.dtype} on {weight.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


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


def prepack_linears(model: nn.Module, rows: int = 8) -> int:
    """Replace every float32 CPU ``nn.Linear`` of ``model`` (in place) by a :class:`PackedLinear`; the model is frozen.
    Returns how many were packed."""

    def pack(linear: nn.Linear) -> nn.Module | None:
        plain = (
            type(linear) is nn.Linear and linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"
        )
        return PackedLinear(linear, rows) if plain else None

    return replace_linears(model, pack)


#: Up to this many rows an :class:`Int8Linear` in bfloat16 multiplies by its int8 weight directly (a decoding step);
#: more rows (a prompt) are multiplied by the weight dequantized on the fly: the int8 kernel does not use the CPU's
#: matrix units, and for a 150-token prompt it ran 5x slower than dequantizing first (4864 x 896, bfloat16, AMX).
INT8_ROWS = 16


def dynamic_int8(dtype: torch.dtype, device: str | torch.device = "cpu") -> bool:
    """Whether an :class:`Int8Linear` of a ``dtype`` model on ``device`` multiplies through fbgemm's int8 GEMM
    (``quantized::linear_dynamic``, activations quantized per call) rather than the weight-only kernel: a float32
    model on an x86 CPU. There the weight-only kernel has no vectorised float32 path (on an AVX2-only CPU it ran
    3-5x slower than the float32 product it replaces, where fbgemm ran 3-9x faster:
    ``python benchmarks/benchmark.py int8``)."""
    engines = torch.backends.quantized.supported_engines
    return dtype == torch.float32 and torch.device(device).type == "cpu" and ("x86" in engines or "fbgemm" in engines)


class Int8Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is held as int8 with one scale per output row, for a draft that only
    proposes: speculative decoding stays exact whatever the draft computes; a draft rounded this way is accepted
    about as often as before. A step reads a quarter of float32's bytes, half of bfloat16's.

    In bfloat16 the product is weight-only, as gpt-fast's int8 mode (``torch.ops.aten._weight_int8pack_mm``). In
    float32 on an x86 CPU (:func:`dynamic_int8`) it runs through fbgemm's int8 GEMM, which also rounds the
    activations to 8 bits, with one scale for all the rows of a call (so a row's product depends slightly on the
    rows beside it), as ``torch.ao``'s dynamic quantization does."""

    def __init__(self, linear: nn.Linear, dynamic: bool | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype  #: activations, scales and bias: the model's dtype
        #: fbgemm's int8 GEMM (None: :func:`dynamic_int8`), else the weight-only kernel
        self.dynamic = dynamic_int8(self.dtype, weight.device) if dynamic is None else dynamic
        self.packed = None  #: fbgemm's packed weight where :attr:`dynamic`
        self.register_buffer("weight", torch.empty(weight.shape, dtype=torch.int8, device=weight.device))
        self.register_buffer("scales", torch.empty(weight.shape[0], dtype=self.dtype, device=weight.device))
        bias = None if linear.bias is None else linear.bias.detach().to(self.dtype).clone()
        self.register_buffer("bias", bias)
        self.load_dense(weight)

    @torch.no_grad()
    def load_dense(self, weight: Tensor, bias=None) -> None:
        """Quantize the float ``weight`` [out, in] (and take ``bias``) in place: a new draft version's weights."""
        weight = weight.to(self.weight.device).float()
        scales = weight.abs().amax(1).clamp(min=1e-12) / 127
        self.weight.copy_((weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.scales.copy_(scales.to(self.dtype))
        if bias is not None and self.bias is not None:
            self.bias.copy_(torch.as_tensor(bias).to(self.bias))
        if self.dynamic:
            with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated; its int8 GEMM is not
                warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
                zero = torch.zeros(len(scales), dtype=torch.long)
                quantized = torch._make_per_channel_quantized_tensor(self.weight, scales.double(), zero, 0)
                self.packed = torch.ops.quantized.linear_prepack(quantized, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).to(self.dtype)
        if self.packed is not None:  # float32 on x86: fbgemm, its bias inside
            out = torch.ops.quantized.linear_dynamic(rows.contiguous(), self.packed, True)
            return out.reshape(*x.shape[:-1], self.out_features)
        if rows.shape[0] > INT8_ROWS:  # a prompt: dequantized, so the product runs on the matrix kernels
            out = torch.nn.functional.linear(rows, self.weight.to(self.dtype) * self.scales[:, None])
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "fbgemm" if self.dynamic else "weight-only"
        shape = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{shape}, int8 ({kernel})"


def quantize_int8(model: nn.Module, dynamic: bool | None = None) -> int:
    """Replace every linear layer of ``model`` (in place; its decoder layers and head, a draft vocabulary's too) by
    an :class:`Int8Linear` in the model's dtype (``dynamic``: its kernel, None: :func:`dynamic_int8`); the model is
    frozen. Returns how many were replaced."""

    def int8_like(linear: nn.Linear) -> nn.Module:  # a draft vocabulary's head keeps its d2t map
        quantized = Int8Linear(linear, dynamic)
        if hasattr(linear, "d2t"):
            quantized.register_buffer("d2t", linear.d2t)
        return quantized

    return replace_linears(model, int8_like)
