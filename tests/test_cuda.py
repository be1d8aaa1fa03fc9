"""The library on a CUDA GPU: speculative decoding exact in float32 and bfloat16 (with and without a draft
vocabulary, eager and compiled, whose steps replay as CUDA graphs), the learner step under bfloat16 autocast, a
garden model trained there. Skipped, saying so, where no GPU is present (the rest of the suite runs the same code on
the CPU)."""

import pytest
import torch

from distillspec import autoregressive_generate, speculative_generate
from distillspec.config import DistillConfig, ModelSize
from distillspec.models.draft_vocab import d2t, frequent_tokens, restrict_head
from distillspec.models.garden import make_model, train_lm
from distillspec.training.learner import Learner
from distillspec.training.rollout import encode_examples

from .conftest import exact_joint, perturbed, pooled_chisquare, tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: the CUDA paths are not run")

CUDA = torch.device("cuda")
V = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def on_cuda(model, dtype):
    return model.to(device=CUDA, dtype=dtype).eval()


@pytest.mark.parametrize("vocab", ["full", "restricted"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [1, 3])
def test_sd_on_cuda_follows_the_target_distribution(dtype, vocab, gamma):
    """Chi-square over 20,000 two-token samples (64 cells), each row its own chain, on the GPU. Logits moderate in
    scale, so that bfloat16's rounding of a k-row pass against a 1-row one moves no probability measurably."""
    target = on_cuda(tiny_llama(V, d=16, seed=3, sharpness=4.0), DTYPES[dtype])
    draft = tiny_llama(V, d=16, seed=4, sharpness=4.0)
    if vocab == "restricted":
        restrict_head(draft, torch.tensor([0, 2, 3, 5, 6]))
    draft = on_cuda(draft, DTYPES[dtype])
    prompt = torch.tensor([[1, 2, 3]], device=CUDA)
    out = speculative_generate(
        target,
        draft,
        prompt.repeat(20_000, 1),
        gamma=gamma,
        max_new_tokens=2,
        temperature=1.0,
        generator=torch.Generator(device=CUDA).manual_seed(gamma),
    )
    observed = torch.bincount((out.sequences[:, 3] * V + out.sequences[:, 4]).cpu(), minlength=V * V).double()
    pvalue = pooled_chisquare(observed, exact_joint(target, prompt))
    print(f"\nchi-square {dtype} {vocab} gamma={gamma}: p = {pvalue:.3f}, alpha = {out.stats.alpha:.3f}")
    assert 0.0 < out.stats.alpha < 1.0
    assert pvalue > 1e-3


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (5, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0).to(CUDA), mask.to(CUDA)


def _first_difference_is_a_tie(target, prompt: torch.Tensor, ours: torch.Tensor, own: torch.Tensor) -> bool:
    """Where a bfloat16 output departs from ``generate``'s: were the two tokens tied within bfloat16's rounding
    there (a k-row pass and a 1-row pass round differently)?"""
    at = int((ours != own).nonzero()[0])
    logits = target(torch.cat([prompt[0], own[:at]])[None]).logits[0, -1].float()
    gap = (logits[own[at]] - logits[ours[at]]).abs()
    return bool(gap <= 2**-5 * logits.abs().max())


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("vocab", ["full", "restricted"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_sd_on_cuda_equals_generate(dtype, vocab, compile):
    target = tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0)
    draft = perturbed(target, 0.01)
    if vocab == "restricted":
        restrict_head(draft, torch.arange(0, 64, 2))
    target, draft = on_cuda(target, DTYPES[dtype]), on_cuda(draft, DTYPES[dtype])
    ids, mask = _prompts()
    sd = speculative_generate(
        target, draft, ids, gamma=4, max_new_tokens=24, temperature=0, attention_mask=mask, compile=compile
    )
    plain = autoregressive_generate(target, ids, max_new_tokens=24, temperature=0, attention_mask=mask, compile=compile)
    ties = 0
    for row in range(len(ids)):
        prompt = ids[row : row + 1, mask[row].bool()]
        own = target.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :]
        for ours in (sd.sequences[row, ids.shape[1] :], plain.sequences[row, ids.shape[1] :]):
            if not torch.equal(ours, own):
                assert dtype == "bfloat16" and _first_difference_is_a_tie(target, prompt, ours, own), (row, ours, own)
                ties += 1
    print(f"\ngreedy {dtype} {vocab} {'compiled' if compile else 'eager'}: alpha {sd.stats.alpha:.3f}, ties {ties}")
    assert 0.0 < sd.stats.alpha < 1.0


@torch.inference_mode()
def test_a_static_step_replayed_as_cuda_graphs_gives_the_eager_tokens():
    """:class:`~distillspec.decoding.kvcache.CudaGraphs` over the compiled static step (the GPU suite's ``compiled``
    variant): captured once per shape, its logits equal the step run directly. Under inference mode, as the decoder
    and the suite run it: the cache that ``prefill`` fills is made of inference tensors, which a step outside it may
    not write."""
    from distillspec.decoding.kvcache import CachedLM, CudaGraphs, static_step

    target = on_cuda(tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0), torch.float32)
    ids, mask = _prompts()
    graphs = CudaGraphs(torch.compile(static_step(target), dynamic=False))
    for k in (1, 3, 1):
        lm = CachedLM(target, capacity=32)
        lm.prefill(ids, mask)
        full = torch.zeros(len(ids), lm.keys[0].shape[2], dtype=torch.long, device=CUDA)
        full[:, : ids.shape[1]] = mask
        full[:, ids.shape[1] : ids.shape[1] + k] = 1
        tokens = torch.randint(64, (len(ids), k), device=CUDA)
        positions = lm.next_pos[:, None] + torch.arange(k, device=CUDA)
        start = torch.tensor(ids.shape[1], device=CUDA)
        replayed = graphs(lm.keys, lm.values, tokens, positions, start, full)
        direct = static_step(target)(lm.keys, lm.values, tokens, positions, start, full)
        torch.testing.assert_close(replayed, direct, rtol=1e-4, atol=1e-4)
    assert 1 <= len(graphs.graphs) <= 3


def test_compiled_decoding_on_cuda_replays_its_steps_as_graphs():
    """``CachedLM(compile=True)`` on CUDA: each decoding step's shape captured once as a CUDA graph of the compiled
    step and replayed; the logits those give equal the eager cache's."""
    from distillspec.decoding.kvcache import CachedLM

    target = on_cuda(tiny_llama(64, d=64, layers=2, seed=1, sharpness=30.0), torch.float32)
    ids, mask = _prompts()
    compiled, eager = CachedLM(target, compile=True, capacity=32), CachedLM(target, capacity=32)
    torch.testing.assert_close(compiled.prefill(ids, mask), eager.prefill(ids, mask), rtol=1e-4, atol=1e-4)
    for k in (1, 3, 1, 1, 3):
        tokens = torch.randint(64, (len(ids), k), device=CUDA)
        torch.testing.assert_close(compiled.step(tokens), eager.step(tokens), rtol=1e-4, atol=1e-4)
    assert compiled.graphs is not None and len(compiled.graphs.graphs) == 2  # k = 1 and k = 3, one cache


def _batch(tokenizer, task, n=16):
    return encode_examples(tokenizer, task.train[:n], max_len=64)


@pytest.mark.parametrize("vocab", ["full", "restricted"])
def test_the_learner_step_under_bf16_autocast_on_cuda(tokenizer, task, vocab):
    """KD toward a target on the GPU, forward under bfloat16 autocast, weights float32: the loss falls on a batch
    it keeps seeing, the weights stay float32 and finite."""
    torch.manual_seed(0)
    target = make_model(ModelSize(d_model=64, n_layers=2, n_heads=2, d_ff=128), tokenizer).to(CUDA).eval()
    draft = make_model(ModelSize(d_model=32, n_layers=1, n_heads=2, d_ff=64), tokenizer).to(CUDA)
    if vocab == "restricted":
        seen = [encode_examples(tokenizer, [e], 64).input_ids[0].tolist() for e in task.train[:200]]
        restrict_head(draft, frequent_tokens(seen, 128, len(tokenizer), always=[tokenizer.eos_token_id]))
    cfg = DistillConfig(recipe="supkd", steps=40, warmup_steps=1, lr=1e-2)
    learner = Learner(draft, target, cfg, bf16=True)
    batch = _batch(tokenizer, task)  # on the CPU: the learner moves it
    losses = [learner.step(batch)["loss"] for _ in range(40)]
    print(f"\nlearner bf16 autocast ({vocab}): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in draft.parameters())
    if vocab == "restricted":
        assert d2t(draft).device.type == "cuda"


def test_a_garden_model_trains_on_cuda(tokenizer, task):
    torch.manual_seed(0)
    model = make_model(ModelSize(d_model=64, n_layers=2, n_heads=2, d_ff=128), tokenizer).to(CUDA)
    losses = train_lm(model, tokenizer, task.train, steps=120, batch_size=32, lr=3e-3, max_len=64, seed=0, bf16=True)
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    print(f"\ngarden model on CUDA (bf16 autocast): loss {first:.3f} -> {last:.3f}")
    assert last < first - 2.0
    ids = _batch(tokenizer, task, 4).input_ids.to(CUDA)
    out = autoregressive_generate(model.eval(), ids, max_new_tokens=8, temperature=0)
    assert out.sequences.device.type == "cuda"
