"""KV-cache bookkeeping for the decoders, in one place: :class:`CachedLM`.

Rows of a batch may hold *holes*: rejected draft positions (and left padding) stay in the cache with
attention-mask 0 and are never re-run, and every row keeps its own position counter, so each row accepts
its own number of tokens and stays exact.

Two ways to run the model behind the same bookkeeping:

- **lean** (Llama, Mistral and Qwen2 models, the default where it applies): one preallocated key/value
  tensor per model, written in place, and a forward pass over the model's own modules (its norms,
  projections, rotary embedding and MLP) with one ``scaled_dot_product_attention`` per layer
  (:func:`attention`), in the manner of gpt-fast. It gives the same logits as the model's ``forward`` and
  skips the per-call cost of building masks and cache objects, which dominates batch-1 decoding of small
  models. On an x86 CPU a call of up to :data:`KERNEL_QUERIES` new tokens a row (a decoding step, a
  verification) takes each layer's rotary embedding, cache writes and attention in one call of the project's
  kernel (:func:`~distillspec.models.few_rows.cached_attention`), and each residual sum with the norm after it
  in another (:func:`~distillspec.models.few_rows.add_rms_norm`), where torch takes tens of small operators a
  layer: on 2 cores of an AMD EPYC the 0.5B Qwen draft's 4-bit step took 0.71x the time through torch's operators,
  the 1.5B target's verification of 6 tokens on 1,024 cached tokens 0.85x (docs/MEASUREMENTS.md). Where the kernel
  takes every product of the layers (:func:`_step_layers`), the layers run in one call of it, without a Python call
  between those calls: the draft's step 0.87x, the target's 0.93-0.95x.
- **hf**: the model's ``forward`` with a ``DynamicCache``, for every other architecture.

A lean model may also be **compiled** (``compile=True``): its decoding steps (not the prompt) run through
``torch.compile``, attending over the whole preallocated cache with the validity mask, as gpt-fast does. That
removes the per-operator dispatch cost that dominates a small draft's one-token steps (on this project's CPU garden
drafts, 0.43 -> 0.22 ms a step; the 0.5B Qwen draft's int8 step on a 2-core CPU, 30.5 -> 24.9 ms, before the
kernel's eager steps, which are now the faster on an x86 CPU: 7.0 ms eager against 12.8 compiled). On a GPU each
new (batch, tokens, capacity) shape compiles once; on a CPU the batch and the capacity are dynamic sizes, so a step
of one or two new tokens compiles once for a batch of one and once for larger ones (the 0.5B Qwen draft's four: 210 s
on 2 cores).
On a CUDA GPU the compiled steps are also replayed as CUDA graphs (:class:`CudaGraphs`), captured once per shape and
cache: there an eager step is bound by its kernel launches (on an H200, a step of a 1.5B model took 33 ms eager and
3.9 ms replayed as a graph; the GPU suite, ``benchmarks/suites/gpu.py``, times both).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable

import torch
import torch._inductor.runtime.cache_dir_utils as torch_cache_dirs
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from distillspec.decoding.prompt_cache import PromptCache
from distillspec.errors import DistillSpecError
from distillspec.files import cache_root
from distillspec.models import few_rows
from distillspec.models.packing import FUSED_PARTS, FusedLinear

#: Architectures whose decoder layer is ``h + attn(norm(h))``, ``h + mlp(norm(h))`` with rotary q/k.
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2")


def supports_lean(model: PreTrainedModel) -> bool:
    """Whether :class:`CachedLM` can run ``model`` on its own preallocated cache."""
    cfg = model.config
    inner = getattr(model, "model", None)
    return (
        cfg.model_type in LEAN_MODEL_TYPES
        and getattr(cfg, "sliding_window", None) is None
        and all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or []))
        and inner is not None
        and hasattr(inner, "rotary_emb")
        and _rope(model) is not None
    )


def _rope(model: PreTrainedModel):
    """The model's own rotary function: its modeling module's ``apply_rotary_pos_emb`` (None if it has none)."""
    return getattr(sys.modules[type(model.model.layers[0].self_attn).__module__], "apply_rotary_pos_emb", None)


def _lean_layers(
    model: PreTrainedModel, h: Tensor, positions: Tensor, attend, products: list[LayerProducts] | None = None
) -> Tensor:
    """The decoder layers of a lean model on hidden states ``h`` [B, k, D]; ``attend(i, q, key, value, cos, sin)``
    takes layer ``i``'s projections [B, k, heads * head_dim] (not yet rotated) and the rotary ``cos`` and ``sin``,
    stores the new keys and values in the cache and returns the attention output [B, k, heads * head_dim]. With
    ``products`` (a step through the project's CPU kernel: :func:`_step_products`) each layer's products are those
    and each residual sum and the norm after it one call of the kernel (:func:`few_rows.add_rms_norm`); else the
    model's own modules."""
    inner = model.model
    cos, sin = inner.rotary_emb(h, positions)
    kernel = products is not None
    pending = None  # the last layer's MLP output, not yet added to h
    for i, layer in enumerate(inner.layers):
        qkv, o_proj, gate_up, down_proj = products[i] if kernel else _module_products(layer)
        h, x = _residual_norm(layer.input_layernorm, h, pending, kernel)
        q, key, value = qkv(x)
        h, x = _residual_norm(layer.post_attention_layernorm, h, o_proj(attend(i, q, key, value, cos, sin)), kernel)
        if gate_up is None:  # the model's own MLP
            pending = layer.mlp(x)
        else:
            gate, up = gate_up(x)
            pending = down_proj(layer.mlp.act_fn(gate) * up)
    return h if pending is None else h + pending


#: A decoder layer's products as :func:`_lean_layers` calls them: ``qkv(x) -> (q, key, value)``, ``o_proj``,
#: ``gate_up(x) -> (gate, up)`` (None: the layer's MLP is called whole) and ``down_proj``.
LayerProducts = tuple[Callable, Callable, Callable | None, Callable | None]


def _module_products(layer: torch.nn.Module) -> LayerProducts:
    """A decoder layer's products as its modules compute them (sibling products fused where the model was)."""
    attn, mlp = layer.self_attn, layer.mlp
    fused = getattr(attn, "qkv_proj", None)  # q, k and v as one product (packing.FusedLinear), if fused
    qkv = fused or (lambda x: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)))
    gate_up = getattr(mlp, "gate_up_proj", None)  # gate and up as one product, if fused
    return qkv, attn.o_proj, gate_up, mlp.down_proj if gate_up is not None else None


def _step_products(model: PreTrainedModel) -> list[LayerProducts]:
    """Each decoder layer's products for an eager step through the project's CPU kernel: each linear layer's own
    ``step_forward`` where it has one (``PackedLinear``, ``Int8Linear``: the kernel's product without the module call
    and ``forward``'s other cases; the 0.5B Qwen draft's 4-bit step took 0.96x the time of its modules' calls), else
    the layer itself; sibling products fused where the model was, else one call each."""

    def product(linear: torch.nn.Module) -> Callable:
        return getattr(linear, "step_forward", linear)

    def siblings(module: torch.nn.Module, fused: str) -> Callable:
        linears, sizes = _siblings(module, fused)
        if sizes:
            linear = product(linears[0])
            return lambda x: linear(x).split(sizes, -1)
        each = [product(linear) for linear in linears]
        return lambda x: tuple(p(x) for p in each)

    return [
        (
            siblings(layer.self_attn, "qkv_proj"),
            product(layer.self_attn.o_proj),
            siblings(layer.mlp, "gate_up_proj"),
            product(layer.mlp.down_proj),
        )
        for layer in model.model.layers
    ]


def _siblings(module: torch.nn.Module, fused: str) -> tuple[list[torch.nn.Module], list[int]]:
    """The linear layers of ``module``'s sibling products ``fused`` (``qkv_proj``, ``gate_up_proj``) and how one product
    splits: the fused product and its parts' sizes where the model fused them (:class:`FusedLinear`), else each part
    and no sizes."""
    if isinstance(whole := getattr(module, fused, None), FusedLinear):
        return [whole.linear], whole.sizes
    return [getattr(module, name) for name in FUSED_PARTS[fused]], []


def _step_layers(model: PreTrainedModel) -> tuple[object, int] | None:
    """A lean model's decoder layers for an eager step through the project's CPU kernel in one call
    (:func:`few_rows.step_layers`: :func:`_lean_layers` with :func:`_step_products`, without a Python call between
    the kernel's calls) and the most rows (batch x new tokens) it takes; None where a layer's products are not all
    the kernel's (``step_product``) or its MLP is not SiLU's."""
    if getattr(model.config, "hidden_act", None) != "silu":
        return None
    limits = []

    def product(linear: torch.nn.Module):
        step = getattr(linear, "step_product", lambda: None)()
        limits.append(step[1] if step is not None else 0)
        return None if step is None else step[0]

    def siblings(module: torch.nn.Module, fused: str) -> tuple[list, list[int]]:
        linears, sizes = _siblings(module, fused)
        return [product(linear) for linear in linears], sizes

    layers = [
        {
            "input_norm": layer.input_layernorm.weight,
            "input_eps": layer.input_layernorm.variance_epsilon,
            "qkv": siblings(layer.self_attn, "qkv_proj"),
            "o": product(layer.self_attn.o_proj),
            "post_norm": layer.post_attention_layernorm.weight,
            "post_eps": layer.post_attention_layernorm.variance_epsilon,
            "gate_up": siblings(layer.mlp, "gate_up_proj"),
            "down": product(layer.mlp.down_proj),
            "scale": layer.self_attn.scaling,
        }
        for layer in model.model.layers
    ]
    if min(limits) == 0:
        return None
    return few_rows.step_layers(layers), min(limits)


def _residual_norm(norm: torch.nn.Module, h: Tensor, delta: Tensor | None, kernel: bool) -> tuple[Tensor, Tensor]:
    """``h + delta`` (``delta`` None: ``h``) and ``norm`` of it; with ``kernel``, in one call of the CPU kernel."""
    if kernel:
        return few_rows.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
    h = h if delta is None else h + delta
    return h, norm(h)


def _heads(rope, head_dim: int, q: Tensor, key: Tensor, value: Tensor, cos: Tensor, sin: Tensor):
    """Projections [B, k, n * head_dim] as heads [B, n, k, head_dim], ``q`` and ``key`` rotated by the model's own
    ``rope``."""
    batch, k = q.shape[:2]
    q, key, value = (x.view(batch, k, -1, head_dim).transpose(1, 2) for x in (q, key, value))
    q, key = rope(q, key, cos, sin)
    return q, key, value


def _merged(o: Tensor) -> Tensor:
    """Attention output heads [B, heads, k, head_dim] as o_proj's input [B, k, heads * head_dim]."""
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)


#: A step or verification of up to this many new tokens a row runs its attention (one call a layer: the rotary
#: embedding, the cache's writes and the attention, :func:`few_rows.cached_attention`) and its residual sums and norms
#: through the project's CPU kernel; more (a prompt) through torch's operators.
KERNEL_QUERIES = 16


def _kernel_steps(model: PreTrainedModel) -> bool:
    """Whether a lean ``model``'s steps (up to :data:`KERNEL_QUERIES` new tokens a row) run their attention and norms
    through the project's CPU kernel (:func:`few_rows.cached_attention`, :func:`few_rows.add_rms_norm`) here: a CPU
    model in float32 or bfloat16, its norms the Llama-like RMSNorm in that dtype, head_dim a multiple of 8, the
    kernel built (``DISTILLSPEC_FEW_ROWS`` not ``0``)."""
    inner = model.model
    dtype = inner.embed_tokens.weight.dtype  # the cache's
    norms = [inner.norm] + [
        n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    return (
        model.device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and inner.layers[0].self_attn.head_dim % 8 == 0
        and all(
            type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") and n.weight.dtype == dtype
            for n in norms
        )
        and few_rows.available()
    )


def attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    """Attention of queries ``q`` [B, heads, k, head_dim] over ``keys`` and ``values`` [B, kv_heads, cols, head_dim]
    where ``visible`` [B, 1, k, cols] holds, or causally (None: ``k == cols``, the queries the keys' own); through
    ``scaled_dot_product_attention``, each key/value head serving its group of query heads (an eager step on an x86
    CPU takes the project's kernel instead, :func:`~distillspec.models.few_rows.cached_attention`; compiled steps,
    prompts and other devices take this one).

    One bfloat16 query on a CPU (a decoding step) is taken in float32: torch's bfloat16 kernel is slow for a single
    query, and slower the longer the cache. On 2 cores of an AMD EPYC, a layer of the 1.5B Qwen target (12 heads of
    128) took 50 us against 189 on 192 cached tokens and 268 against 1,993 on 2,000; the model's cached step on 1,024
    tokens 49 ms against 74, the 0.5B draft's 16 against 28. From two queries on (a verification, a prompt) the two
    kernels take about as long, and the bfloat16 one stays. (So a bfloat16 target scores a position a little
    differently in a step than in a verification, as its products already did: greedy speculative decoding can leave
    the target alone's text at a near tie.)"""
    upcast = q.shape[2] == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu"
    if upcast:
        q, keys, values = q.float(), keys.float(), values.float()
    out = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=visible,
        is_causal=visible is None,
        scale=scale,
        enable_gqa=keys.shape[1] != q.shape[1],
    )
    return out.to(torch.bfloat16) if upcast else out


def _visibility(mask: Tensor, own: Tensor) -> Tensor:
    """Attention mask [B, 1, k, cols]: query i, at cache column ``own[i]``, sees the valid columns of ``mask``
    [B, cols] up to its own, and always itself, so that a hole's or a pad's query has one finite score (its output
    is never used)."""
    cols = torch.arange(mask.shape[1], device=mask.device)
    return ((mask.bool()[:, None, :] & (cols <= own[:, None])) | (cols == own[:, None]))[:, None]


def bucketed_capacity(length: int, bucket: int = 128) -> int:
    """A cache capacity for ``length`` columns, rounded up to ``bucket``, so that a compiled step's shapes repeat
    across calls of similar length."""
    return -(-length // bucket) * bucket


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: ``step(keys, values, tokens, positions, start, mask) -> logits``: see :func:`static_step`.
StaticStep = Callable[[list[Tensor], list[Tensor], Tensor, Tensor, Tensor, Tensor], Tensor]


def static_step(model: PreTrainedModel) -> StaticStep:
    """A decoding step at static shapes: the new tokens [B, k] go to cache columns ``start + arange(k)`` (``start``
    a 0-d tensor, so a compiled or captured step never depends on its value), and each query attends over the whole
    cache [B, capacity] where ``mask`` is 1, up to its own column, and itself."""
    rope, inner = _rope(model), model.model

    def step(keys: list[Tensor], values: list[Tensor], tokens: Tensor, positions: Tensor, start: Tensor, mask: Tensor):
        own = start + torch.arange(tokens.shape[1], device=tokens.device)
        visible = _visibility(mask, own)

        def attend(i: int, q: Tensor, key: Tensor, value: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            attn = inner.layers[i].self_attn
            q, key, value = _heads(rope, attn.head_dim, q, key, value, cos, sin)
            keys[i].index_copy_(2, own, key)
            values[i].index_copy_(2, own, value)
            return _merged(attention(q, keys[i], values[i], visible, attn.scaling))

        h = _lean_layers(model, inner.embed_tokens(tokens), positions, attend)
        return model.lm_head(inner.norm(h)).float()

    return step


#: Where torch keeps the kernels it compiles, unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: in the project cache.
COMPILE_CACHE = "inductor"


def compile_cache() -> str:
    """The folder of torch's compiled kernels (``TORCHINDUCTOR_CACHE_DIR``): the project cache's :data:`COMPILE_CACHE`
    folder, unless the user chose another. Torch's default is a folder of the system's temporary files, which many
    systems empty at boot: there a replica's compiled drafting steps took 208 s to compile on an empty cache and 42 s
    from a filled one (the 0.5B Qwen draft, 2 cores). In the project cache they outlive a reboot, and every job and
    replica on the machine finds them. Torch looks the folder up whenever it reads or writes a kernel, but importing
    ``torch._dynamo`` (transformers' models do) already sets the variable to torch's default: that value is taken as
    unset."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(torch_cache_dirs.default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / COMPILE_CACHE)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _compiled_step(model: PreTrainedModel) -> StaticStep:
    """:func:`static_step` through ``torch.compile``, once per model, its kernels cached in :func:`compile_cache`. On a
    GPU every shape compiles on its own (and is replayed as a CUDA graph); on a CPU the batch and the cache's capacity
    are dynamic sizes (:func:`_dynamic`), so one compiled step takes every cache length and every batch from 2 on (a
    batch of 1 compiles a step of its own): a server compiles four steps (one or two new tokens, one or more rows),
    not one per prompt length. A copy of the model (a new draft version) reuses what was compiled."""
    if model not in _COMPILED:
        compile_cache()
        # Every model's step shares one code object, and dynamo keeps at most ``recompile_limit`` compiled
        # versions of a code object (8 by default) before falling back to eager: 2-3 shapes a model would
        # exhaust it after a few models, so allow more.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED[model] = torch.compile(static_step(model), dynamic=None if model.device.type == "cpu" else False)
    return _COMPILED[model]


def _dynamic(tensor: Tensor, *dims: int) -> Tensor:
    """``tensor`` with ``dims`` marked as dynamic sizes for a compiled step on a CPU (a GPU's steps keep static shapes
    for their CUDA graphs)."""
    if tensor.device.type == "cpu":
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


class CudaGraphs:
    """A :data:`StaticStep` replayed as CUDA graphs, one captured per shape and cache (as gpt-fast and vLLM do): at
    batch 1 a step's hundreds of kernel launches cost more CPU time than its GPU work on models up to a few billion
    parameters; a replay launches them all at once. The inputs are copied into the graph's own, the logits copied
    out (the next replay overwrites them). A graph holds the cache tensors' addresses: a cache that grew or lost rows
    is a new cache, captured anew; at most ``limit`` graphs are kept (the oldest dropped)."""

    def __init__(self, step: StaticStep, limit: int = 32) -> None:
        self.step, self.limit = step, limit
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], Tensor]] = {}

    @torch.inference_mode()
    def __call__(
        self, keys: list[Tensor], values: list[Tensor], tokens: Tensor, positions: Tensor, start: Tensor, mask: Tensor
    ) -> Tensor:
        inputs = (tokens, positions, start, mask)
        key = (tuple(tokens.shape), tuple(mask.shape), *(x.data_ptr() for x in (*keys, *values)))
        if key not in self.graphs:
            static = [x.clone() for x in inputs]
            side = torch.cuda.Stream(device=tokens.device)
            side.wait_stream(torch.cuda.current_stream(tokens.device))
            with torch.cuda.stream(side):  # warm-up (and compilation) off the capture; it writes what the step writes
                self.step(keys, values, *static)
            torch.cuda.current_stream(tokens.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self.step(keys, values, *static)
            if len(self.graphs) >= self.limit:
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[key] = (graph, static, logits)
        graph, static, logits = self.graphs[key]
        for buffer, x in zip(static, inputs):
            buffer.copy_(x)
        graph.replay()
        return logits.clone()


class CachedLM:
    """A causal LM with a KV cache whose rows may hold holes (rejected positions).

    ``mask`` [B, cache_len] marks valid cache columns; ``next_pos`` [B] is each row's next position id.
    ``lean`` picks the forward pass (see the module docstring); None means lean where the model supports it.
    ``compile`` runs the decoding steps of a lean model compiled (on CUDA at static shapes, replayed as CUDA graphs;
    on a CPU with dynamic batch and capacity); ``capacity`` is the cache length to allocate at first (it doubles when
    outgrown, which costs a compiled model on CUDA one more compile).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        lean: bool | None = None,
        compile: bool = False,
        capacity: int = 64,
        prompts: PromptCache | None = None,
    ) -> None:
        if (lean or compile) and not supports_lean(model):
            raise DistillSpecError(
                f"{'compile' if compile else 'lean'}=True but model type {model.config.model_type!r} is not one of "
                f"{LEAN_MODEL_TYPES} with full attention: leave it unset to use the model's own forward"
            )
        if compile and lean is False:
            raise DistillSpecError("compile=True runs the lean forward: it cannot be combined with lean=False")
        self.model = model
        self.lean = supports_lean(model) if lean is None else lean
        self.compiled = _compiled_step(model) if compile else None
        #: on CUDA, the compiled decoding steps replayed as graphs (not a prompt: no shape of it repeats)
        self.graphs = CudaGraphs(self.compiled, limit=8) if compile and model.device.type == "cuda" else None
        self.capacity = capacity
        self.cache = None if self.lean else DynamicCache(config=model.config)
        self.rope = _rope(model) if self.lean else None
        #: eager steps through the project's CPU kernel (:func:`_kernel_steps`)
        self.kernel = self.lean and _kernel_steps(model)
        self.products: list[LayerProducts] | None = None  #: the layers' products in those steps, once looked up
        #: ... and the layers in one call of the kernel where it takes them all, with the most rows it takes
        #: (:func:`_step_layers`)
        self.layers: tuple[object, int] | None = None
        # lean: one [B, kv_heads, capacity, head_dim] tensor per layer (one tensor each, not slices of a stacked
        # one, so that a compiled step writes its columns in place instead of copying the whole cache)
        self.keys: list[Tensor] | None = None
        self.values: list[Tensor] | None = None
        self.mask: Tensor | None = None
        self.next_pos: Tensor | None = None
        self.calls = 0
        #: a lean model's first read (its prompts) takes the blocks this cache holds of them, and leaves theirs
        self.prompts = prompts if self.lean else None
        self.reused: Tensor | None = None  #: [B] the tokens of each row's first read taken from ``prompts``

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor, every: bool = False) -> Tensor:
        """Run the (left-padded) prompt; return the logits of its last position, [B, V] (``every``: of all its
        positions, [B, P, V]). With a prompt cache (and not ``every``), as a first :meth:`step`."""
        if self.prompts is not None and not every:
            self.mask, self.next_pos = (
                attention_mask.new_zeros(len(input_ids), 0),
                attention_mask.new_zeros(len(input_ids)),
            )
            return self.step(input_ids, attention_mask, last_only=True)[:, -1]
        self.mask = attention_mask.long()
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.next_pos = self.mask.sum(-1)
        logits = self._forward(input_ids, positions, last_only=not every)
        return logits if every else logits[:, -1]

    @torch.inference_mode()
    def step(self, tokens: Tensor, valid: Tensor | None = None, last_only: bool = False) -> Tensor:
        """Append ``tokens`` [B, k] (``valid`` marks real ones; others become holes); return logits [B, k, V] (with
        ``last_only``, [B, 1, V]: the output layer runs for the last column alone)."""
        valid = torch.ones_like(tokens) if valid is None else valid.long()
        if self.prompts is not None and last_only and self.mask is not None and self.mask.shape[1] == 0:
            return self._first_read(tokens, valid)
        positions = self.next_pos[:, None] + (valid.cumsum(-1) - 1).clamp(min=0)
        self.mask = valid if self.mask is None else torch.cat([self.mask, valid], dim=-1)
        self.next_pos = self.next_pos + valid.sum(-1)
        return self._forward(tokens, positions, last_only)

    def _first_read(self, tokens: Tensor, valid: Tensor) -> Tensor:
        """A first read (nothing in the cache yet) through the prompt cache: each row's first blocks that the cache
        holds are copied into its cache's first columns (a row that holds fewer: holes after them), the rest of each
        row is read as one step (right-aligned, holes before it), and the whole blocks read are left in the prompt
        cache. Returns the last position's logits [B, 1, V]."""
        cache, layers = self.prompts, self.model.model.layers
        rows = [row[ok.bool()].tolist() for row, ok in zip(tokens, valid)]
        found = [cache.find(self.model, row) for row in rows]
        held = [len(blocks) * cache.block for blocks in found]
        width, self.reused = max(held), torch.tensor(held, device=tokens.device)
        if width:
            self._reserve(width, len(rows), layers[0])
            for i, blocks in enumerate(found):
                if blocks:
                    keys, values = (torch.cat(parts, 2) for parts in zip(*blocks))
                    for layer in range(len(layers)):
                        self.keys[layer][i, :, : held[i]] = keys[layer]
                        self.values[layer][i, :, : held[i]] = values[layer]
            self.mask = torch.tensor([[1] * h + [0] * (width - h) for h in held], device=tokens.device)
            self.next_pos = torch.tensor(held, device=tokens.device)
            rest = [row[h:] for row, h in zip(rows, held)]
            span = max(len(r) for r in rest)
            tokens = torch.tensor([[0] * (span - len(r)) + r for r in rest], device=tokens.device)
            valid = torch.tensor([[0] * (span - len(r)) + [1] * len(r) for r in rest], device=tokens.device)
        cached, self.prompts = self.prompts, None  # (the step below reads as any step)
        try:
            logits = self.step(tokens, valid, last_only=True)
        finally:
            self.prompts = cached
        for i, row in enumerate(rows):
            whole = len(row) // cache.block * cache.block
            if whole > held[i]:
                columns = self.mask[i].nonzero().squeeze(1)[:whole]
                keys = torch.stack([k[i][:, columns] for k in self.keys])
                values = torch.stack([v[i][:, columns] for v in self.values])
                cache.add(self.model, row[:whole], keys, values, held=len(found[i]))
        return logits

    @torch.inference_mode()
    def reject_tail(self, n_rejected: Tensor) -> None:
        """Turn the last ``n_rejected[b]`` cache columns of each row into holes."""
        width = int(n_rejected.max()) if n_rejected.numel() else 0
        if width == 0:
            return
        cols = torch.arange(width, 0, -1, device=self.mask.device)  # distance from the end: width..1
        hole = cols[None, :] <= n_rejected[:, None]
        self.mask[:, -width:] = self.mask[:, -width:].masked_fill(hole, 0)
        self.next_pos = self.next_pos - n_rejected
        self._crop_common_tail()

    @torch.inference_mode()
    def select_rows(self, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch (finished rows leave the batch)."""
        if self.lean:
            if self.keys is not None:  # (None: nothing read yet)
                self.keys, self.values = ([self._cache_tensor(x[rows]) for x in xs] for xs in (self.keys, self.values))
        else:
            self.cache.batch_select_indices(rows)
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]
        self._crop_common_tail()

    def _crop_common_tail(self) -> None:
        valid_cols = self.mask.any(0).nonzero()
        keep = int(valid_cols[-1]) + 1 if len(valid_cols) else 0
        if keep < self.mask.shape[1]:
            if not self.lean:  # the lean cache just rewrites those columns next time
                self.cache.crop(keep - self.mask.shape[1])  # HF v5: a negative count removes tokens
            self.mask = self.mask[:, :keep]

    def _forward(self, tokens: Tensor, positions: Tensor, last_only: bool = False) -> Tensor:
        self.calls += 1
        if self.lean:
            return self._lean_forward(tokens, positions, last_only)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return out.logits.float()

    def _cache_tensor(self, x: Tensor) -> Tensor:
        """A cache tensor [B, kv_heads, capacity, head_dim], its batch and capacity dynamic sizes for compiled steps."""
        return _dynamic(x, 0, 2) if self.compiled is not None else x

    def _reserve(self, length: int, batch: int, layer) -> None:
        """Grow the preallocated cache (doubling) so it holds ``length`` columns."""
        cap = 0 if self.keys is None else self.keys[0].shape[2]
        if self.keys is not None and length <= cap:
            return
        attn, like = layer.self_attn, self.model.model.embed_tokens.weight  # (k_proj may be packed: no .weight)
        shape = (batch, attn.k_proj.out_features // attn.head_dim, max(length, 2 * cap, self.capacity), attn.head_dim)
        grown = []
        for old in (self.keys, self.values):
            new = [self._cache_tensor(like.new_zeros(shape)) for _ in self.model.model.layers]
            for n, o in zip(new, old or []):
                n[:, :, :cap] = o
            grown.append(new)
        self.keys, self.values = grown

    def _lean_forward(self, tokens: Tensor, positions: Tensor, last_only: bool) -> Tensor:
        inner = self.model.model
        batch, k = tokens.shape
        end = self.mask.shape[1]  # the new tokens are the last k cache columns
        start = end - k
        self._reserve(end, batch, inner.layers[0])
        if self.compiled is not None and not last_only:
            mask = self.mask.new_zeros(batch, self.keys[0].shape[2])
            mask[:, :end] = self.mask
            start_t = torch.tensor(start, device=tokens.device)
            step = self.graphs if self.graphs is not None and start > 0 else self.compiled
            if tokens.device.type == "cpu":  # (CUDA graphs copy their inputs into buffers of their own)
                # fresh tensors: a slice's strides (a row's length) would be guarded on as sizes of their own
                tokens, positions = (_dynamic(x.new_empty(x.shape).copy_(x), 0) for x in (tokens, positions))
            return step(self.keys, self.values, tokens, positions, start_t, _dynamic(mask, 0, 1))
        # A first call over a whole, unpadded batch (a prompt) sees causally: the fused kernel then skips the masked
        # half of its scores (a 1,536-token prompt's attention 0.63x the 1.5B Qwen target's with the mask, 0.56x the
        # 0.5B draft's, 2 cores)
        causal = start == 0 and bool(self.mask.all())
        kernel = self.kernel and k <= KERNEL_QUERIES
        visible = None if causal or kernel else _visibility(self.mask, start + torch.arange(k, device=tokens.device))

        def attend(i: int, q: Tensor, key: Tensor, value: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            attn = inner.layers[i].self_attn
            if kernel:
                keys, values = self.keys[i], self.values[i]
                return few_rows.cached_attention(q, key, value, cos, sin, keys, values, self.mask, start, attn.scaling)
            q, key, value = _heads(self.rope, attn.head_dim, q, key, value, cos, sin)
            self.keys[i][:, :, start:end], self.values[i][:, :, start:end] = key, value
            keys, values = self.keys[i][:, :, :end], self.values[i][:, :, :end]
            return _merged(attention(q, keys, values, visible, attn.scaling))

        if kernel and self.products is None:
            self.products, self.layers = _step_products(self.model), _step_layers(self.model)
        h = inner.embed_tokens(tokens)
        if kernel and self.layers is not None and batch * k <= self.layers[1]:  # the layers in one call
            cos, sin = inner.rotary_emb(h, positions)
            h = self.layers[0](h, cos, sin, self.keys, self.values, self.mask, start)
        else:
            h = _lean_layers(self.model, h, positions, attend, self.products if kernel else None)
        if last_only:
            h = h[:, -1:]
        return self.model.lm_head(_residual_norm(inner.norm, h, None, kernel)[1]).float()
