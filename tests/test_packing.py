"""A target's weights laid out for few-row products (distillspec/models/packing.py: float32 for the few-row kernel
of distillspec/models/few_rows.py or prepacked for oneDNN, bfloat16 for that kernel or as matrix-vector products): the
same logits, exact speculative decoding, and the choice of when to lay them out
(distillspec.models.loading.resolve_prepack); and int8 drafts."""

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distillspec import DistillSpecError, speculative_generate
from distillspec.decoding import kvcache
from distillspec.decoding.kvcache import CachedLM
from distillspec.files import one_at_a_time
from distillspec.models import few_rows
from distillspec.models.loading import INT8_KERNELS, int8_kernels, load_pair, quantize_decoding_draft, resolve_prepack
from distillspec.models.packing import (
    FEW_ROWS,
    FewRowLinear,
    PackedLinear,
    can_prepack,
    prepack_linears,
    replace_linears,
)

from .conftest import needs_compiler, on_4_bit_grids, perturbed, tiny_llama
from .test_speculative import assert_greedy_sd_is_target_greedy, fit_to_target, left_padded_prompts

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not can_prepack(), reason="this torch build has no oneDNN")

#: The float32 layouts: the few-row kernel's (where it builds: x86 with AVX2 and a C++ compiler) and oneDNN's.
KERNELS = [
    pytest.param(
        "few_rows",
        marks=[
            needs_compiler,
            pytest.mark.skipif(few_rows.unavailable_reason() is not None, reason="the few-row kernel needs x86 AVX2"),
        ],
    ),
    "onednn",
]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_packed_model_gives_the_same_logits_in_the_forward_pass_and_the_cache(kernel):
    model = tiny_llama(64, d=64, layers=2, seed=1)
    packed = copy.deepcopy(model)
    assert prepack_linears(packed, kernel=kernel) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.kernel == kernel
    assert not any(p.requires_grad for p in packed.parameters())
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        fast, plain = packed(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    assert torch.allclose(fast, plain, atol=1e-5)
    plain_lm, fast_lm = CachedLM(model), CachedLM(packed)
    assert torch.allclose(fast_lm.prefill(ids, mask), plain_lm.prefill(ids, mask), atol=1e-5)
    new = torch.randint(1, 64, (len(ids), 6))  # a verification's gamma + 1 positions
    assert torch.allclose(fast_lm.step(new), plain_lm.step(new), atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_sd_with_a_packed_target_equals_the_targets_greedy(gamma, kernel):
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    draft = perturbed(target, 0.01)
    packed = copy.deepcopy(target)
    prepack_linears(packed, kernel=kernel)
    assert_greedy_sd_is_target_greedy(packed, draft, gamma, reference=target)


def test_sd_with_a_packed_target_follows_the_targets_distribution():
    """Chi-square over 12,000 two-token samples at T = 1 against the unpacked target's exact joint."""
    from .test_speculative import V

    target = tiny_llama(V, d=16, seed=3, sharpness=30.0)
    draft = tiny_llama(V, d=16, seed=4, sharpness=30.0)
    packed = copy.deepcopy(target)
    prepack_linears(packed)
    prompt = torch.tensor([[1, 2, 3]])
    out = speculative_generate(
        packed, draft, prompt.repeat(12_000, 1), gamma=3, max_new_tokens=2, generator=torch.Generator().manual_seed(0)
    )
    assert fit_to_target(out, target, prompt) > 1e-3


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 150])
@pytest.mark.parametrize(("inputs", "outputs"), [(24, 5), (64, 130), (1032, 200)])
@needs_compiler
def test_the_few_row_kernel_gives_the_dense_product_at_any_row_count(rows, inputs, outputs):
    """Outputs past a block of 64 rows, inputs past a chunk of 512 and not a multiple of it, rows past a tile of 8."""
    if few_rows.unavailable_reason() is not None:
        pytest.skip(few_rows.unavailable_reason())
    torch.manual_seed(rows)
    linear = torch.nn.Linear(inputs, outputs, bias=outputs % 2 == 0)
    packed = PackedLinear(linear, kernel="few_rows")
    assert packed.kernel == "few_rows" and not hasattr(packed, "weight")
    x = torch.randn(rows, inputs)
    with torch.no_grad():
        assert torch.allclose(packed(x), linear(x), atol=1e-5, rtol=1e-5)
        assert packed(x[None]).shape == (1, rows, outputs)
        # bfloat16 weights widen exactly in registers: the float32 product of the rounded weights, then rounded
        low = copy.deepcopy(linear).bfloat16()
        packed = PackedLinear(low, kernel="few_rows")
        exact = torch.nn.functional.linear(x.bfloat16().float(), low.weight.float(), None)
        exact = exact if low.bias is None else exact + low.bias.float()
        out = packed(x.bfloat16())
        assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), exact, atol=1e-2, rtol=1e-2)


def test_the_few_row_kernel_is_refused_where_it_cannot_run(monkeypatch):
    """Inputs that are not a multiple of 8 keep oneDNN's layout under auto, and are refused by name; so is a kernel
    switched off."""
    odd = torch.nn.Linear(12, 8)
    assert PackedLinear(odd).kernel == "onednn"
    with pytest.raises(DistillSpecError, match="multiples of 8, not 12"):
        PackedLinear(odd, kernel="few_rows")
    with pytest.raises(ValueError, match="auto, few_rows or onednn"):
        PackedLinear(odd, kernel="mkl")
    with pytest.raises(ValueError, match="bfloat16 weights for the few-row kernel only"):
        PackedLinear(copy.deepcopy(odd).bfloat16(), kernel="onednn")
    monkeypatch.setenv(few_rows.SWITCH, "0")
    assert few_rows.unavailable_reason() == f"{few_rows.SWITCH}=0"


@pytest.mark.skipif(few_rows.unavailable_reason() is not None, reason="the few-row kernel needs x86 AVX2")
def test_a_build_killed_before_it_finished_blocks_no_later_process(tmp_path):
    """torch marks a build under way with a file that a killed build leaves behind, after which its loader waited
    forever: a process that finds another building waits for it and says so, and then loads the kernel though the
    mark is still there."""
    build = Path(few_rows.extension().__file__).parent  # built here first (or found built), maybe in another cache
    env = os.environ | {"DISTILLSPEC_CACHE": str(build.parents[1])}
    assert few_rows.build_directory().name == build.name
    (build / few_rows.TORCH_BATON).touch()
    log = tmp_path / "out.txt"
    code = "from distillspec.models import few_rows; print('loaded:', few_rows.extension() is not None)"
    with one_at_a_time(build / few_rows.BUILD_LOCK, "unused"), open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
        )
        for _ in range(600):
            if "waiting for another process to build the kernel" in log.read_text() or proc.poll() is not None:
                break
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()  # waits while the lock is held
    try:
        assert proc.wait(timeout=120) == 0, log.read_text()
    finally:
        proc.kill()
    assert log.read_text().splitlines()[-1] == "loaded: True"
    assert not (build / few_rows.TORCH_BATON).exists()


@needs_compiler
@pytest.mark.skipif(few_rows.unavailable_reason() is not None, reason="the few-row kernel needs x86 AVX2")
def test_compiled_steps_take_the_few_row_kernel_into_one_graph():
    """A target laid out for the few-row kernel and a weight-only int8 draft whose steps go through it, their decoding
    steps compiled: the eager cache's logits, and no graph breaks (the kernel is a custom operator to torch.compile)."""
    from distillspec.models.packing import Int8Linear

    target = tiny_llama(64, d=64, layers=2, seed=1)
    prepack_linears(target, kernel="few_rows")
    draft = quantize_decoding_draft(tiny_llama(64, d=64, layers=2, seed=2), True)
    assert isinstance(draft.lm_head, Int8Linear) and draft.lm_head.few_rows_packed is not None
    models = [target, draft]
    if few_rows.bf16_rows():  # a bfloat16 target's rows go in as they are
        models.append(tiny_llama(64, d=64, layers=2, seed=3).bfloat16())
        prepack_linears(models[-1])
        assert models[-1].lm_head.bf16_rows
    torch._dynamo.utils.counters.clear()
    ids, mask = left_padded_prompts()
    for model in models:
        compiled, eager = CachedLM(model, compile=True, capacity=32), CachedLM(model)
        bf16 = model.dtype == torch.bfloat16
        near = {"rtol": 0.05, "atol": 0.05} if bf16 else {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(compiled.prefill(ids, mask), eager.prefill(ids, mask), **(near if bf16 else {}))
        for k in (1, 2) if model is draft else (1, 2, 6):  # drafting steps, a target's verification
            new = torch.randint(1, 64, (len(ids), k))
            torch.testing.assert_close(compiled.step(new), eager.step(new), **near)
    assert not torch._dynamo.utils.counters["graph_break"]


#: A bfloat16 target's layouts: the few-row kernel's with bfloat16 rows (AVX512-BF16), and matrix-vector products.
BF16_LAYOUTS = [
    pytest.param(
        "few_rows",
        marks=[
            needs_compiler,
            pytest.mark.skipif(
                few_rows.unavailable_reason() is not None or not few_rows.bf16_rows(),
                reason="bfloat16 rows take an x86 CPU with AVX512-BF16",
            ),
        ],
    ),
    "matrix_vector",
]


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_a_bfloat16_model_laid_out_for_few_rows_gives_its_logits(layout):
    """A step (one row) and a verification (six rows) within bfloat16's rounding of the plain model's; matrix-vector
    products keep the same weight tensors and, over FEW_ROWS rows (a prompt), the same product bit for bit."""
    model = tiny_llama(64, d=64, layers=2, seed=1).bfloat16()
    few = copy.deepcopy(model)
    if layout == "few_rows":  # what prepack_linears chooses where the CPU takes bfloat16 rows
        assert prepack_linears(few) == 2 * 7 + 1 and isinstance(few.lm_head, PackedLinear) and few.lm_head.bf16_rows
    else:
        assert replace_linears(few, FewRowLinear) == 2 * 7 + 1
        assert torch.equal(few.lm_head.weight, model.lm_head.weight)
        layer = torch.nn.Linear(8, 4).bfloat16()
        assert FewRowLinear(layer).weight is layer.weight  # shared weights stay shared
    assert not any(p.requires_grad for p in few.parameters())
    ids, mask = left_padded_prompts()
    assert ids.numel() > FEW_ROWS
    plain_lm, few_lm = CachedLM(model), CachedLM(few)
    with torch.no_grad():
        prompt, plain_prompt = few_lm.prefill(ids, mask), plain_lm.prefill(ids, mask)
        assert (
            torch.equal(prompt, plain_prompt)
            if layout == "matrix_vector"
            else torch.allclose(prompt, plain_prompt, atol=0.05)
        )
        one, plain_one = CachedLM(few), CachedLM(model)
        one.prefill(ids[1:2], mask[1:2])
        plain_one.prefill(ids[1:2], mask[1:2])
        for new in (torch.tensor([[5]]), torch.randint(1, 64, (1, 6))):  # a step, a verification at gamma 5
            fast, plain = one.step(new).float(), plain_one.step(new).float()
            assert (fast - plain).abs().max() < 0.05 * plain.abs().max(), (fast - plain).abs().max()


@needs_compiler
@pytest.mark.skipif(
    few_rows.unavailable_reason() is not None or not few_rows.bf16_rows(),
    reason="bfloat16 rows take an x86 CPU with AVX512-BF16",
)
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 9, 17, 38])
def test_the_few_row_kernel_multiplies_bfloat16_rows_exactly_into_float32_sums(rows):
    """bfloat16 rows by a bfloat16 weight: each product exact, the sums float32 (a chunk's tail of 8, 24 or 40
    inputs under a mask; past two tiles, spans of 2,048 inputs summed in registers and added); bfloat16 rows by a
    float32 weight are refused."""
    torch.manual_seed(rows)
    for inputs, outputs in ((24, 5), (1032, 130), (4136, 67)):
        weight = torch.randn(outputs, inputs).bfloat16()
        x = torch.randn(rows, inputs).bfloat16()
        out = few_rows.matmul(x, few_rows.pack(weight), outputs)
        exact = x.double() @ weight.double().t()
        assert out.dtype == torch.float32 and torch.allclose(out.double(), exact, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="bfloat16 rows with a bfloat16 weight"):
        few_rows.matmul(x, few_rows.pack(weight.float()), outputs)


def int8_product_check(seed: int = 0) -> None:
    """The few-row kernel's product of an int8 weight (a scale per output row) by rows rounded to 16 bits (a scale
    per row, its largest magnitude at 32,767), against the float64 product. With integer rows whose largest magnitude
    is 32,767 (a row scale of 1) and scales that are powers of two, every sum the kernel forms is an integer below
    2**24, so float32 holds it exactly and the product must be the exact one to the bit; random rows and scales to
    float32's precision (the sums' partial sums rounded)."""
    torch.manual_seed(seed)
    codes = torch.randint(-128, 128, (130, 1056), dtype=torch.int8)  # past a chunk of 512, not a multiple of it
    codes[0], codes[1] = -128, 127
    packed = few_rows.pack(codes)
    for rows in (1, 2, 5, 8, 9, 17):
        x = torch.randint(-50, 51, (rows, 1056)).float()
        x[:, 7] = 32767.0
        x[0] = x[0].abs()  # a row of one sign by the extreme codes: the largest sums
        scales = 2.0 ** -torch.randint(5, 9, (130,)).float()
        exact = x.double() @ (codes.double() * scales.double()[:, None]).t()
        assert torch.equal(few_rows.matmul(x, packed, 130, scales).double(), exact)
        x, scales = torch.randn(rows, 1056), torch.rand(130) / 100
        x_scales = x.abs().amax(1, keepdim=True).double() / 32767
        exact = (torch.round(x.double() / x_scales) @ codes.double().t()) * x_scales * scales.double()
        out = few_rows.matmul(x, packed, 130, scales).double()
        assert torch.allclose(out, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@needs_compiler
@pytest.mark.skipif(few_rows.unavailable_reason() is not None, reason="the few-row kernel needs x86 AVX2")
def test_the_few_row_kernel_multiplies_an_int8_weight_in_exact_integer_sums():
    """Through AVX512-VNNI where the CPU has it, and through AVX2 with it switched off (in a process of its own: the
    switch is read once)."""
    int8_product_check()
    env = dict(os.environ, **{few_rows.INT8_VNNI_SWITCH: "0"})
    check = (
        "from tests.test_packing import few_rows, int8_product_check; int8_product_check(); print(few_rows.int8_vnni())"
    )
    avx2 = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    assert avx2.returncode == 0, avx2.stderr[-2000:]
    assert avx2.stdout.strip().splitlines()[-1] == "False"


@needs_compiler
@pytest.mark.skipif(few_rows.unavailable_reason() is not None, reason="the few-row kernel needs x86 AVX2")
def test_the_few_row_kernel_rounds_its_rows_to_nearest_ties_to_even():
    """The rows' rounding on its own, through identity weights: an int8 one (rows in 16 bits, a scale a row), a 4-bit
    and a 6-bit one (through AVX512-VNNI a 4-bit weight's rows in 16 bits; at AVX2, and a 6-bit weight's always, in 8
    bits with a scale for each group of 32 inputs). Each row's (or group's) largest magnitude is the largest integer of
    its width, so its scale is 1 and the product is the rounded row itself: halves go to the even integer, both signs,
    every position of a group of 32 (the rounding runs in vectors of 8 and reorders its bytes); a group of zeros stays
    zero."""
    torch.manual_seed(0)
    K = 64
    halves = torch.randint(-40, 40, (3, K)).float() + 0.5
    halves[:, 5] = torch.tensor([2.5, -2.5, 0.5])
    eye = torch.eye(K, dtype=torch.int64)

    def rows(peak: float) -> torch.Tensor:
        x = halves.clone()
        x[:, 0], x[:, 33] = peak, -peak  # each group of 32 inputs peaks at the width's largest integer
        x[2, 32:] = 0.0  # a group of zeros
        x[2, 0] = peak
        return x

    x = rows(32767.0)
    out = few_rows.matmul(x, few_rows.pack(eye.to(torch.int8)), K, torch.ones(K))
    assert torch.equal(out, torch.round(x))
    int4 = few_rows.pack_int4((eye + 8).to(torch.int32), torch.tensor([1.0, 0.0]).expand(K // 32, K, 2).bfloat16())
    int6 = few_rows.pack_int6((eye + 32).to(torch.uint8), torch.ones(K, K // 16))
    for packed, eight_bits in ((int4, not few_rows.int8_vnni()), (int6, True)):
        x = rows(127.0 if eight_bits else 32767.0)
        for dtype in (torch.float32, torch.bfloat16) if eight_bits else (torch.float32,):  # bfloat16 has no 32767
            assert torch.equal(few_rows.matmul(x.to(dtype), packed, K), torch.round(x).to(dtype))


@needs_compiler
@pytest.mark.skipif(few_rows.unavailable_reason() is not None, reason="the few-row kernel needs x86 AVX2")
def test_the_few_row_kernel_multiplies_a_4_bit_weight_as_its_groups_dequantized():
    """Codes 0-15 in groups of 32 inputs, each group of an output row with its scale and zero point (``(code - 8) *
    scale + zero``, bfloat16 as torch's kernel takes them), by rows rounded as the path that runs rounds them (through
    AVX512-VNNI to 16 bits, a scale a row; at AVX2 to 8 bits, a scale for each group of 32 inputs): the float64 product
    of those rows and the dequantized weight to float32's precision, at every row count (the kernel reads a run of 64
    output rows once per 4 rows through AVX512-VNNI, per 8 at AVX2), past a run's padding (80 outputs), float32 and
    bfloat16 rows (a bfloat16 product: the float32 one rounded); torch's own int4 kernel within 1% of the unrounded
    rows' product. Both paths where the CPU has AVX512-VNNI, the second with it switched off in a process of its own."""
    int4_products()
    if few_rows.int8_vnni():
        env = dict(os.environ, **{few_rows.INT8_VNNI_SWITCH: "0"})
        check = "from tests.test_packing import int4_products; int4_products()"
        avx2 = subprocess.run(
            [sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=ROOT, check=False
        )
        assert avx2.returncode == 0, avx2.stderr[-2000:]


def int4_products() -> None:
    """The checks of the test above, for the path that runs in this process."""
    from distillspec.models.packing import int4_groups

    torch.manual_seed(0)
    weight = torch.randn(80, 96) * 0.02
    codes, scales_zeros = int4_groups(weight)
    scales_zeros = scales_zeros.bfloat16()
    packed = few_rows.pack_int4(codes, scales_zeros)
    assert packed.dtype == torch.uint8 and packed.numel() == 2 * 3 * (8 * 4 * 32 + 4 * 64)  # 2 runs x 3 groups
    scale, zero = (scales_zeros[..., i].double().T.repeat_interleave(32, 1) for i in (0, 1))
    dequantized = (codes.double() - 8) * scale + zero
    torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
    for rows in (1, 2, 3, 4, 5, 8, 9, 12):
        x = torch.randn(rows, 96)
        x[:, 3] = 30.0  # an outlier, as the attention sink's activations
        for dtype in (torch.float32, torch.bfloat16):
            rows_f32 = x.to(dtype).float()
            exact = rounded_for_4_bits(rows_f32) @ dequantized.T
            out = few_rows.matmul(x.to(dtype), packed, 80)
            assert out.dtype == dtype and out.shape == (rows, 80)  # the rows' dtype: bfloat16 rounded once
            if dtype == torch.bfloat16:
                out = few_rows.matmul(rows_f32, packed, 80)  # the same rows as float32, the same sums
                assert torch.equal(few_rows.matmul(x.to(dtype), packed, 80), out.bfloat16())
            assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item())
        theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), torch_packed, 32, scales_zeros).double()
        unrounded = x.bfloat16().double() @ dequantized.T
        assert (theirs - unrounded).abs().max() < 0.01 * unrounded.abs().max()
    with pytest.raises(RuntimeError, match="multiples of 16"):
        few_rows.pack_int4(codes[:72], scales_zeros[:, :72])
    with pytest.raises(RuntimeError, match="other shapes"):
        few_rows.matmul(torch.randn(1, 96), packed, 64)


def rounded_for_4_bits(rows: torch.Tensor, vnni: bool | None = None) -> torch.Tensor:
    """``rows`` [..., K] (float32) as the few-row kernel's 4-bit products round them, in float64: through AVX512-VNNI
    to 16 bits with a scale a row, at AVX2 (and for 6-bit products: ``vnni=False``) to 8 bits with a scale for each
    group of 32 inputs (largest magnitude 32767 or 127, each value times the scale's reciprocal rounded to nearest,
    ties to even)."""
    vnni = few_rows.int8_vnni() if vnni is None else vnni
    groups = rows.unflatten(-1, (1, -1) if vnni else (-1, 32))
    scales = groups.abs().amax(-1, keepdim=True) / (32767 if vnni else 127)
    return (torch.round(groups * (1 / scales)).double() * scales.double()).flatten(-2)


def test_int4_steps_go_through_the_few_row_kernel_where_it_takes_them(monkeypatch):
    """An int4 layer's steps (up to INT4_FEW_ROWS rows) through the few-row kernel where it takes them: the
    products of torch's int4 kernel (the same codes and scales; ``DISTILLSPEC_INT4_FEW_ROWS=0`` keeps that kernel) to
    within the rounding of the rows (bfloat16 for torch's, the few-row kernel's own: :func:`rounded_for_4_bits`), in
    float32 and bfloat16 models; more rows take the int8 product."""
    from distillspec.models.packing import INT4_FEW_ROWS, INT4_ROWS, Int8Linear, fbgemm_available

    skip_without("int4")
    if not few_rows.int4():
        pytest.skip("4-bit weights take the few-row kernel where it runs")
    torch.manual_seed(0)
    fbgemm = fbgemm_available()
    for dtype in (torch.float32, torch.bfloat16):
        dense = torch.nn.Linear(64, 96).to(dtype)
        ours = Int8Linear(dense, fbgemm, int4=True)
        monkeypatch.setenv(few_rows.INT4_SWITCH, "0")
        theirs = Int8Linear(dense, fbgemm, int4=True)
        monkeypatch.delenv(few_rows.INT4_SWITCH)
        assert ours.int4_few_rows and "through the few-row kernel" in repr(ours) and ours.int4_scales_zeros is None
        assert not theirs.int4_few_rows and theirs.int4_scales_zeros is not None
        x = torch.randn(INT4_FEW_ROWS + 1, 64).to(dtype)
        with torch.no_grad():
            steps = ours(x[:INT4_FEW_ROWS]).float()
            torch_steps = torch.cat([theirs(rows) for rows in x[:INT4_FEW_ROWS].split(INT4_ROWS)]).float()
            assert steps.dtype == torch.float32 or dtype == torch.bfloat16
            assert (steps - torch_steps).norm() / torch_steps.norm() < 0.02
            assert torch.equal(ours(x), Int8Linear(dense, fbgemm)(x))  # a prompt: the int8 product


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_sd_with_a_few_row_bfloat16_target_equals_the_targets_greedy(gamma):
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0).bfloat16()
    draft = perturbed(target, 0.01)
    few = copy.deepcopy(target)
    prepack_linears(few)
    # Against the laid-out target's own greedy decoding: in bfloat16 the plain model's forward scores one of these
    # positions in an exact tie (two logits of 7.34375), which the decoder's attention (float32 sums) breaks otherwise.
    assert_greedy_sd_is_target_greedy(few, draft, gamma, through_cache=True)


def test_prepack_is_chosen_for_weight_bound_targets_on_a_cpu(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    (small / "model.safetensors").write_bytes(b"0" * 1000)
    assert resolve_prepack("auto", "float32", str(small))[0] is False  # bound by per-call costs
    int4 = few_rows.int4()  # a target's 4-bit layers in 4 bits where the kernel runs
    assert resolve_prepack("auto", "float32", "some/hub-id")[0] == ("int4" if int4 else True)  # size unknown: real
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    # the few-row kernel with bfloat16 rows (AVX512-BF16) pays; matrix-vector products pay with AMX
    bf16 = few_rows.bf16_rows()
    assert resolve_prepack("auto", "bfloat16", "some/hub-id")[0] == ("int4" if int4 and bf16 else bf16 or amx)
    assert resolve_prepack("auto", "bfloat16", str(small))[0] is False
    assert resolve_prepack(True, "float32", str(small)) == (True, "set by prepack")
    assert resolve_prepack(True, "bfloat16", str(small)) == (True, "set by prepack")
    assert resolve_prepack(False, "float32", "some/hub-id")[0] is False
    assert resolve_prepack("auto", "float16", "some/hub-id")[0] is False
    with pytest.raises(DistillSpecError, match="prepack=true"):
        resolve_prepack(True, "float16", str(small))
    with pytest.raises(DistillSpecError, match="prepack=true"):
        resolve_prepack(True, "float32", str(small), device="meta")


@needs_compiler
def test_prepack_bfloat16_rounds_a_float32_targets_weights_and_sd_stays_exact_for_it():
    """prepack=bfloat16: the weights rounded for the few-row kernel (the rows and sums stay float32), a model close to
    the float32 one, whose own greedy SD reproduces; refused where it cannot hold."""
    if few_rows.unavailable_reason() is not None:
        pytest.skip(few_rows.unavailable_reason())
    assert resolve_prepack("bfloat16", "float32", "some/hub-id") == ("bfloat16", "set by prepack")
    with pytest.raises(DistillSpecError, match="prepack=bfloat16 holds a float32 target"):
        resolve_prepack("bfloat16", "bfloat16", "some/hub-id")
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    rounded = copy.deepcopy(target)
    assert prepack_linears(rounded, weights=torch.bfloat16) == 2 * 7 + 1
    assert rounded.lm_head.packed.dtype == torch.bfloat16 and rounded.lm_head.kernel == "few_rows"
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        fast, plain = rounded(ids, attention_mask=mask).logits, target(ids, attention_mask=mask).logits
    assert fast.dtype == torch.float32 and not torch.equal(fast, plain)
    assert torch.allclose(fast, plain, atol=0.1)  # weights rounded to 8 bits of mantissa
    assert_greedy_sd_is_target_greedy(rounded, perturbed(target, 0.01), 4)
    odd = torch.nn.Sequential(torch.nn.Linear(12, 16))  # inputs the kernel does not take: float32, as prepack=true
    x = torch.randn(3, 12)
    with torch.no_grad():
        want = odd(x)
    assert prepack_linears(odd, weights=torch.bfloat16) == 1
    assert odd[0].kernel == "onednn" and odd[0].packed.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(odd(x), want)


def test_load_pair_packs_the_target_only(tmp_path, text_pair, tokenizer):
    folders = []
    for name, model in zip(("target", "draft"), text_pair):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    target, draft, _ = load_pair(*folders, dtype="float32", prepack=True)
    assert isinstance(target.lm_head, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in draft.modules())
    target, _, _ = load_pair(*folders, dtype="float32")  # auto: a small target is not packed
    assert not any(isinstance(m, PackedLinear) for m in target.modules())
    target, draft, _ = load_pair(*folders, dtype="bfloat16", prepack=True)
    layout = PackedLinear if few_rows.bf16_rows() else FewRowLinear  # the few-row kernel takes bfloat16 rows
    assert isinstance(target.lm_head, layout) and next(target.parameters()).dtype == torch.bfloat16
    assert not any(isinstance(m, (PackedLinear, FewRowLinear)) for m in draft.modules())


def gguf_4_bit(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A weight [rows, cols] as a 4-bit GGUF's layer dequantizes to float32: codes 0-15 in groups of 32 inputs, each
    group ``d * code - m`` with a scale and offset of its own; some groups span fewer levels, one is a single value."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows * cols // 32, 32), generator=generator)
    codes[::3] %= 7  # groups whose codes span 7 levels or fewer
    codes[1] = 5
    d = torch.rand(len(codes), 1, generator=generator) * 0.01 + 1e-4
    m = torch.rand(len(codes), 1, generator=generator) * 0.05
    return (d * codes - m).reshape(rows, cols)


def gguf_6_bit(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A weight [rows, cols] as a GGUF's Q6_K layer dequantizes to float32: codes -32 to 31 in groups of 16 inputs,
    each group's step a row's float16 scale times an 8-bit one of its own (of either sign); one group spans even codes
    alone, one is all zero."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (rows, cols // 16, 16), generator=generator)
    codes[0, 1] = codes[0, 1] // 2 * 2
    d = (torch.rand(rows, 1, 1, generator=generator) * 1e-3 + 1e-5).half().float()
    scales = torch.randint(-128, 128, (rows, cols // 16, 1), generator=generator).float()
    scales[1, 0] = 0
    return (d * scales * codes).reshape(rows, cols)


@needs_compiler
@pytest.mark.skipif(not few_rows.int4(), reason="the few-row kernel's 6-bit products need x86 AVX2")
def test_a_weight_on_6_bit_grids_is_held_as_its_codes():
    """A GGUF's Q6_K layer (each group of 16 on a grid of codes -32 to 31, steps of either sign) comes back from its
    codes and steps exactly; a float weight, a 4-bit GGUF's one and a 6-bit one with one weight off its grid by a tenth
    of a step lie on no such grid."""
    from distillspec.models.packing import int6_grid

    weight = gguf_6_bit(128, 96)
    codes, steps = int6_grid(weight)
    assert codes.dtype == torch.uint8 and codes.shape == (128, 96) and codes.max() <= 63
    assert steps.dtype == torch.float32 and steps.shape == (128, 6)
    assert torch.equal((codes.float() - 32) * steps.repeat_interleave(16, 1), weight)
    assert int6_grid(torch.randn(128, 96)) is None
    assert int6_grid(gguf_4_bit(128, 96)) is None
    off = weight.clone()
    off[100, 40] += steps[100, 2].abs() / 10
    assert int6_grid(off) is None
    assert int6_grid(weight[:, :80]) is None  # inputs not in whole groups of 32


@needs_compiler
@pytest.mark.skipif(not few_rows.int4(), reason="the few-row kernel's 6-bit products need x86 AVX2")
def test_the_few_row_kernel_multiplies_a_6_bit_weight_as_its_groups_dequantized():
    """Codes 0-63 a byte each, a step for each 16 inputs of an output row (``(code - 32) * step``, float32), by rows
    rounded to 8 bits with a scale for each group of 32 inputs: the float64 product of those rows and the weight to
    float32's precision at every row count (a run of 64 output rows read once per 8 rows), past a run's padding (80
    outputs; any number of them), float32 and bfloat16 rows (a bfloat16 product: the float32 one rounded); the largest
    codes by the largest rows, whose pairs' sums fill 16 bits, exact."""
    from distillspec.models.packing import int6_grid

    torch.manual_seed(0)
    codes, steps = int6_grid(gguf_6_bit(80, 96))
    packed = few_rows.pack_int6(codes, steps)
    assert packed.dtype == torch.uint8 and packed.shape == (2 * 3, 8 * 320)  # 2 runs x 3 groups, 8 eighths each
    weight = (codes.double() - 32) * steps.double().repeat_interleave(16, 1)
    for rows in (1, 2, 3, 6, 8, 9, 12):
        x = torch.randn(rows, 96)
        x[:, 3] = 30.0  # an outlier, as the attention sink's activations
        for dtype in (torch.float32, torch.bfloat16):
            exact = rounded_for_4_bits(x.to(dtype).float(), vnni=False) @ weight.T
            out = few_rows.matmul(x.to(dtype), packed, 80)
            assert out.dtype == dtype and out.shape == (rows, 80)
            if dtype == torch.bfloat16:
                out = few_rows.matmul(x.to(dtype).float(), packed, 80)
                assert torch.equal(few_rows.matmul(x.to(dtype), packed, 80), out.bfloat16())
            assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item())
    top = torch.full((16, 64), 63, dtype=torch.uint8)
    ones = torch.ones(16, 4)
    extreme = torch.full((2, 64), 1.0)
    extreme[1] = -1.0
    out = few_rows.matmul(extreme, few_rows.pack_int6(top, ones), 16)
    assert torch.equal(out, torch.tensor([[31.0 * 64], [-31.0 * 64]]).expand(2, 16))
    x = torch.randn(3, 96)
    assert torch.equal(
        few_rows.matmul(x, few_rows.pack_int6(codes[:7], steps[:7]), 7), few_rows.matmul(x, packed, 80)[:, :7]
    )
    with pytest.raises(RuntimeError, match="multiples of 32"):
        few_rows.pack_int6(codes[:, :80], steps[:, :5])
    with pytest.raises(RuntimeError, match="other shapes"):
        few_rows.matmul(torch.randn(1, 96), packed, 64)


@needs_compiler
@pytest.mark.skipif(not few_rows.int4(), reason="the few-row kernel's 6-bit products need x86 AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_target_layer_on_6_bit_grids_multiplies_as_its_weight(dtype):
    """An :class:`Int6Linear` (a target's layer on 6-bit grids) gives the product of its weight, exact, and its bias
    at any row count, the rows rounded to 8 bits a group; through the one call's product the same bits; a layer off
    the grids is not taken, and :func:`grid_layouts` takes it only when asked for 6 bits."""
    from distillspec.models.packing import Int6Linear, grid_layouts, grid_linears

    linear = torch.nn.Linear(96, 48)
    with torch.no_grad():
        linear.weight.copy_(gguf_6_bit(48, 96))
        linear.bias.normal_()
    layer = Int6Linear(linear, Int6Linear.layout(linear), dtype)
    product, _ = layer.step_product()
    for rows in (1, 6, 40):
        x = torch.randn(2, rows, 96).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (2, rows, 48)
        want = rounded_for_4_bits(x.float(), vnni=False) @ linear.weight.double().T + linear.bias.double()
        tol = 1e-5 if dtype == torch.float32 else 2**-7  # a bfloat16 output rounded once
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())
        assert torch.equal(product(x), out)
    assert Int6Linear.layout(torch.nn.Linear(96, 48)) is None
    model = torch.nn.Sequential(linear)
    assert not grid_layouts(model)
    assert grid_linears(model, dtype, grid_layouts(model, six_bits=True)) == 1 and isinstance(model[0], Int6Linear)


def on_grids(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (float32) as :func:`~distillspec.models.packing.int4_grid` holds it: its codes and its groups'
    scales and zero points rounded to bfloat16, as the kernel takes them."""
    from distillspec.models.packing import int4_grid

    codes, scales_zeros = int4_grid(weight)
    scale, zero = (scales_zeros.bfloat16()[..., i].float().T.repeat_interleave(32, 1) for i in (0, 1))
    return (codes - 8) * scale + zero


def test_a_weight_on_4_bit_grids_is_held_as_its_codes():
    """A 4-bit GGUF's layer (each group of 32 on a grid of at most 16 levels) comes back from its codes, scales and
    zero points to float32's rounding; a float weight, a 6-bit one and a 4-bit one with one weight off its grid (past
    the rows checked first) lie on no such grid."""
    from distillspec.models.packing import int4_grid

    weight = gguf_4_bit(128, 96)
    codes, scales_zeros = int4_grid(weight)
    assert codes.shape == (128, 96) and codes.min() >= 0 and codes.max() <= 15
    assert scales_zeros.shape == (3, 128, 2)
    scale, zero = (scales_zeros[..., i].T.repeat_interleave(32, 1) for i in (0, 1))
    torch.testing.assert_close((codes - 8) * scale + zero, weight, rtol=1e-6, atol=1e-8)
    assert int4_grid(torch.randn(128, 96)) is None
    six = torch.randint(-32, 32, (128, 96)) * 1e-3  # 64 levels
    assert int4_grid(six) is None
    off = weight.clone()
    off[100, 40] += 1e-5  # a tenth of the least step, in a row past the first 64
    assert int4_grid(off) is None
    assert int4_grid(weight[:, :90]) is None  # inputs not in whole groups


@needs_compiler
@pytest.mark.skipif(not few_rows.int4(), reason="the few-row kernel's 4-bit products need x86 AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_target_layer_on_4_bit_grids_multiplies_as_its_weight(dtype):
    """An :class:`Int4Linear` (a target's layer on 4-bit grids) gives the product of the weight it holds (its codes,
    the scales in bfloat16) and its bias at any row count (a step, a verification, a prompt), the rows rounded as the
    kernel rounds them (:func:`rounded_for_4_bits`); through the one call's product (``step_product``) the same bits;
    a layer off the grids is not taken."""
    from distillspec.models.packing import Int4Linear

    linear = torch.nn.Linear(96, 48)
    with torch.no_grad():
        linear.weight.copy_(gguf_4_bit(48, 96))
        linear.bias.normal_()
    layer = Int4Linear(linear, Int4Linear.layout(linear), dtype)
    assert layer.bias.dtype == dtype
    held = on_grids(linear.weight.detach()).double()
    product, rows_taken = layer.step_product()
    assert rows_taken == sys.maxsize
    for rows in (1, 6, 40):
        x = torch.randn(2, rows, 96).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (2, rows, 48)
        want = rounded_for_4_bits(x.float()) @ held.T + linear.bias.double()
        tol = 1e-5 if dtype == torch.float32 else 2**-7  # a bfloat16 output rounded once
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())
        assert torch.equal(product(x), out)
    assert Int4Linear.layout(torch.nn.Linear(96, 48)) is None
    assert Int4Linear.layout(torch.nn.Linear(96, 40)) is None  # outputs not in sixteens


@needs_compiler
@pytest.mark.skipif(not few_rows.int4(), reason="the few-row kernel's 4-bit products need x86 AVX2")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prepack", ["int4", "int4-int8"])
def test_prepack_int4_holds_a_targets_4_bit_layers_in_4_bits_and_sd_stays_exact(tmp_path, tokenizer, dtype, prepack):
    """prepack=int4: a target saved with its decoder layers on 4-bit grids (a 4-bit GGUF's, dequantized) and its head
    on 6-bit ones (a Q6_K layer's) loads with those layers in 4 bits and the head in 6 bits where the target is
    float32; a bfloat16 target's head is laid out for the few-row kernel in bfloat16, and with prepack=int4-int8 the
    head is in int8, a scale per output row. Its logits are the float model's within the rounding of its rows and
    scales, and greedy speculative decoding over it is its own greedy decoding. A target that only scores
    (``kernel="onednn"``) keeps the dtype's layout."""
    from distillspec.models.loading import load_model
    from distillspec.models.packing import Int4Linear, Int6Linear, int8_rows

    if dtype == "bfloat16" and not few_rows.bf16_rows() and prepack == "int4":
        pytest.skip("a bfloat16 target's other layers take the few-row kernel with AVX512-BF16")
    snapped = on_4_bit_grids(tiny_llama(len(tokenizer), d=64, layers=2, seed=1, sharpness=30.0))
    with torch.no_grad():  # the head on 6-bit grids, its largest weights about the random head's
        head_weight = gguf_6_bit(*snapped.lm_head.weight.shape)
        snapped.lm_head.weight.copy_(head_weight * (snapped.lm_head.weight.abs().max() / head_weight.abs().max()))
    snapped.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    loaded = load_model(str(tmp_path / "target"), dtype=dtype, prepack=prepack)[0]
    layers = [name for name, m in loaded.named_modules() if type(m) is Int4Linear]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down of both decoder layers; not the head
    assert next(loaded.parameters()).dtype == getattr(torch, dtype)
    six_bits = prepack == "int4" and dtype == "float32"
    rest = torch.int8 if prepack == "int4-int8" else torch.bfloat16
    assert isinstance(loaded.lm_head, Int6Linear if six_bits else PackedLinear)
    assert six_bits or (loaded.lm_head.packed.dtype == rest and loaded.lm_head.kernel == "few_rows")

    def head(weight: torch.Tensor) -> torch.Tensor:  # the head's weight as the kernel holds it
        if six_bits:
            return weight
        if rest == torch.bfloat16:
            return weight.bfloat16().float()
        codes, scales = int8_rows(weight.to(getattr(torch, dtype)).float())
        return codes.float() * scales[:, None]

    held = copy.deepcopy(snapped)  # the weights as the kernel holds them: the scales in bfloat16, the head as above
    with torch.no_grad():
        for name, layer in held.named_modules():
            if isinstance(layer, torch.nn.Linear):
                layer.weight.copy_(on_grids(layer.weight) if name != "lm_head" else head(layer.weight))
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        theirs = held.to(getattr(torch, dtype))(ids, attention_mask=mask).logits.float()
        ours = loaded(ids, attention_mask=mask).logits.float()
    # the rows rounded to 16 bits through AVX512-VNNI, to 8 bits a group at AVX2; in bfloat16, each operation as well
    tol = (1e-3 if few_rows.int8_vnni() else 1e-2) if dtype == "float32" else 0.05
    assert (ours - theirs).abs().max() < tol * theirs.abs().max()
    assert_greedy_sd_is_target_greedy(loaded, perturbed(snapped, 0.01), 4, through_cache=True)
    scoring = load_model(str(tmp_path / "target"), dtype=dtype, prepack=prepack, kernel="onednn")[0]
    assert not any(isinstance(m, Int4Linear) for m in scoring.modules())
    assert not any(isinstance(m, PackedLinear) and m.scales is not None for m in scoring.modules())


def test_prepack_int4_is_refused_where_the_kernel_does_not_take_it(monkeypatch):
    """prepack=int4 where the few-row kernel's 4-bit products do not run, or for a dtype they do not take: an error
    that says why and what to set; auto takes it for a weight-bound float32 target where they run."""
    with pytest.raises(DistillSpecError, match="prepack=int4 .* dtype=float16"):
        resolve_prepack("int4", "float16", "some/hub-id")
    with pytest.raises(DistillSpecError, match="prepack=int4 .* on meta"):
        resolve_prepack("int4", "float32", "some/hub-id", device="meta")
    with pytest.raises(DistillSpecError, match="prepack=int4-int8 .* on meta"):
        resolve_prepack("int4-int8", "float32", "some/hub-id", device="meta")
    assert (resolve_prepack("auto", "float32", "some/hub-id")[0] == "int4") is few_rows.int4()
    monkeypatch.setenv(few_rows.INT4_SWITCH, "0")
    with pytest.raises(DistillSpecError, match=f"prepack=int4 .*{few_rows.INT4_SWITCH}=0|prepack=int4 .*kernel"):
        resolve_prepack("int4", "float32", "some/hub-id")
    assert resolve_prepack("auto", "float32", "some/hub-id")[0] is True


def skip_without(draft_int8) -> None:
    """Skip a test of a ``draft_int8`` kernel this build of torch lacks."""
    if draft_int8 in INT8_KERNELS.values() and draft_int8 not in int8_kernels().values():
        pytest.skip(f"this build of torch has no kernel for draft_int8={draft_int8}")


def dequantized_int4(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose linear layers that int4 steps take hold their weights rounded to their 4-bit groups
    (scales and zero points in bfloat16, as the kernels take them)."""
    from distillspec.models.packing import INT4_GROUP, int4_groups

    rounded = copy.deepcopy(model)
    for layer in rounded.modules():
        if isinstance(layer, torch.nn.Linear) and layer.in_features % INT4_GROUP == 0 and layer.out_features % 16 == 0:
            codes, scales_zeros = int4_groups(layer.weight.detach())
            scale, zero = (scales_zeros.bfloat16()[..., i].float().T.repeat_interleave(INT4_GROUP, 1) for i in (0, 1))
            layer.weight.data = ((codes - 8) * scale + zero).to(layer.weight.dtype)
    return rounded


@pytest.mark.parametrize("draft_int8", [True, "fbgemm", "int4"], ids=["weight-only", "fbgemm", "int4"])
def test_an_int8_draft_keeps_its_draft_vocabulary_and_sd_stays_exact(draft_int8):
    """Int8 weights (per-row scales), through each kernel (int4: its steps through 4-bit weights): a distribution
    close to the float draft's, the draft vocabulary's map kept, greedy SD still the target's greedy, and at T = 1
    still the target's distribution (chi-square)."""
    from distillspec.models.draft_vocab import d2t, restrict_head
    from distillspec.models.packing import Int8Linear

    from .test_speculative import V

    skip_without(draft_int8)
    fbgemm = draft_int8 == "fbgemm" or "fbgemm" in int8_kernels()  # weight-only and int4: prompts through fbgemm
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    draft = restrict_head(perturbed(target, 0.01), torch.arange(0, 64, 2))
    int8 = quantize_decoding_draft(copy.deepcopy(draft), draft_int8)
    layers = [m for m in int8.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 2 * 4 + 1 and isinstance(int8.lm_head, Int8Linear)  # q, k, v as one product, gate and up
    assert int8.lm_head.fbgemm is fbgemm and torch.equal(d2t(int8), d2t(draft))
    assert all(layer.int4 is (draft_int8 == "int4") for layer in layers)
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        p, q = (m(ids, attention_mask=mask).logits.softmax(-1) for m in (draft, int8))
    assert 0 < (p - q).abs().sum(-1).mean() / 2 < 0.05  # rounded, and still nearly the same distribution
    # int4: against the float draft with its weights rounded to their 4-bit groups, as its steps read them
    rounded = dequantized_int4(draft) if draft_int8 == "int4" else draft
    if draft_int8 == "int4":  # a step's one row goes through the 4-bit weights, its rows rounded as well
        with torch.no_grad():
            p, q = (m(torch.tensor([[5]])).logits.softmax(-1) for m in (rounded, int8))
        assert 0 < (p - q).abs().sum(-1).mean() / 2 < 0.05
    sd = speculative_generate(target, int8, ids, gamma=3, max_new_tokens=16, temperature=0, attention_mask=mask)
    plain = speculative_generate(target, draft, ids, gamma=3, max_new_tokens=16, temperature=0, attention_mask=mask)
    like = speculative_generate(target, rounded, ids, gamma=3, max_new_tokens=16, temperature=0, attention_mask=mask)
    assert torch.equal(sd.sequences, plain.sequences) and abs(sd.stats.alpha - like.stats.alpha) < 0.1
    small_target = tiny_llama(V, d=16, seed=3, sharpness=30.0)
    small_draft = tiny_llama(V, d=32 if draft_int8 == "int4" else 16, seed=4, sharpness=30.0)  # int4: whole groups
    quantize_decoding_draft(small_draft, draft_int8)
    assert any(m.int4 for m in small_draft.modules() if isinstance(m, Int8Linear)) is (draft_int8 == "int4")
    prompt = torch.tensor([[1, 2, 3]])
    out = speculative_generate(small_target, small_draft, prompt.repeat(12_000, 1), gamma=3, max_new_tokens=2,
                               generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert fit_to_target(out, small_target, prompt) > 1e-3


@pytest.mark.parametrize("draft_int8", [True, "fbgemm", "int4"], ids=["weight-only", "fbgemm", "int4"])
def test_an_int8_draft_takes_a_new_versions_float_weights(tmp_path, text_pair, tokenizer, draft_int8):
    """The endpoint's swap: a new draft version travels as float arrays (state_arrays) and an int8 draft quantizes
    them in place, through either kernel; load_pair makes the decode-only draft int8 and refuses it for a draft
    that trains."""
    from distillspec.models.loading import load_arrays
    from distillspec.models.packing import Int8Linear
    from distillspec.versions import state_arrays

    skip_without(draft_int8)
    folders = []
    for name, model in zip(("target", "draft"), text_pair):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    _, draft, _ = load_pair(*folders, dtype="float32", decode_only=True, draft_int8=draft_int8)
    fbgemm = draft_int8 == "fbgemm" or "fbgemm" in int8_kernels()
    assert isinstance(draft.lm_head, Int8Linear) and draft.lm_head.fbgemm is fbgemm
    assert draft.lm_head.weight_only_steps is (draft_int8 is True or not fbgemm)
    newer = perturbed(text_pair[1], 0.05, seed=3)
    load_arrays(draft, state_arrays(newer))
    ids = torch.randint(1, 100, (2, 9))
    with torch.no_grad():
        assert torch.allclose(draft(ids).logits, newer(ids).logits, atol=0.05)
        assert not torch.allclose(draft(ids).logits, text_pair[1](ids).logits, atol=0.05)
        step = ids[:1, :1]  # one row: through the 4-bit weights with int4, which take the new version too
        now, new, old = (model(step).logits for model in (draft, newer, text_pair[1]))
        assert (now - new).norm() < (now - old).norm()
    with pytest.raises(DistillSpecError, match="draft_int8"):
        load_pair(*folders, dtype="float32", draft_int8=draft_int8)


@pytest.mark.parametrize("draft_int8", [True, "fbgemm", "int4"], ids=["weight-only", "fbgemm", "int4"])
def test_a_version_swapped_into_a_bfloat16_int8_draft_is_that_version_loaded_afresh(
    tmp_path, text_pair, tokenizer, draft_int8
):
    """The learner's float32 weights, swapped into a bfloat16 int8 draft, are rounded to bfloat16 before they are
    quantized, as loading that version in bfloat16 rounds them: the same logits to the bit, prompt and step."""
    from distillspec.models.loading import load_arrays
    from distillspec.versions import state_arrays

    skip_without(draft_int8)
    newer = perturbed(text_pair[1], 0.05, seed=3)
    folders = []
    for name, model in zip(("target", "draft", "newer"), (*text_pair, newer)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    _, swapped, _ = load_pair(folders[0], folders[1], dtype="bfloat16", decode_only=True, draft_int8=draft_int8)
    load_arrays(swapped, state_arrays(newer))
    _, fresh, _ = load_pair(folders[0], folders[2], dtype="bfloat16", decode_only=True, draft_int8=draft_int8)
    ids = torch.randint(1, 100, (2, 9))
    with torch.no_grad():
        assert torch.equal(swapped(ids).logits, fresh(ids).logits)
        assert torch.equal(swapped(ids[:1, :1]).logits, fresh(ids[:1, :1]).logits)  # a step: int4's own weights


@pytest.mark.parametrize("draft_int8", [True, "fbgemm", "int4"], ids=["weight-only", "fbgemm", "int4"])
def test_an_int8_drafts_fused_products_give_the_unfused_logits(monkeypatch, draft_int8):
    """q, k and v as one product, and the MLP's gate and up: the logits of the unfused int8 draft to the bit, in the
    model's own forward pass and the lean cache's steps, one product per input, and a new version's arrays (named
    by the parts) go into the fused product."""
    from distillspec.models import packing
    from distillspec.models.loading import load_arrays
    from distillspec.versions import state_arrays

    from .test_kvcache import tiny_qwen2

    skip_without(draft_int8)
    unfused = quantize_decoding_draft(tiny_qwen2(seed=2), draft_int8, fuse=False)
    fused = quantize_decoding_draft(tiny_qwen2(seed=2), draft_int8)
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, packing.FusedLinear) and isinstance(attn.k_proj, packing.FusedPart)
    assert not any(isinstance(m, packing.FusedLinear) for m in unfused.modules())
    assert not any(k.startswith("model.layers.0.self_attn.q_proj") for k in fused.state_dict())  # weights held once
    products = []  # the inputs of the fused products (a kernel step's step_forward may call forward on its input)

    def counted(product):
        def call(x: torch.Tensor) -> torch.Tensor:
            if not any(x is seen for seen in products):
                products.append(x)
            return product(x)

        return call

    for layer in fused.modules():
        if isinstance(layer, packing.FusedLinear):
            for method in ("forward", "step_forward"):
                monkeypatch.setattr(layer.linear, method, counted(getattr(layer.linear, method)))

    def decode(model):
        lm = CachedLM(model)
        ids, mask = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
        out = [lm.prefill(ids, mask), lm.step(torch.tensor([[8], [9]])), lm.step(torch.tensor([[10, 11], [12, 13]]))]
        with torch.no_grad():
            return [*out, model(ids, attention_mask=mask).logits]

    for a, b in zip(decode(unfused), decode(fused), strict=True):
        assert torch.equal(a, b)
    # where the kernel runs a step's layers in one call, only the model's forward calls the products from Python
    one_call = kvcache._step_layers(fused) is not None
    assert len(products) == (1 if one_call else 4) * 2 * 2  # calls (3 in the cache, 1 forward) x 2 layers x 2 fused
    products.clear()
    monkeypatch.setattr(kvcache, "_step_layers", lambda model: None)  # layer by layer
    for a, b in zip(decode(unfused), decode(fused), strict=True):
        assert torch.equal(a, b)
    assert len(products) == 4 * 2 * 2
    newer = perturbed(tiny_qwen2(seed=2), 0.2, seed=3)
    for model in (unfused, fused):
        load_arrays(model, state_arrays(newer))
    for a, b in zip(decode(unfused), decode(fused), strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        now, new, old = (model(torch.tensor([[1, 2, 3]])).logits for model in (fused, newer, tiny_qwen2(seed=2)))
    assert (now - new).norm() < (now - old).norm() / 3


def test_draft_int8_auto_decodes_a_weight_bound_draft_on_a_cpu_in_int8(tmp_path, text_pair, tokenizer, monkeypatch):
    """draft_int8=auto (the default): int8 for a draft of 250M parameters or more on a CPU: its steps in int4 where
    torch's kernels run AVX-512 or the few-row kernel's 4-bit products run, else weight-only where the few-row kernel
    runs, else fbgemm's (weight-only where torch has no fbgemm); the pair's dtype for a smaller
    draft, a GPU's, or where vLLM decodes; prepare_models resolves it once and says why, and a draft that trains
    stays float."""
    from distillspec.config import load_config
    from distillspec.models import loading, pretrained
    from distillspec.models.loading import load_decoding_draft, parameter_count, resolve_draft_int8
    from distillspec.models.packing import Int8Linear, fbgemm_available
    from distillspec.tasks.data import arith_task

    avx512 = loading.cpu_avx512() and "int4" in int8_kernels()
    kernel = "int4" if avx512 and fbgemm_available() else "fbgemm" if fbgemm_available() else True
    kernel = True if kernel == "fbgemm" and few_rows.available() else kernel  # weight-only through the few-row kernel
    kernel = "int4" if few_rows.int4() and "int4" in int8_kernels() else kernel  # ... its 4-bit products (AVX2)
    assert resolve_draft_int8("auto", 630_000_000)[0] == kernel  # the Qwen2.5-Coder 0.5B
    assert resolve_draft_int8("auto", None)[0] == kernel  # a hub id: counted as large, as dtype=auto counts it
    assert resolve_draft_int8("auto", 135_000_000) == (False, "auto: 135M parameters, bound by per-call costs")
    assert resolve_draft_int8("auto", 630_000_000, "cuda")[0] is False
    assert resolve_draft_int8(True, 1000) == (True, "set by draft_int8")
    monkeypatch.setattr(loading, "cpu_avx512", lambda: True)
    assert resolve_draft_int8("auto", 630_000_000)[0] == ("int4" if fbgemm_available() else True)
    monkeypatch.setattr(loading, "cpu_avx512", lambda: False)
    assert resolve_draft_int8("auto", 630_000_000)[0] == ("fbgemm" if kernel == "fbgemm" else kernel)
    monkeypatch.setattr(loading.few_rows, "int4", lambda: False)
    assert resolve_draft_int8("auto", 630_000_000)[0] == ("fbgemm" if kernel == "fbgemm" else True)
    monkeypatch.setattr(loading.few_rows, "available", lambda: False)
    assert resolve_draft_int8("auto", 630_000_000)[0] == ("fbgemm" if fbgemm_available() else True)
    monkeypatch.setattr(loading, "fbgemm_available", lambda: False)
    assert resolve_draft_int8("auto", 630_000_000)[0] is True
    monkeypatch.undo()

    folders = []
    for name, model in zip(("target", "draft"), text_pair):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    assert parameter_count(folders[1]) == parameter_count(text_pair[1]) > 0
    assert parameter_count("org/hub-id") is None
    assert load_config(None, []).draft_int8 == "auto"
    assert load_config(None, ["serve.backend=vllm"]).draft_int8 == "auto"  # not refused: it resolves to false
    pair, task, lines = [f"target={folders[0]}", f"draft={folders[1]}"], arith_task(n_train=8, n_test=4), []
    cfg = pretrained.prepare_models(load_config(None, pair), task, log=lines.append)
    assert cfg.draft_int8 is False and "decodes in float32 (auto: " in lines[-1] and "parameters" in lines[-1]
    assert not isinstance(load_decoding_draft(folders[1], device="cpu", dtype=torch.float32, int8="auto")[0].lm_head,
                          Int8Linear)  # fmt: skip
    monkeypatch.setattr(loading, "AUTO_INT8_PARAMETERS", 1)
    cfg = pretrained.prepare_models(load_config(None, pair), task, log=lines.append)
    assert cfg.draft_int8 == kernel and "(auto: a weight-bound draft on a CPU" in lines[-1]
    assert any(f"decodes in {kind} (auto" in lines[-1] for kind in ("weight-only int8", "int8 through fbgemm's GEMM",
                                                                    "int4 steps, int8 prompts"))  # fmt: skip
    cfg = pretrained.prepare_models(load_config(None, [*pair, "serve.backend=vllm"]), task, log=lines.append)
    assert cfg.draft_int8 is False and "vLLM" in lines[-1]
    draft = load_decoding_draft(folders[1], device="cpu", dtype=torch.float32, int8="auto")[0]
    assert isinstance(draft.lm_head, Int8Linear) and draft.lm_head.fbgemm is fbgemm_available()
    assert draft.lm_head.weight_only_steps is (kernel is True)
    assert any(m.int4 for m in draft.modules() if isinstance(m, Int8Linear)) is (kernel == "int4")
    _, trains, _ = load_pair(*folders, dtype="float32", draft_int8="auto")  # a draft that trains: float, no error
    assert not isinstance(trains.lm_head, Int8Linear)


def test_draft_int8_is_refused_with_vllm_backends():
    from distillspec.config import load_config

    assert load_config(None, ["draft_int8=true"]).draft_int8 is True
    assert load_config(None, ["draft_int8=fbgemm"]).draft_int8 == "fbgemm"
    assert load_config(None, ["draft_int8=int4"]).draft_int8 == "int4"
    for choice in ("true", "fbgemm", "int4"):
        with pytest.raises(DistillSpecError, match=f"draft_int8={choice}"):
            load_config(None, [f"draft_int8={choice}", "serve.backend=vllm"])
    with pytest.raises(DistillSpecError, match="did you mean 'fbgemm'"):
        load_config(None, ["draft_int8=fbgem"])
    for choice in ("fbgemm", "int4"):
        with pytest.raises(DistillSpecError, match="device=cuda: use draft_int8=true"):
            load_config(None, [f"draft_int8={choice}", "device=cuda"])
    from distillspec.models.packing import quantize_int8

    with pytest.raises(DistillSpecError, match="not on the CPU"):  # fbgemm's GEMM is a CPU's
        quantize_int8(torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta")), fbgemm=True)


def test_an_int8_layer_gives_nearly_the_same_product_for_a_step_and_for_a_prompt(monkeypatch):
    """Weight-only: a few rows go through torch's int8 kernel where the few-row kernel does not run (a float32
    layer's activations rounded to bfloat16 there), many (a prompt) through the weight dequantized: nearly the same
    product, in float32 and in bfloat16. fbgemm's int8 GEMM takes every row count, each row rounded with its own
    scale: a row whose activations are a thousand times the others' (a prompt's attention sink) leaves the others'
    products as they are."""
    from distillspec.models import packing
    from distillspec.models.packing import INT8_ROWS, Int8Linear, fbgemm_available

    monkeypatch.setattr(packing.few_rows, "refusal", lambda *_: "switched off")
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 96)
    x = torch.randn(INT8_ROWS + 8, 64)
    exact = dense(x).detach()
    layer = Int8Linear(dense)
    assert not layer.few_rows
    assert layer.step_dtype == torch.bfloat16 and "bfloat16 activations" in repr(layer)
    steps = torch.cat([layer(x[:8]), layer(x[8:16])])
    assert torch.allclose(steps, layer(x)[:16], atol=0.02) and (layer(x) - exact).norm() / exact.norm() < 0.01
    half = Int8Linear(copy.deepcopy(dense).bfloat16())
    assert half.step_dtype == torch.bfloat16 and half(x).dtype == torch.bfloat16
    assert torch.allclose(half(x.bfloat16())[:8], half(x[:8].bfloat16()), atol=0.05)
    if fbgemm_available():
        fbgemm = Int8Linear(dense, fbgemm=True)
        assert "fbgemm" in repr(fbgemm)
        for product in (fbgemm(x), torch.cat([fbgemm(x[:1]), fbgemm(x[1:6]), fbgemm(x[6:12]), fbgemm(x[12:])])):
            assert 0 < (product - exact).norm() / exact.norm() < 0.03
        assert torch.allclose(fbgemm(x), torch.cat([fbgemm(row) for row in x.split(1)]), atol=0.05)
        sink = torch.cat([1000 * x[:1], x[1:]])
        with torch.no_grad():
            one_scale = torch.ops.quantized.linear_dynamic(sink, fbgemm.packed, True) + dense.bias
        rest = dense(sink)[1:].detach()
        assert (fbgemm(sink)[1:] - rest).norm() / rest.norm() < 0.03 < (one_scale[1:] - rest).norm() / rest.norm()


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 8, 9, 16])
@pytest.mark.parametrize(("inputs", "outputs"), [(32, 5), (96, 130), (1056, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_compiler
def test_weight_only_int8_steps_through_the_few_row_kernel_give_the_dequantized_product(rows, inputs, outputs, dtype):
    """Where the few-row kernel runs, a weight-only int8 layer's steps (up to INT8_ROWS rows) go through it: each
    row rounded to 16 bits, so the product is the dequantized weight's to about 1e-4 of its scale (the bfloat16
    activations of torch's kernel are 100x further off); past a block of 64 outputs, a chunk of 512 inputs, a tile of
    8 rows; a bias added; a model's dtype kept. Inputs not a multiple of 32 keep torch's kernel."""
    from distillspec.models.packing import Int8Linear

    if few_rows.unavailable_reason() is not None:
        pytest.skip(few_rows.unavailable_reason())
    torch.manual_seed(rows + inputs)
    dense = torch.nn.Linear(inputs, outputs, bias=outputs % 2 == 0).to(dtype)
    layer = Int8Linear(dense)
    assert layer.few_rows and "few-row kernel" in repr(layer)
    x = torch.randn(rows, inputs).to(dtype)
    dequantized = layer.weight.double() * layer.scales.double()[:, None]
    exact = x.double() @ dequantized.T + (0 if dense.bias is None else dense.bias.double())
    with torch.no_grad():
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, outputs) and layer(x[None]).shape == (1, rows, outputs)
        if rows:
            error = (out.double() - exact).abs().max() / exact.abs().max()
            assert error < (1e-4 if dtype == torch.float32 else 1e-2)
            assert torch.equal(layer(x[:1]), out[:1])  # a row's product is its own
    assert not Int8Linear(torch.nn.Linear(48, 8)).few_rows


def test_weight_only_int8_with_fbgemm_keeps_its_steps_and_reads_prompts_through_fbgemm():
    """draft_int8=true on a CPU with fbgemm: up to INT8_ROWS rows (steps) weight-only, as without fbgemm; more rows
    (a prompt) through fbgemm's GEMM, as draft_int8=fbgemm reads them. The int8 weight as it is stays only where a
    product reads it: the kernels hold their own layouts."""
    from distillspec.models.packing import INT8_ROWS, Int8Linear, fbgemm_available

    if not fbgemm_available():
        pytest.skip("this build of torch has no fbgemm")
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 96)
    both = Int8Linear(dense, True, weight_only_steps=True)
    weight_only, fbgemm = Int8Linear(dense), Int8Linear(dense, True)
    assert both.few_rows is weight_only.few_rows and "prompts through fbgemm" in repr(both)
    assert weight_only.weight.shape == (96, 64) and fbgemm.weight.numel() == 0  # without fbgemm prompts read it
    assert both.weight.numel() == (0 if both.few_rows else 96 * 64)  # steps read it without the few-row kernel
    steps, prompt = torch.randn(INT8_ROWS, 64), torch.randn(INT8_ROWS + 1, 64)
    with torch.no_grad():
        assert torch.equal(both(steps), weight_only(steps)) and not torch.equal(both(steps), fbgemm(steps))
        assert torch.equal(both(prompt), fbgemm(prompt)) and not torch.equal(both(prompt), weight_only(prompt))


def test_int4_steps_round_each_group_of_32_and_a_prompt_keeps_the_int8_product():
    """draft_int8=int4: a weight's 4-bit codes span each group of 32 inputs from its min to its max (each weight
    within half a level); up to INT4_ROWS rows (steps; INT4_FEW_ROWS through the few-row kernel) go through them,
    in float32 (torch's kernel with bfloat16 activations, as the weight-only kernel: its float32 path is 15x slower)
    and bfloat16; more rows (a prompt) get the int8 layer's product exactly; a layer whose inputs are not whole
    groups, or outputs not tiles of 16, stays int8."""
    from distillspec.models.packing import (
        INT4_FEW_ROWS,
        INT4_GROUP,
        INT4_ROWS,
        Int8Linear,
        fbgemm_available,
        int4_groups,
    )

    skip_without("int4")
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    codes, scales_zeros = int4_groups(weight)
    assert codes.shape == (48, 64) and scales_zeros.shape == (2, 48, 2) and 0 <= codes.min() <= codes.max() <= 15
    scale, zero = (scales_zeros[..., i].T.repeat_interleave(INT4_GROUP, 1) for i in (0, 1))
    assert ((codes - 8) * scale + zero - weight).abs().le(scale / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="groups of 32"):
        int4_groups(torch.randn(4, 48))
    dense, fbgemm = torch.nn.Linear(64, 96), fbgemm_available()
    x = torch.randn(INT4_FEW_ROWS + 1, 64)  # more rows than either kernel's 4-bit steps take
    exact = dense(x).detach()
    int4, int8 = Int8Linear(dense, fbgemm, int4=True), Int8Linear(dense, fbgemm)
    assert "steps in int4" in repr(int4) and (int4.int4_few_rows or int4.int4_scales_zeros.dtype == torch.bfloat16)
    with torch.no_grad():
        steps = int4(x[:INT4_ROWS])
        assert torch.allclose(steps, torch.cat([int4(row) for row in x[:INT4_ROWS].split(1)]), atol=1e-4)
        assert steps.dtype == torch.float32 and 0 < (steps - exact[:INT4_ROWS]).norm() / exact.norm() < 0.15
        assert not torch.allclose(steps, int8(x[:INT4_ROWS]), atol=1e-3) and torch.equal(int4(x), int8(x))
        half = Int8Linear(copy.deepcopy(dense).bfloat16(), fbgemm, int4=True)(x[:1].bfloat16())
        assert half.dtype == torch.bfloat16 and (half.float() - exact[:1]).norm() / exact[:1].norm() < 0.15
    for odd in (Int8Linear(torch.nn.Linear(48, 16), fbgemm, int4=True), Int8Linear(torch.nn.Linear(64, 24), int4=True)):
        assert not odd.int4 and odd.int4_packed is None


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_int4_draft_proposes_what_the_eager_one_does(dtype):
    """eval.compile with draft_int8=int4: the compiled steps run the 4-bit products as the eager ones do (the few-row
    kernel's where it runs, its product in the rows' dtype; else torch's kernel): in float32 the same
    tokens and acceptance, greedy and sampled; in bfloat16 (the draft's steps compiled) the same greedy tokens, and
    the compiled draft's distributions within rounding of the eager one's (its fused norms and activations round
    their bfloat16 sums once, where eager operators round each, whichever kernel takes the products)."""
    skip_without("int4")
    target = tiny_llama(64, d=64, layers=2, seed=4).to(dtype)
    draft = quantize_decoding_draft(perturbed(target, 0.3, seed=5), "int4")
    assert any(m.int4_packed is not None for m in draft.modules() if hasattr(m, "int4_packed"))
    prompt = torch.tensor([[3, 4, 5, 6]])
    exact = dtype == torch.float32
    for temperature in (0.0, 1.0):
        eager, compiled = (
            speculative_generate(target, draft, prompt, max_new_tokens=16, gamma=3, temperature=temperature,
                                 generator=torch.Generator().manual_seed(7), compile=c)
            for c in (False, True if exact else "draft")
        )  # fmt: skip
        assert 0 < compiled.stats.alpha < 1 and compiled.sequences.shape == eager.sequences.shape
        if exact or temperature == 0:
            assert torch.equal(eager.sequences, compiled.sequences) and eager.stats.alpha == compiled.stats.alpha
    ids = torch.tensor([[3, 4, 5, 6, 18, 22, 3, 35]])
    with torch.inference_mode():
        logits = []
        for compile in (False, True):
            lm = CachedLM(draft, compile=compile)
            lm.prefill(ids[:, :4], torch.ones_like(ids[:, :4]))
            logits.append(torch.cat([lm.step(ids[:, i : i + 1]) for i in range(4, 8)], 1).float().softmax(-1))
    assert (logits[0] - logits[1]).abs().sum(-1).max() / 2 < (1e-4 if exact else 0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_layer_takes_a_new_versions_weights_through_either_kernel(dtype):
    from distillspec.models.packing import Int8Linear, fbgemm_available

    kernels = [(False, False), (True, False), (True, True)] if fbgemm_available() else [(False, False)]
    for fbgemm, weight_only_steps in kernels:  # weight-only, fbgemm, weight-only steps and fbgemm's prompts
        layer = Int8Linear(torch.nn.Linear(32, 16).to(dtype), fbgemm, weight_only_steps=weight_only_steps)
        newer = torch.nn.Linear(32, 16)
        layer.load_dense(newer.weight, newer.bias.detach())
        for x in (torch.randn(3, 32), torch.randn(40, 32)):  # steps and a prompt
            product = layer(x.to(dtype))
            assert product.dtype == dtype and (product.float() - newer(x)).norm() / newer(x).norm() < 0.03


def test_the_int8_suite_times_every_kernel_at_every_row_count(tmp_path):
    from benchmarks.suites.int8 import ROWS, suite_int8
    from distillspec.models.packing import INT4_FEW_ROWS, INT4_ROWS, fbgemm_available

    result = suite_int8([], tmp_path, shapes={"small": (64, 96)}, reps=2)
    kernels = {row["kernel"] for row in result["rows"]}
    plain = {"float32", "bfloat16", "bfloat16 few rows"}
    assert plain | {"int8 weight-only (float32 model)", "int8 weight-only (bfloat16 model)"} <= kernels
    for model in ("float32", "bfloat16"):
        assert (f"int8 fbgemm ({model} model)" in kernels) is fbgemm_available()
        assert (f"int8 int4 ({model} model)" in kernels) is ("int4" in int8_kernels())
        assert (f"int8 int4-torch ({model} model)" in kernels) is ("int4" in int8_kernels() and few_rows.int4())
    assert len(result["rows"]) == len(kernels) * len(ROWS) and all(row["ms"] > 0 for row in result["rows"])
    for row in result["rows"]:
        int4_rows = INT4_FEW_ROWS if few_rows.int4() else INT4_ROWS
        int4_step = "int4" in row["kernel"] and row["rows"] <= int4_rows  # 4-bit weights: about 0.08 of error
        assert row["relative_error"] < (1e-5 if row["kernel"].startswith("float32") else 0.15 if int4_step else 0.05)
    assert (tmp_path / "int8.json").exists() and "draft" not in result


def test_the_int8_suite_compares_the_drafts_decoding_with_each_kernel(tiny_garden, tmp_path):
    """--held: the job's draft decoding a held-out prompt and reference a token a step, float against int8."""
    from benchmarks.suites.common import suite_int8_kernels
    from benchmarks.suites.int8 import suite_int8

    from .conftest import garden_overrides

    result = suite_int8(garden_overrides(tiny_garden), tmp_path, held=2, shapes={"small": (16, 16)}, reps=1)
    draft = result["draft"]
    assert set(draft["kernels"]) == set(suite_int8_kernels()) and draft["positions"] > 4
    assert set(draft["step_ms"]) == {"float", *suite_int8_kernels()}
    for row in draft["kernels"].values():
        assert 0 < row["tvd"] < 0.2 and 0.5 < row["argmax_agreement"] <= 1
    assert set(draft["acceptance"]) == {"float", *suite_int8_kernels()}
    for row in draft["acceptance"].values():  # the garden's draft, against its target
        assert 0 < row["alpha"] < 1 and 0 <= row["argmax_agreement"] <= 1
