"""Loading a target/draft pair (hub id or local directory) and batching text for them."""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from distillspec.config import Compile, DraftInt8, Models
from distillspec.decoding.kvcache import LEAN_MODEL_TYPES
from distillspec.decoding.speculative import check_pair
from distillspec.errors import DistillSpecError
from distillspec.models import draft_vocab, few_rows, hub
from distillspec.models.packing import (
    FusedLinear,
    Int6Linear,
    Int8Linear,
    can_prepack,
    fbgemm_available,
    few_rows_layouts,
    grid_layouts,
    grid_linears,
    int4_available,
    prepack_linears,
    quantize_int8,
)

log = logging.getLogger(__name__)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or name.count("/") > 1


#: What a model folder made by ``save_pretrained`` (with its tokenizer) holds, besides the weights.
MODEL_FILES = ("config.json", "tokenizer_config.json")
#: The ``prepack`` values that hold a target's layers on 4-bit grids in 4 bits (they differ in the rest's layout).
INT4_PREPACKS = ("int4", "int4-int8")


def _check_path(name: str, weights: bool = True) -> None:
    """A local model path exists and holds what loading it needs (the tokenizer only, unless ``weights``)."""
    path = Path(name).expanduser()
    if _looks_local(name) and not path.exists():
        raise DistillSpecError(
            f"model path {name!r} does not exist: give a local directory made by save_pretrained, or a hub id"
        )
    if not path.exists():
        hub.require(name, "model")  # a hub id: fail at once when it cannot be had
    if path.is_dir():
        missing = [f for f in MODEL_FILES if (weights or f.startswith("tokenizer")) and not (path / f).exists()]
        if weights and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            missing.append("weights (*.safetensors)")
        if missing:
            raise DistillSpecError(
                f"model folder {name!r} lacks {', '.join(missing)}: save the model and its tokenizer there with "
                "save_pretrained"
            )


def _unloadable(name: str, exc: Exception) -> DistillSpecError:
    return DistillSpecError(
        f"model {name!r} could not be loaded ({str(exc).splitlines()[0][:200]}): "
        "give a local directory or a reachable hub id"
    )


def cpu_has(feature: str) -> bool:
    """Whether this CPU has ``feature`` (``"avx512_bf16"``, ``"amx_tile"``, ``"amx_fp16"``), as torch's private
    ``torch.cpu._is_<feature>_supported`` says; False where this torch has no such check."""
    return getattr(torch.cpu, f"_is_{feature}_supported", lambda: False)()


def cpu_avx512() -> bool:
    """Whether torch runs its own CPU kernels at AVX-512 here (its dispatch, which ``ATEN_CPU_CAPABILITY`` can hold
    lower), as for the int4 kernel."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` computes bfloat16 in hardware: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or
    AMX. Elsewhere bfloat16 is emulated: on an AVX2-only CPU a bfloat16 forward pass runs 2.5-4x, and a training step
    under bfloat16 autocast about 18x slower than in float32 (``benchmarks/benchmark.py precision``)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return cpu_has("avx512_bf16") or cpu_has("amx_tile")
    return False


def native_half(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` in hardware: float32 always, bfloat16 with AVX512-BF16 or AMX, float16
    with AMX-FP16."""
    if dtype == torch.bfloat16:
        return native_bf16("cpu")
    if dtype == torch.float16:
        return cpu_has("amx_fp16")
    return True


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a hub id or a local ``save_pretrained`` directory, with a pad token (EOS if it has none)."""
    _check_path(name, weights=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise _unloadable(name, exc) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None


def release_memory() -> None:
    """Hand the memory a load freed back to the OS. glibc keeps freed heap blocks in the process, and a load frees
    many (weights read in one dtype and cast, quantized or replaced): a process that loaded the 0.5B Qwen draft as
    int8 (0.8 GB of weights) held 2.2 GB, 1.4 GB once trimmed. ``malloc_trim`` returns them (0.1 ms; the
    temporaries are freed by reference counting, no collection needed); elsewhere this does nothing."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@dataclass(frozen=True)
class SharedWeights:
    """A frozen model's weights as numpy arrays (:func:`share_weights`), to be put once into Ray's object store: every
    process on a node that builds the model from them (:func:`load_model`'s ``shared``) reads the same memory."""

    name: str  #: the model they are the weights of (as :func:`load_model` was given it)
    dtype: str  #: its weights' dtype ("bfloat16")
    arrays: dict[str, np.ndarray]  #: every parameter and buffer, by name (16-bit floats as their raw 16-bit words)
    dtypes: dict[str, str]  #: each tensor's torch dtype, by name
    #: a bfloat16 target's linear weights in the few-row kernel's layout (raw 16-bit words; uint8, its 4-bit layout,
    #: for a layer on 4-bit grids with ``prepack=int4``), by module name, for the processes that decode with it
    #: (:func:`~distillspec.models.packing.few_rows_layouts`, :func:`~distillspec.models.packing.grid_layouts`);
    #: empty where none is
    layouts: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in [*self.arrays.values(), *self.layouts.values()])


def share_weights(
    model: PreTrainedModel, name: str, layouts: bool = False, int4: dict[str, torch.Tensor] | None = None
) -> SharedWeights:
    """``model``'s parameters and buffers (rotary tables included) as numpy arrays over its own memory (no copy), each
    tied tensor once; with ``layouts``, also its bfloat16 linear weights laid out for the few-row kernel where
    :func:`~distillspec.models.packing.prepack_linears` would lay them out (as much memory again), but for those
    ``int4`` lays out in 4 bits (:func:`~distillspec.models.packing.grid_layouts`, by module name: ``prepack=int4``;
    about a third of it)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    arrays = {k: t.detach().view(_WORDS.get(t.dtype, t.dtype)).numpy() for k, t in tensors.items()}
    dtypes = {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()}
    int4 = int4 or {}
    laid_out = few_rows_layouts(model, but=int4) if layouts else {}
    words = {k: t.view(torch.int16).numpy() for k, t in laid_out.items()} | {k: t.numpy() for k, t in int4.items()}
    return SharedWeights(name, str(model.dtype).removeprefix("torch."), arrays, dtypes, words)


_WORDS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}  #: what numpy holds a 16-bit float as


def _over(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` over a shared ``array`` (16-bit floats as their raw words), read-only memory of the
    object store: nothing writes to these frozen weights, so torch's warning about it does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array).view(dtype)


def _from_shared(shared: SharedWeights, config) -> PreTrainedModel:
    """The model of ``config`` over ``shared``'s arrays: built on the meta device (no memory), then each parameter
    and buffer set to a tensor over its array, read-only memory of the object store on this node."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shared.dtype))
    for key, array in shared.arrays.items():
        module_name, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = _over(array, getattr(torch, shared.dtypes[key]))
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[leaf] = tensor
    model.tie_weights()  # a tied head is the embeddings' parameter, shared once
    left = [k for k, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise DistillSpecError(f"the shared weights of {shared.name} lack {left[:3]}")
    return model.eval()


def load_model(
    name: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    prepack: bool | str = False,
    shared: SharedWeights | None = None,
    kernel: str = "auto",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from a hub id or a local ``save_pretrained`` directory; ``dtype`` is a torch
    dtype or its name (``"bfloat16"``; ``"auto"``: :func:`resolve_dtype` for this model as a target). ``prepack``
    freezes it with its linear weights laid out for few-row products
    (:func:`~distillspec.models.packing.prepack_linears`): for a target, which only scores and verifies (``auto``:
    :func:`resolve_prepack`; ``kernel``: a float32 one's layout, as
    :class:`~distillspec.models.packing.PackedLinear` takes it; ``int4``: its layers on 4-bit grids found on the
    file's values (:func:`file_weights`) and held in 4 bits, :func:`~distillspec.models.packing.grid_linears`, a
    float32 target's on 6-bit grids in 6 bits, the others as ``true`` lays them out (a float32 target's rounded to
    bfloat16, as ``bfloat16`` rounds them; with ``int4-int8`` the 6-bit ones too, rounded to int8, a scale per output
    row), but for a target that only scores,
    ``kernel="onednn"``, which keeps ``true``'s layout). ``shared``: the weights of this
    model in this dtype, shared with other processes (:class:`SharedWeights`; on a CPU): the model is built over them,
    frozen, instead of read from files, and over the layouts they hold where it is laid out for the few-row kernel
    (4-bit ones too)."""
    if dtype == "auto":
        dtype = resolve_dtype("auto", name, device)[0]
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tokenizer = load_tokenizer(name)
    if prepack in ("auto", *INT4_PREPACKS):  # (where the kernel's 4-bit products do not run: an error that says so)
        prepack = resolve_prepack(prepack, str(dtype).removeprefix("torch."), name, device)[0]
    if prepack in INT4_PREPACKS and kernel == "onednn":
        prepack = True  # a target that only scores: the dtype's layout
    try:
        config = AutoConfig.from_pretrained(name)
        if shared is not None and torch.device(device).type != "cpu":
            shared = None  # an accelerator holds its own copy
        if shared is not None and (shared.name, shared.dtype) != (name, str(dtype).removeprefix("torch.")):
            log.warning(
                "shared weights of %s in %s, asked for %s in %s: loading it", shared.name, shared.dtype, name, dtype
            )
            shared = None
        if shared is not None:
            model = _from_shared(shared, config)
        elif getattr(config, draft_vocab.CONFIG_KEY, None):
            model = _load_restricted(name, config, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise _unloadable(name, exc) from None
    model = model.to(device).eval()
    layouts = shared.layouts if shared is not None else {}
    if prepack in INT4_PREPACKS and shared is not None:  # the 4-bit layers found by the process that shares them
        grid_linears(model, dtype, {k: _over(a, torch.uint8) for k, a in layouts.items() if a.dtype == np.uint8})
    elif prepack in INT4_PREPACKS:  # found on the file's values, a layer at a time
        six_bits = prepack == "int4" and dtype == torch.float32  # the file's 6-bit layers in 6 bits, not bfloat16
        if layers := grid_linears(model, dtype, grid_layouts(model, file_weights(name), six_bits=six_bits)):
            six = sum(isinstance(m, Int6Linear) for m in model.modules())
            log.info("%s: %d linear layers in 4 bits, %d in 6 (they lie on such grids)", name, layers - six, six)
        else:
            log.info("%s: none of its linear layers lies on 4-bit grids: laid out as prepack=true lays them", name)
    if prepack:
        # bfloat16: a float32 target's weights rounded to bfloat16; int4: those not held in 4 or 6 bits;
        # int4-int8: those rounded to int8 instead, each process its own (the sharer shares no layout of them)
        rounded = {"bfloat16": torch.bfloat16, "int4": torch.bfloat16, "int4-int8": torch.int8}
        weights = rounded.get(str(prepack)) if kernel != "onednn" else None
        laid_out = {k: _over(a, torch.bfloat16) for k, a in layouts.items() if a.dtype != np.uint8}
        prepack_linears(model, kernel=kernel, weights=weights, packed=laid_out)
    release_memory()
    return model, tokenizer


def _load_restricted(name: str, config, dtype: torch.dtype) -> PreTrainedModel:
    """A draft saved with a draft vocabulary (:mod:`distillspec.models.draft_vocab`): the architecture from its
    config, the head restricted to the saved size, then every weight from its safetensors files."""
    files = sorted(Path(name).expanduser().glob("*.safetensors"))
    if not files:
        raise OSError(f"{name} has a draft vocabulary ({draft_vocab.CONFIG_KEY}) but no *.safetensors weights")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    draft_vocab.restrict_head(model, torch.arange(getattr(config, draft_vocab.CONFIG_KEY)))
    state = {}
    for file in files:
        state.update(safetensors.torch.load_file(file))
    model.load_state_dict(state, strict=False)  # buffers of the architecture (rotary) are not saved
    missing = {k for k, _ in model.named_parameters()} - set(state)
    if missing:
        raise OSError(f"{name} lacks weights {sorted(missing)[:3]}")
    return model


def load_arrays(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Copy ``arrays`` (:func:`~distillspec.versions.state_arrays` of a model of the same architecture) into
    ``model``'s weights: one copy, read straight from the arrays, which may be read-only views of Ray's object store
    (only ``copy_`` reads them, so torch's warning about tensors over read-only memory does not apply). A fused
    product (:class:`~distillspec.models.packing.FusedLinear`) takes its parts' arrays stacked."""
    fused = {f"{n}.linear": m for n, m in model.named_modules() if isinstance(m, FusedLinear)}

    def dense(layer: str, leaf: str) -> np.ndarray | None:  # a fused product's arrays are its parts', stacked
        if layer not in fused:
            return arrays[f"{layer}.{leaf}"] if leaf == "weight" else arrays.get(f"{layer}.{leaf}")
        parent = layer.removesuffix(".linear").rpartition(".")[0]
        parts = [arrays.get(f"{parent}.{part}.{leaf}") for part in fused[layer].parts]
        return None if parts[0] is None else np.concatenate(parts)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        quantized = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
        for name, tensor in model.state_dict().items():
            layer, _, leaf = name.rpartition(".")
            if layer not in quantized:
                tensor.copy_(torch.as_tensor(arrays[name] if layer not in fused else dense(layer, leaf)))
            elif leaf == "weight":  # an int8 layer quantizes the float weight (its scales and bias come with it)
                quantized[layer].load_dense(torch.as_tensor(dense(layer, leaf)), dense(layer, "bias"))
    release_memory()


def check_tokenizers(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """The draft and the target must map text to the same ids."""
    if len(target_tok) != len(draft_tok):
        raise DistillSpecError(
            f"draft tokenizer has {len(draft_tok)} tokens but the target's has {len(target_tok)}: "
            "the draft and target must share one tokenizer"
        )
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise DistillSpecError(
            "draft and target tokenizers map tokens to different ids: the draft and target must share one tokenizer"
        )


def compiler_missing() -> str | None:
    """Why torch.compile could not build its kernels here (inductor compiles C++ for a CPU, and for a GPU's host
    code), or None where a C++ compiler is on the PATH."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    if any(shutil.which(name) for name in names):
        return None
    return f"torch.compile builds its kernels with a C++ compiler, and none is on the PATH ({', '.join(names)})"


def check_pair_sources(
    target: str, draft: str, *, compile: Mapping[str, Compile] | None = None, vllm: bool = False
) -> None:
    """What :func:`load_pair` checks, from the tokenizers and configs alone (no weights): both load, and they
    share one tokenizer and one vocabulary; ``compile`` (the knobs that compile decoding, ``{"eval.compile": True}``):
    each model a knob compiles (both for true, the draft for draft) is one the compiled decoder runs, and a C++ compiler
    is there for torch.compile's kernels (:func:`compiler_missing`); with ``vllm``, the draft is one vLLM's
    ``draft_model`` takes (no draft vocabulary). For a driver that leaves the models to its workers, before anything
    long starts."""
    tokenizers, vocab = [], []
    for name in (target, draft):
        _check_path(name)
        try:
            tokenizers.append(AutoTokenizer.from_pretrained(name))
            config = AutoConfig.from_pretrained(name)
        except (OSError, ValueError) as exc:
            raise _unloadable(name, exc) from None
        vocab.append(config.vocab_size)
        if vllm and getattr(config, draft_vocab.CONFIG_KEY, None):
            raise DistillSpecError(
                f"{name} has a draft vocabulary ({getattr(config, draft_vocab.CONFIG_KEY)} tokens): vLLM's draft_model "
                "drafts take none; set rollout.backend=hf and serve.backend=hf, or give vLLM its whole-vocabulary copy "
                "(distillspec.models.pretrained.whole_vocab_draft)"
            )
        lean = config.model_type in LEAN_MODEL_TYPES and not getattr(config, "sliding_window", None)
        for knob, how in (compile or {}).items():
            if how and (how is True or name == draft) and not lean:
                raise DistillSpecError(
                    f"{knob}={str(how).lower()}: {name} is a {config.model_type!r} model; compiled decoding runs "
                    f"{', '.join(LEAN_MODEL_TYPES)} models with full attention: set {knob}=false"
                )
    for knob, how in (compile or {}).items():
        if how and (missing := compiler_missing()):
            raise DistillSpecError(f"{knob}={str(how).lower()}: {missing}: install one, or set {knob}=false")
    check_tokenizers(*tokenizers)
    if vocab[0] != vocab[1]:
        raise DistillSpecError(
            f"draft vocab {vocab[1]} != target vocab {vocab[0]}: the draft and target must share one tokenizer"
        )


#: ``dtype=auto`` runs a target in bfloat16 (where the device computes it natively) from this many bytes of float32
#: weights on: a larger model's decoding step is bound by reading its weights, which bfloat16 halves, and on such
#: hardware a few more rows (a verification) cost about what one does; a smaller one is bound by per-call costs,
#: which bfloat16 does not lower (the garden, SmolLM2-135M).
AUTO_BF16_BYTES = 1 << 30


def _safetensors(name: str) -> list[Path]:
    """A local model folder's safetensors files, in order; none for a hub id or a folder without them."""
    path = Path(name).expanduser()
    return sorted(path.glob("*.safetensors")) if path.is_dir() else []


def file_weights(name: str) -> Callable[[str], torch.Tensor | None] | None:
    """A reader of a local model folder's safetensors weights as they are stored (a parameter's name -> its tensor,
    widened to float32; None for a name it lacks), one at a time; None for a hub id or a folder without them."""
    files = _safetensors(name)
    if not files:
        return None
    where = {}
    for file in files:
        with safetensors.safe_open(file, "pt") as weights:
            where |= dict.fromkeys(weights.keys(), file)

    def read(key: str) -> torch.Tensor | None:
        if key not in where:
            return None
        with safetensors.safe_open(where[key], "pt") as weights:
            return weights.get_tensor(key).float()

    return read


def _weight_bytes(target: str) -> int | None:
    """Bytes of a local model folder's safetensors weights (None for a hub id or a folder without them)."""
    files = _safetensors(target)
    return sum(f.stat().st_size for f in files) if files else None


def resolve_dtype(dtype: str, target: str, device: str = "cpu") -> tuple[str, str]:
    """The concrete dtype that ``dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``) names for the pair whose
    target is the local folder or hub id ``target`` on ``device``, and why (one line for the console)."""
    if dtype != "auto":
        return dtype, "set by dtype"
    if not native_bf16(device):
        return "float32", f"auto: {torch.device(device).type} without native bfloat16"
    size = _weight_bytes(target)
    if size is not None and size < AUTO_BF16_BYTES:
        return "float32", f"auto: {size / 1e9:.2f} GB of weights, too small to be bound by reading them"
    return "bfloat16", f"auto: native bfloat16 on {torch.device(device).type}, a weight-bound target"


def resolve_prepack(prepack: bool | str, dtype: str, target: str, device: str = "cpu") -> tuple[bool | str, str]:
    """Whether the frozen target's linear weights are laid out for few-row products (:func:`prepack_linears`) for
    ``prepack`` (``auto``, true, false, ``bfloat16``, ``int4``, ``int4-int8``) with the resolved ``dtype``, and why.
    ``auto`` lays out a target on a CPU that is bound by reading its weights (as :data:`AUTO_BF16_BYTES` defines
    it): ``int4`` where the few-row kernel's 4-bit products run and it takes the dtype's other layers (float32;
    bfloat16 with AVX512-BF16), else a float32 one for the few-row kernel or oneDNN
    (:class:`~distillspec.models.packing.PackedLinear`), a bfloat16 one as matrix-vector products where the CPU has
    AMX (where they were measured to pay; without AMX they took 1.4-2.2x the plain product's). ``bfloat16`` (a
    float32 target on a CPU where the few-row kernel runs, else an error) comes back as it is: the weights rounded to
    bfloat16 for that kernel; so does ``int4`` (a float32 or bfloat16 target where the 4-bit products run, else an
    error): :func:`load_model` holds its layers on 4-bit grids in 4 bits
    (:class:`~distillspec.models.packing.Int4Linear`), a float32 target's on 6-bit grids in 6 bits
    (:class:`~distillspec.models.packing.Int6Linear`), the rest as ``true`` lays them out, a float32 target's in
    bfloat16 as ``bfloat16`` rounds them; so does ``int4-int8``, which holds every layer off the 4-bit grids in int8
    (a scale per output row: :class:`~distillspec.models.packing.PackedLinear`), the target further from its file's
    model."""
    if prepack is False:
        return False, "set by prepack"
    kind = torch.device(device).type
    if prepack in INT4_PREPACKS:
        if kind != "cpu" or dtype not in ("float32", "bfloat16") or not few_rows.int4():
            why = f"dtype={dtype} on {kind}" if kind != "cpu" or dtype not in ("float32", "bfloat16") else None
            why = why or few_rows.missing() or f"{few_rows.INT4_SWITCH}=0"
            raise DistillSpecError(
                f"prepack={prepack} holds a float32 or bfloat16 target's 4-bit layers for the few-row kernel on a "
                f"CPU; here {why}: set prepack=auto"
            )
        return prepack, "set by prepack"
    if prepack == "bfloat16":
        if kind != "cpu" or dtype != "float32" or few_rows.missing():
            why = f"dtype={dtype} on {kind}" if kind != "cpu" or dtype != "float32" else few_rows.missing()
            raise DistillSpecError(
                f"prepack=bfloat16 holds a float32 target's weights in bfloat16 for the few-row kernel on a CPU; "
                f"here {why}: set prepack=auto"
            )
        return "bfloat16", "set by prepack"
    if kind != "cpu" or dtype not in ("float32", "bfloat16") or (dtype == "float32" and not can_prepack(device)):
        if prepack is True:
            raise DistillSpecError(
                f"prepack=true lays a CPU's float32 or bfloat16 weights out for few-row products; here dtype={dtype} "
                f"on {kind}{'' if kind != 'cpu' or dtype != 'float32' else ' without oneDNN'}: set prepack=auto"
            )
        return False, f"auto: {dtype} on {kind} needs no packing"
    if prepack is True:
        return True, "set by prepack"
    size = _weight_bytes(target)
    if size is not None and size < AUTO_BF16_BYTES:
        return False, f"auto: {size / 1e9:.2f} GB of weights, bound by per-call costs"
    if few_rows.int4() and (dtype == "float32" or few_rows.bf16_rows()):
        rows = "bfloat16 rows (AVX512-BF16)" if dtype == "bfloat16" else "AVX2"
        return "int4", f"auto: a weight-bound {dtype} target on a CPU where the few-row kernel runs, with {rows}"
    if dtype == "bfloat16":
        if few_rows.bf16_rows():
            return True, "auto: a weight-bound bfloat16 target on a CPU with AVX512-BF16, for the few-row kernel"
        if not cpu_has("amx_tile"):
            return False, "auto: bfloat16 on a CPU without AMX, where matrix-vector products ran slower"
        return True, "auto: a weight-bound bfloat16 target on a CPU with AMX"
    return True, "auto: a weight-bound float32 target on a CPU"


#: ``draft_int8=auto`` decodes a draft on a CPU with int8 weights from this many parameters on (1 GB of float32, the
#: size from which ``dtype=auto`` counts a target as bound by reading its weights). A drafting step of such a draft
#: reads its weights, which int8 shrinks to a quarter of float32's bytes and half of bfloat16's: with the Qwen2.5-Coder
#: 0.5B (630M parameters) beside its 1.5B, fbgemm's int8 draft raced 1.8-1.9x the target alone where the float32
#: draft raced 1.05-1.12x (AVX2), and 2.42x / 1.89x at T = 0 / 1 where the bfloat16 draft raced 1.50x / 1.34x (AMX,
#: docs/MEASUREMENTS.md). A smaller draft is bound by per-call costs, which int8 does not lower (the garden's drafts,
#: layer drafts of SmolLM2-135M).
AUTO_INT8_PARAMETERS = AUTO_BF16_BYTES // 4

#: The kernels of a quantized draft by name (as benchmarks label them), each the ``draft_int8`` value that decodes
#: through it.
INT8_KERNELS: dict[str, DraftInt8] = {"weight-only": True, "fbgemm": "fbgemm", "int4": "int4"}


def int8_kernels() -> dict[str, DraftInt8]:
    """:data:`INT8_KERNELS` that this build of torch has (fbgemm: x86; int4: torch's CPU kernel for 4-bit weights)."""
    have = {"weight-only": True, "fbgemm": fbgemm_available(), "int4": int4_available()}
    return {name: value for name, value in INT8_KERNELS.items() if have[name]}


def parameter_count(model: str | torch.nn.Module) -> int | None:
    """The parameters of a loaded model, or of a local model folder's safetensors weights (read from their headers);
    None for a hub id or a folder without them."""
    if isinstance(model, torch.nn.Module):
        return sum(p.numel() for p in model.parameters())
    files = _safetensors(model)
    if not files:
        return None
    count = 0
    for file in files:
        with safetensors.safe_open(file, "pt") as weights:
            count += sum(int(np.prod(weights.get_slice(key).get_shape())) for key in weights.keys())
    return count


def resolve_draft_int8(
    draft_int8: DraftInt8, parameters: int | None, device: str = "cpu", *, vllm: bool = False
) -> tuple[DraftInt8, str]:
    """The int8 kernel (false, true: weight-only, ``fbgemm``, ``int4``) that ``draft_int8`` names for a decoding draft
    of ``parameters`` (None: unknown, counted as large) on ``device``, and why (one line for the console). ``auto``: on
    a CPU, a draft of :data:`AUTO_INT8_PARAMETERS` or more decodes with int8 weights: its steps through 4-bit weights
    where torch's kernels run at AVX-512 (``int4``, :func:`cpu_avx512`: the 0.5B Qwen draft's step 0.6-0.8x fbgemm's
    with or without AMX, speculative decoding 1.91x / 1.80x the target alone at T = 0 / 1 against 1.74x / 1.45x with
    AMX; at AVX2 torch's step took 1.3x fbgemm's); else 4-bit steps through the few-row kernel where it runs (AVX2:
    on a Zen 3 CPU the 0.5B Qwen draft's step 23 ms against the weight-only int8 one's 35, speculative decoding
    10.13 / 9.81 tokens/s at T = 0 / 1 against 9.03 / 9.17), else weight-only int8 through it (its step 0.82x
    fbgemm's there), else through fbgemm's int8 GEMM (weight-only int8 where this build of torch has no fbgemm); a
    smaller draft, one on a GPU, or one a vLLM engine decodes (``vllm``), in the pair's dtype."""
    if draft_int8 != "auto":
        return draft_int8, "set by draft_int8"
    if vllm:
        return False, "auto: vLLM's drafts load the draft's own weights"
    kind = torch.device(device).type
    if kind != "cpu":
        return False, f"auto: the draft decodes on {kind} in the pair's dtype"
    if parameters is not None and parameters < AUTO_INT8_PARAMETERS:
        return False, f"auto: {parameters / 1e6:.3g}M parameters, bound by per-call costs"
    if fbgemm_available() and int4_available() and cpu_avx512():
        return "int4", "auto: a weight-bound draft on a CPU whose kernels run AVX-512, where 4-bit steps paid"
    if few_rows.int4() and int4_available():
        return "int4", "auto: a weight-bound draft on a CPU with AVX2, its 4-bit steps through the few-row kernel"
    if few_rows.available():
        return True, "auto: a weight-bound draft on a CPU with AVX2, its steps through the few-row kernel"
    if fbgemm_available():
        return "fbgemm", "auto: a weight-bound draft on a CPU"
    return True, "auto: a weight-bound draft on a CPU whose torch has no fbgemm"


def quantize_decoding_draft(model: PreTrainedModel, int8: DraftInt8, fuse: bool = True) -> PreTrainedModel:
    """``model``, a draft that only decodes, with int8 weights where ``int8`` (``draft_int8``, ``auto`` resolved by
    :func:`resolve_draft_int8` for it) says: :func:`~distillspec.models.packing.quantize_int8`, through fbgemm's int8
    GEMM if ``fbgemm``; with ``true`` its steps weight-only, with ``int4`` through 4-bit weights, and for both its
    prompts through fbgemm where torch has it (on a CPU);
    with ``fuse`` (the default; off for a benchmark's comparison), sibling products of one input as one."""
    if int8 == "auto":
        int8 = resolve_draft_int8(int8, parameter_count(model), str(next(model.parameters()).device))[0]
    if int8:
        on_cpu = next(model.parameters()).device.type == "cpu"  # weight-only and int4: prompts through fbgemm
        fbgemm = int8 == "fbgemm" or (int8 in (True, "int4") and fbgemm_available() and on_cpu)
        quantize_int8(model, fbgemm=fbgemm, int4=int8 == "int4", fuse=fuse, weight_only_steps=int8 is True)
        release_memory()
    return model


def decoding_copy(draft: PreTrainedModel, dtype: torch.dtype, int8: DraftInt8) -> PreTrainedModel:
    """A copy of ``draft`` (one that trains, in float32) as the decoders run it beside a target: in the pair's
    ``dtype``, with int8 weights where ``int8`` (``draft_int8``) says (:func:`quantize_decoding_draft`)."""
    return quantize_decoding_draft(copy.deepcopy(draft).to(dtype), int8)


def load_pair(
    target: str,
    draft: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    decode_only: bool = False,
    prepack: bool | str = "auto",
    draft_int8: DraftInt8 = False,
    shared_target: SharedWeights | None = None,
) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """The target in ``dtype`` (it is frozen; ``auto``: :func:`resolve_dtype`), its weights prepacked as ``prepack``
    says (:func:`resolve_prepack`), and the draft in float32, to be trained, or in ``dtype`` too where it only decodes
    (``decode_only``), then with int8 weights if ``draft_int8`` (:func:`~distillspec.models.packing.quantize_int8`,
    through fbgemm's int8 GEMM if ``fbgemm``);
    checked to share a tokenizer. ``shared_target``: the target's weights shared on this node (:func:`load_model`)."""
    if dtype == "auto":
        dtype = resolve_dtype(dtype, target, device)[0]
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    prepack = resolve_prepack(prepack, str(dtype).removeprefix("torch."), target, device)[0]
    if torch.device(device).type == "cpu" and not native_half(dtype):
        log.warning(
            "dtype=%s on a CPU that has no hardware for it (AVX512-BF16, AMX): the pair runs several times slower "
            "than in float32; set dtype=float32 (or auto)",
            str(dtype).removeprefix("torch."),
        )
    if draft_int8 in (True, "fbgemm", "int4") and not decode_only:
        raise DistillSpecError("draft_int8=true quantizes a draft that only decodes; the draft that trains stays float")
    target_model, target_tok = load_model(target, device=device, dtype=dtype, prepack=prepack, shared=shared_target)
    if decode_only:
        draft_model, draft_tok = load_decoding_draft(draft, device=device, dtype=dtype, int8=draft_int8)
    else:
        draft_model, draft_tok = load_model(draft, device=device, dtype=torch.float32)
    check_tokenizers(target_tok, draft_tok)
    check_pair(target_model, draft_model)
    return target_model, draft_model, target_tok


def load_decoding_draft(
    draft: str, *, device: str, dtype: torch.dtype, int8: DraftInt8
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """:func:`load_model` of a draft as the decoders run it beside a target: in the target's ``dtype``, with int8
    weights where ``int8`` (``draft_int8``) says (:func:`quantize_decoding_draft`)."""
    model, tokenizer = load_model(draft, device=device, dtype=dtype)
    return quantize_decoding_draft(model, int8), tokenizer


def load_decoding_pair(
    models: Models, draft: str | None = None, shared_target: SharedWeights | None = None
) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """The pair as the evaluator, the job's measurements and the endpoint decode it: :func:`load_pair` of ``models``
    (``draft`` instead of its draft, if given) with the draft in the pair's dtype, int8 if ``models.draft_int8``;
    ``shared_target`` as :func:`load_pair` takes it."""
    return load_pair(
        models.target,
        draft or models.draft,
        device=models.device,
        dtype=models.dtype,
        decode_only=True,
        prepack=models.prepack,
        draft_int8=models.draft_int8,
        shared_target=shared_target,
    )


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_len: int | None = None
) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and attention mask (the layout the decoders take) of :func:`prompt_ids` of each prompt
    (its last ``max_len`` tokens, if given)."""
    ids = [prompt_ids(tokenizer, p) for p in prompts]
    if max_len is not None:
        ids = [x[-max_len:] for x in ids]
    return pad_prompts(ids, tokenizer.pad_token_id)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The token ids of ``prompt`` as the decoders read it: with the special tokens the model's own tokenizer adds
    (a BOS token where it is configured to add one, as transformers and vLLM tokenize a prompt), the BOS token not
    doubled where the text already starts with it (a chat template that writes it). A tokenizer that declares a BOS
    token but does not add it (a GGUF file's ``tokenizer.ggml.add_bos_token`` false: Qwen2.5's, SmolLM2's) gets
    none: the model reads its prompts as it was trained to."""
    ids = tokenizer(prompt)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids[1:] if bos is not None and ids[:2] == [bos, bos] and prompt.startswith(tokenizer.bos_token) else ids


def pad_prompts(ids: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Prompts' token ids left-padded with ``pad`` into one tensor, and their attention mask."""
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return input_ids, mask


def decode_new(tokenizer: PreTrainedTokenizerBase, sequences: Tensor, prompt_len: int, num_new: Tensor) -> list[str]:
    return [
        tokenizer.decode(seq[prompt_len : prompt_len + int(n)], skip_special_tokens=True)
        for seq, n in zip(sequences, num_new)
    ]
