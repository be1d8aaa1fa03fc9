"""A CPU kernel for products of a few rows by a frozen float32, bfloat16 or int8 weight: a decoding step (1 row) and a
verification of ``gamma + 1`` positions (2-8 rows) of a target on an x86 CPU with AVX2 and FMA, and a drafting step
of an int8 draft. The rows and the sums are float32; a bfloat16 weight is widened to float32 in registers, so a
float32 target whose weights are rounded to bfloat16 (``prepack=bfloat16``) reads half the bytes a step and computes
the rest in float32. A bfloat16 target's rows stay bfloat16 where the CPU has AVX512-BF16 (:func:`bf16_rows`): each
pair of products is exact (``vdpbf16ps``) and the sums float32. On a 2-core AMD EPYC with AVX-512 BF16 the 1.5B Qwen
target's cached step took 0.36x oneDNN's bfloat16 step and its verification at gamma 5 0.44x (1.08 steps: from 2
rows on the kernel prefetches the weight stream 8 KB ahead); past 16 rows (a prompt) register blocks of 4 rows by 4
weight rows sum 2,048 inputs at a time, and 128 rows took 1.20-1.23x oneDNN's (docs/MEASUREMENTS.md). An int8
weight with a scale per output row (a weight-only int8 draft's, :class:`~distillspec.models.packing.Int8Linear`) is
multiplied in integers, each input row rounded to 16 bits with a scale of its own: far closer to the dequantized
weight's product than fbgemm's 7-bit activations (the 0.5B Qwen draft's mean TVD from the float draft 0.0096 against
0.0346), and a drafting step of that draft took 0.82x fbgemm's on a Zen 3 CPU. Where the CPU has AVX512-VNNI the
same integer sums take two instructions per 32 weights (:func:`int8_vnni`): the draft's decoder layers at 1 / 2 / 6
rows in 0.91 / 0.80 / 0.76 of AVX2's time on an AMD EPYC. A 4-bit weight in groups of 32 (an int4 draft's, a 4-bit
target's: :func:`int4`) is multiplied in integers with its output rows in the vectors' lanes: through AVX512-VNNI
where the CPU has it, the rows rounded to 16 bits as for an int8 weight; at AVX2, to 8 bits with a scale for each
group of 32 inputs (as llama.cpp's AVX2 products take them), so that one instruction multiplies 32 pairs where it
multiplied 16: on a 2-core Zen 3 CPU the 1.5B Qwen target's 6-token verification took 98 ms against 125-129, its
one-token step unchanged (57-62 ms), and its distributions moved from a mean TVD of 0.0016 from the file's model to
0.0040. A 6-bit weight with a step for each 16 inputs (a GGUF's Q6_K layers, :func:`pack_int6`) takes AVX2's products
the same way, its codes a byte each: a float32 target's 6-bit layers, the 1.5B Qwen target's head among them, which it
held in bfloat16 and widened in registers, took 0.69x that time at one row and 0.60x at six, and the target's steps
0.82-0.86x (one process, Zen 3).

At batch 1 such a product is bound by reading the weight, yet oneDNN's GEMM on its prepacked layout costs 1.3-1.6x
as much for six rows as for one on an AVX2-only CPU: the rows' inputs do not stay in the first-level cache while the
weight streams past them. This kernel (``few_rows.cpp``) lays the weight out once in blocks of 64 output rows, each in
chunks of 512 inputs, and multiplies a chunk's rows into up to eight input rows held in that cache, each weight
vector loaded once. The 1.5B Qwen target's cached step (Zen 3, 2 cores, float32) took 286 ms against oneDNN's 369 at
1 new token and 370 against 537 at 6 (a verification at gamma 5): 0.77x and 0.69x
(``python -m benchmarks.suites.target_kernel``). More rows take the same layout, eight at a time with a chunk of
weights in the second-level cache: a step of 128 rows took 1.06x oneDNN's, so a target that only scores batches
(a learner's, a scoring actor's) keeps oneDNN's layout.

The same module holds a decoding step's work around its products, for Llama-like layers
(``decoder_step.cpp``): the rotary embedding of a few new queries and keys, the cache's writes and the attention in
one call a layer (:func:`cached_attention`), and a residual sum with the RMSNorm after it in one call
(:func:`add_rms_norm`), each where torch takes tens of small operators (``kvcache.CachedLM`` takes them for its
steps and verifications).

The kernel is compiled on first use with the C++ compiler torch's own extensions use (``torch.utils.cpp_extension``)
into the project cache, once per version of its source and of torch. Where it cannot be had (no AVX2, no compiler,
inputs that are not multiples of 8, or ``DISTILLSPEC_FEW_ROWS=0``) the target keeps oneDNN's layout
(:class:`~distillspec.models.packing.PackedLinear`) and a weight-only int8 draft's steps go through torch's kernel
(:class:`~distillspec.models.packing.Int8Linear`; ``draft_int8=auto`` takes fbgemm), with one warning that says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor
from torch.utils import cpp_extension

from distillspec.files import cache_root, one_at_a_time

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
#: Built into the same module: a decoding step's work around its products (:func:`cached_attention`,
#: :func:`add_rms_norm`), and the header the two share.
SOURCES = (SOURCE, Path(__file__).with_name("decoder_step.cpp"), Path(__file__).with_name("few_rows.h"))
#: Set to ``0`` to keep oneDNN's layout for a float32 target (a comparison, a compiler that misbehaves).
SWITCH = "DISTILLSPEC_FEW_ROWS"


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None where it can be built (it is not built by this call)."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"an x86 kernel, and this CPU is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"it needs AVX2 and FMA, and torch finds {torch.backends.cpu.get_cpu_capability()}"
    return None


def build_directory() -> Path:
    """Where this version of the kernel's source is built for this Python and torch: the project cache's ``kernels``
    folder (checkouts of other versions build their own)."""
    version = torch.__version__.replace("+", "_")
    source = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES)).hexdigest()[:12]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / "kernels" / f"few_rows-{source}-{python}-torch{version}"


#: torch's own mark of a build under way in a build directory (``torch.utils.file_baton``): a file that a build
#: killed before it finished (a stopped job, a killed actor) leaves behind, after which torch waits for it forever.
TORCH_BATON = "lock"
#: The lock file that lets one process at a time build or load the kernel in a build directory.
BUILD_LOCK = "build.lock"


@functools.cache
def _built() -> tuple[ModuleType | None, str | None]:
    """The compiled kernel (built into the project cache the first time) and None, or None and why it cannot be had
    (warned once)."""
    reason = unavailable_reason()
    if reason is None:
        build = build_directory()
        build.mkdir(parents=True, exist_ok=True)
        try:
            # One process builds at a time. Holding the lock (which the operating system releases however its holder
            # ends), torch's own mark of a build under way can only be a dead build's: removed.
            with one_at_a_time(build / BUILD_LOCK, f"waiting for another process to build the kernel in {build}"):
                (build / TORCH_BATON).unlink(missing_ok=True)
                if not any(build.glob("distillspec_few_rows*.so")):  # a first build: a pause worth naming (with the
                    print(f"building the few-row kernel into {build} (once, half a minute)", flush=True)  # jobs' lines)
                module = cpp_extension.load(
                    "distillspec_few_rows",
                    sources=[str(path) for path in SOURCES if path.suffix == ".cpp"],
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build),
                )
            return module, None
        except (OSError, RuntimeError, ImportError, SystemExit) as exc:  # no compiler, no ninja, a failed build
            reason = f"it did not build here ({str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r})"
    log.warning(
        "the few-row kernel is not used: %s; a float32 target's weights are prepacked for oneDNN, an int8 "
        "draft's steps go through fbgemm or torch's weight-only kernel, and decoding steps through torch's operators",
        reason,
    )
    return None, reason


def extension() -> ModuleType | None:
    """The compiled kernel (built the first time), or None where it cannot be had."""
    return _built()[0]


def missing() -> str | None:
    """Why the kernel does not run here (building it the first time), or None where it does."""
    return _built()[1]


#: A weight's inputs come in multiples of this many for the kernel, by dtype (its vectors: 8 floats, 32 int8 weights).
INPUT_MULTIPLE = {torch.float32: 8, torch.bfloat16: 8, torch.int8: 32}


def refusal(in_features: int, dtype: torch.dtype) -> str | None:
    """Why the kernel does not take a weight of ``in_features`` inputs in ``dtype`` here (building it the first time
    when the shape fits), or None where it does."""
    multiple = INPUT_MULTIPLE[dtype]
    if in_features % multiple:
        return f"it takes inputs in multiples of {multiple}, not {in_features}"
    return missing()


def available() -> bool:
    """Whether the kernel runs here (building it the first time)."""
    return extension() is not None


def bf16_rows() -> bool:
    """Whether the kernel multiplies bfloat16 rows by a bfloat16 weight here (an x86 CPU with AVX512-BF16, building
    the kernel the first time): a bfloat16 target's products, its activations as the model computes them."""
    return extension() is not None and extension().bf16_rows_supported()


#: Set to ``0`` to keep AVX2's products for an int8 or 4-bit weight on a CPU with AVX512-VNNI (a comparison); read
#: once.
INT8_VNNI_SWITCH = "DISTILLSPEC_INT8_VNNI"


def int8_vnni() -> bool:
    """Whether the kernel multiplies an int8 weight through AVX512-VNNI here (building the kernel the first time):
    32 weights sign-extended in one instruction and multiplied into 16-bit rows in another (``vpdpwssd``), the same
    integer sums as AVX2's path. A step of the 0.5B Qwen draft's decoder layers (1 row) took 6.0 ms against AVX2's
    6.6, at 2 rows 6.2 against 7.7, at 6 rows 13.1 against 17.2 (2-core AMD EPYC, docs/MEASUREMENTS.md)."""
    return extension() is not None and extension().int8_vnni_supported()


#: Set to ``0`` to keep torch's kernel for a 4-bit draft's steps (comparisons); unset (or ``1``), the few-row kernel
#: takes them wherever it runs (:func:`int4`). Read as a draft is quantized.
INT4_SWITCH = "DISTILLSPEC_INT4_FEW_ROWS"


def int4() -> bool:
    """Whether a 4-bit weight in groups of 32 (an int4 draft's, :func:`pack_int4`) takes the kernel's products here
    rather than torch's int4 kernel: wherever the kernel runs (built the first time) and ``DISTILLSPEC_INT4_FEW_ROWS``
    is not ``0``. Output rows lie in the vectors' lanes, 16 to a vector (8 at AVX2), so a group's 4-bit codes take their
    scales for 16 rows at once; the rows are rounded to 16 bits as an int8 weight's through AVX512-VNNI, to 8 bits with
    a scale for each group of 32 inputs at AVX2 (each path with a layout of its own). With VNNI the 0.5B Qwen draft's
    decoder layers at 1 / 2 / 4 rows took 0.75-0.81 / 0.73-0.77 / 0.66 of torch's int4 kernel's time on an AMD EPYC;
    with AVX2's products its float32 step took 0.39x torch's kernel's at AVX2 (one row), and, a step's layers in one
    call (only the kernel's products take it), 0.78x torch's AVX-512 kernel's at one row and 1.01-1.07x at two and four,
    as a CPU with AVX-512 and no VNNI runs them (docs/MEASUREMENTS.md)."""
    if os.environ.get(INT4_SWITCH) == "0" or extension() is None:
        return False
    return extension().int4_supported()


def pack_int4(codes: Tensor, scales_zeros: Tensor) -> Tensor:
    """A 4-bit weight's ``codes`` [out, in] (0-15; ``out`` a multiple of 16, ``in`` of 32) and its groups' scales and
    zero points [in / 32, out, 2] (bfloat16: :func:`~distillspec.models.packing.int4_groups`, each weight
    ``(code - 8) * scale + zero``) in the layout of the products that run here (AVX512-VNNI's or AVX2's) for
    :func:`matmul`: one uint8 tensor, about ``out * in * 5 / 8`` bytes (runs of 64 output rows, each group's codes
    followed by its scales)."""
    return extension().pack_int4(codes, scales_zeros)


def pack_int6(codes: Tensor, steps: Tensor) -> Tensor:
    """A 6-bit weight's ``codes`` [out, in] (0-63; ``in`` a multiple of 32) and its steps [out, in / 16] (float32:
    :func:`~distillspec.models.packing.int6_grid`, each weight ``(code - 32) * step``) in the layout of AVX2's 6-bit
    products for :func:`matmul`: a uint8 tensor with a row for each group of 32 inputs of each run of 64 output rows,
    its codes a byte each, then their steps (a 4-bit weight's layout is flat: :func:`matmul` tells them apart so)."""
    return extension().pack_int6(codes, steps)


def pack(weight: Tensor) -> Tensor:
    """A float32 or bfloat16 CPU ``weight`` [out, in] (``in`` a multiple of 8), or an int8 one (``in`` a multiple of
    32), in the kernel's blocked layout: a flat tensor of its dtype, about the same size (the rows padded to a multiple
    of 64)."""
    return extension().pack(weight.detach())


def matmul(rows: Tensor, packed: Tensor, out_features: int, scales: Tensor | None = None) -> Tensor:
    """``rows`` [M, in] (float32; bfloat16 by a bfloat16 weight where :func:`bf16_rows`) times the weight :func:`pack`
    laid out, transposed: [M, out_features] in float32 (but for a 4- or 6-bit weight, below).
    An int8 weight takes its output rows' ``scales`` [out_features] (float32); the rows are rounded to 16 bits, one
    scale each. A 4-bit weight (:func:`pack_int4`; float32 or bfloat16 rows, read in fours, in eights at AVX2) holds
    its scales: the rows are rounded as for an int8 weight through AVX512-VNNI, to 8 bits with a scale for each group
    of 32 inputs at AVX2 (and for a 6-bit weight, :func:`pack_int6`, which holds its steps), and the product comes in
    the rows' dtype (bfloat16 rounded from the float32 sums as ``.to(torch.bfloat16)`` rounds them), which is a
    drafting model's own.

    Under ``torch.compile`` (a compiled decoding step, ``CachedLM(compile=True)``) the product is the custom operator
    ``torch.ops.distillspec.few_rows_matmul``, which the compiled graph calls as it is, so that the rest of the step
    (norms, rotary embedding, attention, activations) compiles into one graph around it; eager calls go to the kernel
    directly (the operator's dispatch costs about 17 us a call, 1.6 ms a step of the 0.5B Qwen draft)."""
    if torch.compiler.is_compiling():
        return few_rows_matmul(rows, packed, out_features, scales)
    return extension().matmul(rows, packed, out_features, scales)


@torch.library.custom_op("distillspec::few_rows_matmul", mutates_args=())
def few_rows_matmul(rows: Tensor, packed: Tensor, out_features: int, scales: Tensor | None) -> Tensor:
    """:func:`matmul` as a custom operator: what a compiled step calls."""
    return extension().matmul(rows.contiguous(), packed, out_features, scales)


@few_rows_matmul.register_fake
def _(rows: Tensor, packed: Tensor, out_features: int, scales: Tensor | None) -> Tensor:
    dtype = rows.dtype if packed.dtype == torch.uint8 else torch.float32  # a 4-bit weight's: the rows' dtype
    return rows.new_empty(rows.shape[0], out_features, dtype=dtype)


def cached_attention(
    q: Tensor,
    key: Tensor,
    value: Tensor,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor,
    start: int,
    scale: float,
) -> Tensor:
    """A Llama-like layer's attention for a few new tokens over its cache, in one call: ``q`` [B, k, heads * head_dim],
    ``key`` and ``value`` [B, k, kv_heads * head_dim] as the projections give them (not rotated), rotated by ``cos``
    and ``sin`` [B, k, head_dim] as the models' ``apply_rotary_pos_emb`` rotates them (each operation rounded to the
    dtype, as torch rounds it); the new keys and values are written to columns ``start .. start + k - 1`` of the
    contiguous caches ``keys`` and ``values`` [B, kv_heads, capacity, head_dim]; each new query sees the columns
    ``mask`` [B, start + k] (int64) marks, up to its own, and itself. Returns the attention output [B, k, heads *
    head_dim] (o_proj's input), in the inputs' dtype (float32 or bfloat16, the sums float32)."""
    return extension().cached_attention(q, key, value, cos, sin, keys, values, mask, start, scale)


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual sum ``h + delta`` (``delta`` None: ``h`` itself) and its RMSNorm by ``weight`` [D], as the
    Llama-like models' own norm computes it (each row in float32, ``x / sqrt(mean(x^2) + eps)`` rounded to the rows'
    dtype, times the weight and rounded again), in one call: float32 or bfloat16 rows [..., D] and weight."""
    return extension().add_rms_norm(h, delta, weight, eps)


def step_product(
    packed: Tensor,
    out_features: int,
    scales: Tensor | None,
    bias: Tensor | None,
    float_rows: bool,
    bias_in_float: bool,
    dtype: torch.dtype,
) -> object:
    """A linear layer's product in a step of :func:`step_layers`: rows [..., in] (widened to float32 first where
    ``float_rows``) times the weight through :func:`matmul`, ``bias`` added to its float32 sums before they are
    rounded to ``dtype`` (``bias_in_float``) or after it: as the layer's own ``step_forward`` computes it
    (``PackedLinear.step_product``, ``Int8Linear.step_product``). It can be called on rows itself."""
    return extension().StepProduct(packed, out_features, scales, bias, float_rows, bias_in_float, dtype)


def step_layers(layers: list[dict]) -> object:
    """A step's decoder layers in one call of the kernel, where :mod:`distillspec.decoding.kvcache` calls them from
    Python layer by layer: each layer a dict of ``input_norm``, ``input_eps``, ``qkv`` and ``gate_up`` (each a
    ``(products, sizes)`` pair: one product split into ``sizes``, or one product a part with ``sizes`` empty), ``o``,
    ``post_norm``, ``post_eps``, ``down`` (products of :func:`step_product`) and ``scale`` (its attention's); a
    SiLU MLP. The result is called as ``layers(h, cos, sin, keys, values, mask, start)`` on hidden states [B, k, D],
    the rotary ``cos`` and ``sin``, each layer's cache (as :func:`cached_attention` takes one), and returns the hidden
    states after the last layer's MLP, not yet normed: the same calls in the same order as the layer-by-layer path,
    so the same bits, without a Python call between them (the 0.5B Qwen draft's 4-bit step spent about a sixth of
    its time between its kernel calls; docs/MEASUREMENTS.md)."""
    ext = extension()
    return ext.StepLayers(
        [
            ext.StepLayer(
                layer["input_norm"],
                layer["input_eps"],
                ext.StepSiblings(*layer["qkv"]),
                layer["o"],
                layer["post_norm"],
                layer["post_eps"],
                ext.StepSiblings(*layer["gate_up"]),
                layer["down"],
                layer["scale"],
            )
            for layer in layers
        ]
    )
