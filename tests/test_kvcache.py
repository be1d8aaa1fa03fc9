"""The lean KV cache gives the model's own logits, holes, row selection and all."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from distillspec import DistillSpecError, autoregressive_generate, speculative_generate
from distillspec.decoding.kvcache import COMPILE_CACHE, CachedLM, attention, compile_cache, supports_lean
from distillspec.files import cache_root

from .conftest import needs_compiler, perturbed, tiny_llama

V = 40


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """Grouped-query attention (4 query heads, 2 key/value heads) and q/k/v biases."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(cfg).eval()


def run(lm: CachedLM, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Prefill, a 3-token step, holes, a step that starts with a hole, then the batch drops a row."""
    out = [lm.prefill(ids, mask)]
    out.append(lm.step(torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])))
    lm.reject_tail(torch.tensor([2, 0, 1]))
    out.append(lm.step(torch.tensor([[14, 15], [16, 17], [18, 19]]), torch.tensor([[0, 1], [1, 1], [0, 1]])))
    lm.select_rows(torch.tensor([0, 2]))
    out.append(lm.step(torch.tensor([[20], [21]])))
    return out


@pytest.mark.parametrize("make", [lambda: tiny_llama(V, d=32, layers=2, seed=1), tiny_qwen2], ids=["llama", "qwen2"])
def test_lean_cache_matches_the_models_own_forward(make):
    model = make()
    assert supports_lean(model)
    ids = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8], [0, 9, 10, 11, 12]])
    mask = (torch.arange(5) >= torch.tensor([2, 0, 1])[:, None]).long()
    lean, hf = CachedLM(model), CachedLM(model, lean=False)
    assert lean.lean and not hf.lean
    for a, b in zip(run(lean, ids, mask), run(hf, ids, mask)):
        # Only real tokens count: the hole's own query (row 0 and 2, first column of the third call) is discarded.
        torch.testing.assert_close(a[..., -1, :] if a.ndim == 3 else a, b[..., -1, :] if b.ndim == 3 else b)
    assert torch.equal(lean.mask, hf.mask) and torch.equal(lean.next_pos, hf.next_pos)


@pytest.mark.parametrize("make", [lambda: tiny_llama(V, d=32, layers=2, seed=1), tiny_qwen2], ids=["llama", "qwen2"])
def test_an_unpadded_prompt_attends_causally_as_the_models_own_forward(make):
    """A first call over an unpadded batch takes the fused kernel's causal path (no mask); its logits and the steps
    after it are the model's own."""
    model = make()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    lean, hf = CachedLM(model), CachedLM(model, lean=False)
    mask = torch.ones_like(ids)
    torch.testing.assert_close(lean.prefill(ids, mask, every=True), hf.prefill(ids, mask, every=True))
    for step in (torch.tensor([[13, 14], [15, 16]]), torch.tensor([[17], [18]])):
        torch.testing.assert_close(lean.step(step), hf.step(step))


@pytest.mark.parametrize("queries", [1, 3, 8, 9])
def test_attention_of_bfloat16_queries_is_the_exact_attention_rounded(queries):
    """One bfloat16 query on a CPU is taken in float32 (torch's bfloat16 kernel is slow for it), more as torch's
    kernel takes them: either way the float64 attention of the rounded inputs to bfloat16's precision, grouped query
    heads, a hidden column and a batch of two; float32 queries as they are."""
    torch.manual_seed(queries)
    q, keys, values = torch.randn(2, 6, queries, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    visible = torch.ones(2, 1, queries, 11, dtype=torch.bool)
    visible[0, ..., 3] = False
    visible[1, ..., 7:] = False

    def exact(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            *(t.double() for t in tensors), attn_mask=visible, scale=0.3, enable_gqa=True
        )

    low = [t.bfloat16() for t in (q, keys, values)]
    out = attention(*low, visible, 0.3)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), exact(*low), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(
        attention(q, keys, values, visible, 0.3).double(), exact(q, keys, values), atol=1e-5, rtol=1e-5
    )


def test_lean_cache_grows_past_its_first_allocation():
    model = tiny_llama(V, d=32, layers=1, seed=2)
    ids = torch.tensor([[1, 2, 3]])
    lean, hf = CachedLM(model), CachedLM(model, lean=False)
    lean.prefill(ids, torch.ones_like(ids)), hf.prefill(ids, torch.ones_like(ids))
    first = lean.keys[0].shape[2]
    for i in range(first + 5):
        token = torch.tensor([[i % V]])
        torch.testing.assert_close(lean.step(token), hf.step(token))
    assert lean.keys[0].shape[2] > first


def test_other_architectures_use_the_models_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2)).eval()
    assert not supports_lean(gpt2) and not CachedLM(gpt2).lean
    with pytest.raises(DistillSpecError, match="leave it unset"):
        CachedLM(gpt2, lean=True)
    with pytest.raises(DistillSpecError, match="compile=True but model type 'gpt2'"):
        CachedLM(gpt2, compile=True)
    prompt = torch.tensor([[1, 2, 3]])
    out = speculative_generate(gpt2, gpt2, prompt, gamma=3, max_new_tokens=8, temperature=0.0)
    assert out.stats.alpha == 1.0  # a draft identical to the target is always accepted
    ref = gpt2.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, ref)


@needs_compiler
def test_compiled_steps_match_the_eager_cache():
    """Static shapes over the whole cache give the same logits: holes, grouped-query attention, rows leaving."""
    model = tiny_qwen2(seed=3)
    ids = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8], [0, 9, 10, 11, 12]])
    mask = (torch.arange(5) >= torch.tensor([2, 0, 1])[:, None]).long()
    compiled, eager = CachedLM(model, compile=True, capacity=16), CachedLM(model)
    assert compiled.compiled is not None and eager.compiled is None
    for a, b in zip(run(compiled, ids, mask), run(eager, ids, mask)):
        torch.testing.assert_close(a[..., -1, :] if a.ndim == 3 else a, b[..., -1, :] if b.ndim == 3 else b)
    assert torch.equal(compiled.mask, eager.mask) and compiled.keys[0].shape[2] == 16


def test_compiled_kernels_are_cached_in_the_project_cache_unless_the_user_chose_a_folder(monkeypatch, tmp_path):
    import torch._inductor.runtime.cache_dir_utils as torch_cache  # where torch reads and writes its kernels

    ours = str(cache_root() / COMPILE_CACHE)
    for unset in (None, torch_cache.default_cache_dir()):  # torch's own default (set as torch._dynamo is imported)
        if unset is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", unset)
        assert compile_cache() == ours == torch_cache.cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's choice stays
    assert compile_cache() == str(tmp_path) == torch_cache.cache_dir()


@needs_compiler
def test_compiled_decoders_give_the_same_tokens():
    target = tiny_llama(V, d=32, layers=2, seed=4)
    draft = perturbed(target, 0.05, seed=5)
    prompt = torch.tensor([[3, 4, 5, 6]])

    def eager_and_compiled(decode, *models, modes=(False, True), **kw):
        return [
            decode(*models, prompt, max_new_tokens=24, generator=torch.Generator().manual_seed(7), compile=c, **kw)
            for c in modes
        ]

    for temperature in (0.0, 1.0):  # eager, both models compiled, the draft's steps alone compiled
        outs = eager_and_compiled(
            speculative_generate, target, draft, modes=(False, True, "draft"), gamma=3, temperature=temperature
        )
        stats = [list(vars(o.stats).values()) for o in outs]
        for out, other in zip(outs[1:], stats[1:]):
            assert torch.equal(outs[0].sequences, out.sequences)
            assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(stats[0], other))
        assert 0 < outs[1].stats.alpha < 1  # the draft differs from the target, so rejections were exercised
        plain = eager_and_compiled(autoregressive_generate, target, temperature=temperature)
        assert torch.equal(plain[0].sequences, plain[1].sequences)
        if temperature == 0:  # lossless: speculative decoding prints the target's greedy text
            assert torch.equal(outs[1].sequences, plain[1].sequences)


@needs_compiler
def test_compiled_speedup_measurement_decodes_what_the_eager_one_does(text_pair, tokenizer, task):
    from distillspec.evaluation.measure import measure_speedup

    target, draft = text_pair
    prompts = [e.prompt for e in task.test[:2]]
    runs = [
        measure_speedup(
            target, draft, tokenizer, prompts, gamma=3, temperature=1.0, max_new_tokens=10, seed=0, compile=compile
        )
        for compile in (False, True, "draft")
    ]
    assert runs[0]["speedup_tau"] == runs[1]["speedup_tau"] == runs[2]["speedup_tau"]  # the same blocks
    assert all(r["measured_speedup"] > 0 and r["c"] > 0 for r in runs)


def test_the_compile_knobs_take_false_true_or_draft():
    from distillspec.config import load_config

    cfg = load_config(None, ["serve.compile=draft", "eval.compile=true"])
    assert cfg.compile_knobs == {"eval.compile": True, "serve.compile": "draft"}
    with pytest.raises(DistillSpecError, match="did you mean 'draft'"):
        load_config(None, ["serve.compile=drafts"])
    with pytest.raises(DistillSpecError, match="serve.compile=draft compiles this project's decoder"):
        load_config(None, ["serve.compile=draft", "serve.backend=vllm"])


def test_compiling_on_a_cpu_where_the_kernel_runs_a_steps_layers_is_warned_of(tiny_garden, monkeypatch):
    """Compiled steps keep torch's operators around their products, and eager ones on an x86 CPU run a step's layers
    in one call of the project's kernel: a job that compiles there is told, once, to leave it off."""
    from distillspec.config import load_config
    from distillspec.models import few_rows, pretrained
    from distillspec.tasks.data import arith_task

    pair, task = [f"target={tiny_garden.target}", f"draft={tiny_garden.draft}"], arith_task(n_train=8, n_test=4)
    for knobs, kernel in ([], True), (["serve.compile=draft"], True), (["eval.compile=true"], False):
        reason = None if kernel else "DISTILLSPEC_FEW_ROWS=0"
        monkeypatch.setattr(few_rows, "unavailable_reason", lambda reason=reason: reason)
        lines = []
        pretrained.prepare_models(load_config(None, [*pair, *knobs]), task, log=lines.append)
        warned = [line for line in lines if "compiled steps keep torch's operators" in line]
        assert len(warned) == (1 if knobs and kernel else 0)
        assert all(line.startswith("warning: serve.compile=draft: ") for line in warned)


def test_compile_is_refused_before_anything_starts_for_other_architectures(tmp_path, tiny_garden, monkeypatch):
    from transformers import AutoTokenizer

    from distillspec.models.loading import check_pair_sources

    target, draft = str(tiny_garden.target), str(tiny_garden.draft)
    check_pair_sources(target, draft, compile={"eval.compile": True})  # Llama: accepted
    tokenizer = AutoTokenizer.from_pretrained(tiny_garden.target)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))
    gpt2.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    gpt2 = str(tmp_path / "gpt2")
    check_pair_sources(target, gpt2)  # eager decoding runs any architecture
    with pytest.raises(DistillSpecError, match="eval.compile=true: .* is a 'gpt2' model"):
        check_pair_sources(target, gpt2, compile={"eval.compile": True})
    with pytest.raises(DistillSpecError, match="serve.compile=draft: .* is a 'gpt2' model.*set serve.compile=false"):
        check_pair_sources(target, gpt2, compile={"eval.compile": False, "serve.compile": "draft"})
    check_pair_sources(gpt2, draft, compile={"serve.compile": "draft"})  # a gpt2 target stays eager: accepted
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(DistillSpecError, match=r"serve.compile=draft: .*no-such-compiler.*set serve.compile=false"):
        check_pair_sources(target, draft, compile={"serve.compile": "draft"})
    check_pair_sources(target, draft, compile={"serve.compile": False})  # nothing compiles: no compiler needed


def test_step_times_run_every_model_and_width_in_turn_on_the_same_cache(text_pair, monkeypatch):
    """One round of every (model, k) per step, warm-up included, each call rolled back: what the costs c and v and
    the speed suite's predictions rest on."""
    from distillspec.decoding import kvcache
    from distillspec.decoding.metrics import measure_cost_ratio, step_times

    target, draft = text_pair
    calls, step = [], kvcache.CachedLM.step

    def spy(self, tokens, valid=None, last_only=False):
        calls.append((self.model is target, tokens.shape[1], int(self.next_pos[0])))
        return step(self, tokens, valid, last_only)

    monkeypatch.setattr(kvcache.CachedLM, "step", spy)
    ids = torch.randint(10, 100, (1, 12))
    times = step_times([target, draft], [[1, 4], [1]], ids, steps=3, warmup=1)
    assert [sorted(t) for t in times] == [[1, 4], [1]] and all(ms > 0 for t in times for ms in t.values())
    assert calls == [(True, 1, 12), (True, 4, 12), (False, 1, 12)] * 4
    cost = measure_cost_ratio(target, draft, ids, gamma=3, steps=2, warmup=1)
    assert cost.c == pytest.approx(cost.draft_ms / cost.target_ms)
    assert cost.v == pytest.approx(cost.verify_ms / cost.target_ms)
