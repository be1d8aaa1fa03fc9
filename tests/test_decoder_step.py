"""A decoding step's attention and norms through the project's CPU kernel (distillspec/models/decoder_step.cpp): the
models' own rotary embedding, norms and attention, the cache's writes, holes and all."""

import sys

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

from distillspec.decoding import kvcache
from distillspec.decoding.kvcache import CachedLM
from distillspec.models import few_rows

from .conftest import on_4_bit_grids
from .test_kvcache import run, tiny_qwen2

pytestmark = pytest.mark.skipif(
    few_rows.unavailable_reason() is not None, reason="the few-row kernel does not run here"
)


def rotary(positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, k, head_dim] of ``positions`` [B, k], as a rotary embedding gives them."""
    inverse = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = positions[..., None].double() * inverse
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def reference(q, key, value, cos, sin, keys, values, mask, start, scale, head_dim):
    """The same call through the model's own rotary function and float64 attention; writes the cache as the kernel
    does."""
    batch, k = q.shape[:2]
    q, key, value = (x.view(batch, k, -1, head_dim).transpose(1, 2) for x in (q, key, value))
    q, key = apply_rotary_pos_emb(q, key, cos, sin)
    keys[:, :, start : start + k], values[:, :, start : start + k] = key, value
    own = start + torch.arange(k)
    cols = torch.arange(start + k)
    visible = ((mask.bool()[:, None, :] & (cols <= own[:, None])) | (cols == own[:, None]))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(),
        keys[:, :, : start + k].double(),
        values[:, :, : start + k].double(),
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(batch, k, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3, 9])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_cached_attention_is_the_models_rotary_embedding_and_attention(dtype, k, head_dim):
    """Grouped query heads (6 over 2), a batch of 3 with holes (a padded prompt's columns, a rejected one), 37 cached
    columns (not a multiple of the kernel's 8), heads of 16 and of 64 (bfloat16 scores through vdpbf16ps where the
    CPU has AVX512-BF16): the cache's new columns hold exactly the rotated keys and the values, the output is the
    float64 attention of the rounded inputs within the dtype's rounding."""
    torch.manual_seed(k)
    batch, heads, kv_heads, start, capacity = 3, 6, 2, 37, 64
    qkv = torch.randn(batch, k, (heads + 2 * kv_heads) * head_dim).to(dtype)  # one product's output, split
    q, key, value = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    cos, sin = rotary(start + torch.arange(k).expand(batch, k), head_dim, dtype)
    keys, values = (torch.randn(batch, kv_heads, capacity, head_dim).to(dtype) for _ in range(2))
    mask = torch.ones(batch, start + k, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, 20] = 0
    if k > 1:
        mask[1, start] = 0  # a new hole: its query still sees itself
    expected_keys, expected_values = keys.clone(), values.clone()
    with torch.inference_mode():
        exact = reference(q, key, value, cos, sin, expected_keys, expected_values, mask, start, 0.3, head_dim)
        out = few_rows.cached_attention(q, key, value, cos, sin, keys, values, mask, start, 0.3)
    assert out.dtype == dtype and out.shape == (batch, k, heads * head_dim)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verification_attends_each_position_as_a_step_does(dtype):
    """k new queries in one call give each query's output to the bit as k calls of one query do: a verification
    scores a position's attention as the target's own step scores it."""
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, start, k = 1, 4, 2, 32, 50, 4
    q, key, value = (torch.randn(batch, k, n * head_dim).to(dtype) for n in (heads, kv_heads, kv_heads))
    cos, sin = rotary(start + torch.arange(k)[None], head_dim, dtype)
    keys, values = (torch.randn(batch, kv_heads, 64, head_dim).to(dtype) for _ in range(2))
    mask = torch.ones(batch, start + k, dtype=torch.long)
    at_once = few_rows.cached_attention(q, key, value, cos, sin, keys.clone(), values.clone(), mask, start, 0.2)
    for i in range(k):
        one = few_rows.cached_attention(
            *(x[:, i : i + 1] for x in (q, key, value, cos, sin)),
            keys,
            values,
            mask[:, : start + i + 1],
            start + i,
            0.2,
        )
        assert torch.equal(one[:, 0], at_once[:, i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_sum_and_the_models_norm(dtype):
    torch.manual_seed(1)
    norm = Qwen2RMSNorm(40, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(40).to(dtype)
    h, delta = torch.randn(2, 3, 40).to(dtype) * 4, torch.randn(2, 3, 40).to(dtype)
    with torch.inference_mode():
        total, normed = few_rows.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
        assert torch.equal(total, h + delta) and not torch.equal(h, total)  # h itself is not written
        alone, normed_alone = few_rows.add_rms_norm(h, None, norm.weight, norm.variance_epsilon)
        assert alone is h
        for got, want in ((normed, norm(h + delta)), (normed_alone, norm(h))):
            assert got.dtype == dtype
            if dtype == torch.bfloat16:  # the sums of squares in another order, within float32's rounding
                torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
            else:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_caches_steps_through_the_kernel_are_torchs(dtype, monkeypatch):
    """The lean cache's calls (a padded prompt, steps with holes, a batch that drops a row) through the kernel give
    the logits of the same calls through torch's operators, on a model with grouped query heads and q/k/v biases."""
    model = tiny_qwen2().to(dtype)
    ids = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8], [0, 9, 10, 11, 12]])
    mask = (torch.arange(5) >= torch.tensor([2, 0, 1])[:, None]).long()
    kernel = CachedLM(model)
    assert kernel.kernel
    monkeypatch.setattr(kvcache, "_kernel_steps", lambda model: False)
    plain = CachedLM(model)
    assert not plain.kernel
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2

    def last(logits: torch.Tensor) -> torch.Tensor:
        # Only real tokens count: the hole's own query (row 0 and 2, first column of the third call) is discarded.
        return logits[..., -1, :] if logits.ndim == 3 else logits

    for ours, torchs in zip(run(kernel, ids, mask), run(plain, ids, mask)):
        torch.testing.assert_close(last(ours), last(torchs), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("draft_int8", [None, True, "int4", "target-int4", "target-int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_steps_layer_products_are_its_modules(draft_int8, dtype, monkeypatch):
    """The products of the lean cache's kernel steps (each linear layer's ``step_forward``: the kernel's product
    without the module call), and the layers in one call of the kernel (``few_rows.step_layers``), give the logits of
    the layers' own modules to the bit: a packed target, an int8 draft with weight-only steps, a 4-bit one, a target
    whose layers on 4-bit grids are held in 4 bits (``prepack=int4``; where each runs here), a target whose layers
    are held in int8 (as ``prepack=int4-int8`` holds those not in 4 bits), steps of one and of
    several tokens, and a batch whose rows exceed what the 4-bit kernel takes (the layer's forward, layer by
    layer)."""
    from distillspec.models.loading import int8_kernels, quantize_decoding_draft
    from distillspec.models.packing import INT4_FEW_ROWS, INT8_ROWS, grid_layouts, grid_linears, prepack_linears

    target = draft_int8 in (None, "target-int4", "target-int8")
    if draft_int8 in (True, "int4") and draft_int8 not in int8_kernels().values():
        pytest.skip(f"this build of torch has no kernel for draft_int8={draft_int8}")
    if draft_int8 == "target-int4" and not few_rows.int4():
        pytest.skip("a target's 4-bit layers take the few-row kernel's 4-bit products (x86 AVX2)")
    if target and dtype == torch.bfloat16 and not few_rows.bf16_rows() and draft_int8 != "target-int8":
        pytest.skip("a bfloat16 target's products take the few-row kernel with AVX512-BF16")
    model = tiny_qwen2()
    with torch.no_grad():
        for name, bias in model.named_parameters():
            if name.endswith(".bias"):  # (the model's own start at zero)
                bias.normal_(0, 0.5)
    if draft_int8 == "target-int4":  # its decoder layers on 4-bit grids, held in 4 bits
        assert grid_linears(model, dtype, grid_layouts(on_4_bit_grids(model))) == 2 * 7
    model.to(dtype)
    if target:
        prepack_linears(model, kernel="few_rows", weights=torch.int8 if draft_int8 == "target-int8" else None)
    else:
        quantize_decoding_draft(model, draft_int8)
    batch = INT4_FEW_ROWS // 2 + 1  # two tokens a row: more rows than 4-bit products take

    def calls(lm: CachedLM) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(20, (batch, 5), generator=generator)
        out = [lm.prefill(ids, torch.ones_like(ids)), lm.step(ids[:, :1]), lm.step(ids[:, 1:3])]
        lm.select_rows(torch.tensor([0, 1]))
        return [*out, lm.step(ids[:2, 3:5], torch.tensor([[0, 1], [1, 1]]))]

    layers, steps, modules = CachedLM(model), CachedLM(model), CachedLM(model)
    steps.products = kvcache._step_products(model)  # (given: the layers in one call are not looked up)
    modules.products = [kvcache._module_products(layer) for layer in model.model.layers]
    assert layers.kernel and steps.kernel and modules.kernel
    by_layer = []  # the calls of each cache that went layer by layer, by how many rows
    lean_layers = kvcache._lean_layers
    monkeypatch.setattr(
        kvcache, "_lean_layers", lambda model, h, *a: by_layer.append(h.shape[:2]) or lean_layers(model, h, *a)
    )
    ours = calls(layers)
    layered, by_layer[:] = list(by_layer), []
    for a, b, c in zip(ours, calls(steps), calls(modules), strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert steps.products[0][1] == model.model.layers[0].self_attn.o_proj.step_forward
    if draft_int8 == "int4" and not few_rows.int4():  # torch's 4-bit kernel: every call goes layer by layer
        assert layers.layers is None and len(layered) == 4
        return
    rows = layers.layers[1]
    # the calls of more rows than the layers' products take went layer by layer, the others in one call
    assert layered == [(b, k) for b, k in ((batch, 5), (batch, 1), (batch, 2), (2, 2)) if b * k > rows]
    assert rows == (INT4_FEW_ROWS if draft_int8 == "int4" else sys.maxsize if target else INT8_ROWS)
