"""The learner (distillspec/training/learner.py): its losses, steps, freezing and checkpoints, and the single-process
loop."""

import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from distillspec import DistillSpecError
from distillspec.config import RECIPES, DistillConfig, build, resolve_recipe
from distillspec.tasks.data import Example
from distillspec.training.divergences import divergence
from distillspec.training.learner import Distiller, Learner, make_optimizer
from distillspec.training.losses import forward_logits, kd_loss
from distillspec.training.rollout import draw_source, encode_examples, generate_batch

from .conftest import tiny_llama


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_kd_step_lowers_loss_on_fixed_batch(text_pair, tokenizer, task, name):
    target, draft = text_pair
    draft = AutoModelForCausalLM.from_config(draft.config)
    draft.load_state_dict(text_pair[1].state_dict())
    batch = encode_examples(tokenizer, task.train[:8], max_len=96)
    recipe = resolve_recipe(DistillConfig(recipe="supkd", divergence=name))
    optimizer, _ = make_optimizer(draft, 3e-3, steps=10, warmup_steps=0)
    losses = []
    for _ in range(6):
        loss = kd_loss(draft, target, batch, recipe)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_a_long_training_prompt_keeps_its_last_tokens(text_pair, tokenizer, task):
    """One very long prompt among short ones: the batch it joins stays within max_prompt_tokens + max_new_tokens
    columns (without the limit, every batch it joined would be as wide as it)."""
    target, draft = text_pair
    long = Example(prompt="1+2+3+" * 200 + "4=", reference="")
    batch = generate_batch(
        "draft", target, draft, tokenizer, [long, *task.train[:3]], max_new_tokens=4, temperature=1.0,
        max_prompt_tokens=24,
    )  # fmt: skip
    assert batch.input_ids.shape[1] <= 24 + 4
    ending = tokenizer(long.prompt, add_special_tokens=False)["input_ids"][-8:]
    assert batch.input_ids[0, 24 - 8 : 24].tolist() == ending  # the prompt's end (the question) is kept


def test_batch_layout(tokenizer, task):
    batch = encode_examples(tokenizer, task.train[:4], max_len=128)
    for row, ex in enumerate(task.train[:4]):
        cont = tokenizer(ex.reference, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        predicted = batch.input_ids[row, 1:][batch.loss_mask[row, :-1].bool()]
        assert predicted.tolist() == cont  # the loss covers exactly the reference and its EOS
    assert (batch.attention_mask[:, -1] + (batch.loss_mask.sum(1) > 0)).all()


@pytest.mark.parametrize("name", ["fkl", "jsd", "tvd"])
def test_loss_window_skips_only_unused_prompt_logits(text_pair, tokenizer, task, name):
    target, draft = text_pair
    batch = encode_examples(tokenizer, task.train[:6], max_len=96)
    assert 0 < batch.window == int(batch.loss_mask.any(0).nonzero()[0])
    assert forward_logits(draft, batch).shape[1] == batch.input_ids.shape[1] - batch.window
    with torch.no_grad():
        full = divergence(
            name, forward_logits(draft, batch, start=0), forward_logits(target, batch, start=0), batch.loss_mask
        )
        windowed = kd_loss(draft, target, batch, resolve_recipe(DistillConfig(recipe="supkd", divergence=name)))
    torch.testing.assert_close(windowed, full)


def test_recipes_and_sources():
    assert set(RECIPES) == {"supkd", "seqkd", "imitkd", "fdistill", "gkd", "distillspec"}
    rng = random.Random(0)
    mixed = resolve_recipe(DistillConfig(recipe="gkd", lambda1=0.5, lambda2=0.5, divergence="tvd"))
    counts = {s: 0 for s in ("fixed", "draft", "target")}
    for _ in range(4000):
        counts[draw_source(rng, mixed)] += 1
    assert abs(counts["fixed"] / 4000 - 0.5) < 0.03 and abs(counts["draft"] / 4000 - 0.25) < 0.03
    assert draw_source(rng, RECIPES["supkd"]) == "fixed"
    for data, key in [({"recipe": "minillm"}, "recipe='minillm'"), ({"divergence": "l2"}, "divergence='l2'")]:
        with pytest.raises(DistillSpecError, match=key):
            build(DistillConfig, data)
    with pytest.raises(DistillSpecError, match="lambda1=1.5: input should be less than or equal to 1"):
        build(DistillConfig, {"lambda1": 1.5})


@pytest.mark.parametrize(
    ("lambda1", "lambda2", "source"), [(1.0, 0.0, "fixed"), (0.0, 1.0, "draft"), (0.0, 0.0, "target")]
)
def test_distiller_steps_from_each_source(text_pair, tokenizer, task, tmp_path, lambda1, lambda2, source):
    target, draft = text_pair
    draft = AutoModelForCausalLM.from_config(draft.config)
    cfg = DistillConfig(recipe="gkd", lambda1=lambda1, lambda2=lambda2, steps=2, batch_size=4, max_new_tokens=8)
    distiller = Distiller(target, draft, tokenizer, task.train, cfg)
    before = [p.detach().clone() for p in draft.parameters()]
    records = distiller.run()
    assert [r["source"] for r in records] == [source, source]
    assert all(r["tokens"] > 0 and torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert any(not torch.equal(a, b) for a, b in zip(before, draft.parameters()))
    draft.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.lm_head.weight, draft.lm_head.weight)


def test_empty_dataset_is_refused(text_pair, tokenizer):
    with pytest.raises(DistillSpecError, match="empty"):
        Distiller(*text_pair, tokenizer, [], DistillConfig())


def test_bfloat16_target(text_pair, tokenizer, task, tmp_path, monkeypatch, caplog):
    """dtype=bfloat16: the frozen target loads in bfloat16, the draft stays float32 and trains, and greedy
    SD still gives the (bfloat16) target's own greedy output."""
    from distillspec.config import load_config
    from distillspec.decoding.speculative import autoregressive_generate, speculative_generate
    from distillspec.models import loading
    from distillspec.models.loading import encode_prompts, load_pair

    for name, model in zip(("target", "draft"), text_pair):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    cfg = load_config(None, [f"target={tmp_path / 'target'}", f"draft={tmp_path / 'draft'}", "dtype=bfloat16"])
    monkeypatch.setattr(loading, "native_bf16", lambda device="cpu": False)  # an AVX2-only CPU: a warning
    with caplog.at_level(logging.WARNING, logger="distillspec.models.loading"):
        load_pair(cfg.target, cfg.draft)
        assert not caplog.records
        target, draft, _ = load_pair(cfg.target, cfg.draft, dtype=cfg.dtype)
        assert "dtype=bfloat16 on a CPU that has no hardware for it" in caplog.text
    assert target.dtype == torch.bfloat16 and draft.dtype == torch.float32
    for example in task.test[:6]:
        ids, _ = encode_prompts(tokenizer, [example.prompt])
        own = autoregressive_generate(target, ids, max_new_tokens=12, temperature=0)
        sd = speculative_generate(target, draft, ids, gamma=3, max_new_tokens=12, temperature=0)
        assert torch.equal(sd.sequences, own.sequences)
    dcfg = DistillConfig(recipe="distillspec", steps=2, batch_size=4, max_new_tokens=8)
    before = [p.detach().clone() for p in draft.parameters()]
    records = Distiller(target, draft, tokenizer, task.train, dcfg).run()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert any(not torch.equal(a, b) for a, b in zip(before, draft.parameters()))
    assert draft.dtype == torch.float32


def test_dtype_auto_is_bfloat16_only_for_a_weight_bound_target_on_bfloat16_hardware(text_pair, tokenizer, tmp_path):
    from distillspec.models import loading
    from distillspec.models.loading import resolve_dtype

    text_pair[0].save_pretrained(tmp_path)
    assert resolve_dtype("float16", str(tmp_path)) == ("float16", "set by dtype")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "native_bf16", lambda device="cpu": True)
        assert resolve_dtype("auto", str(tmp_path))[0] == "float32"  # a small target
        mp.setattr(loading, "AUTO_BF16_BYTES", 1)
        assert resolve_dtype("auto", str(tmp_path))[0] == "bfloat16"
        mp.setattr(loading, "native_bf16", lambda device="cpu": False)
        dtype, why = resolve_dtype("auto", str(tmp_path))
        assert dtype == "float32" and "without native bfloat16" in why


def test_the_draft_trains_under_bfloat16_autocast_where_the_pair_runs_in_bfloat16(text_pair, tokenizer, tmp_path):
    from distillspec.config import load_config
    from distillspec.models import few_rows, loading, pretrained
    from distillspec.tasks.data import arith_task

    for name, model in zip(("target", "draft"), text_pair):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    pair = [f"target={tmp_path / 'target'}", f"draft={tmp_path / 'draft'}"]
    task, lines = arith_task(n_train=8, n_test=4), []
    cfg = pretrained.prepare_models(load_config(None, pair), task, log=lines.append)
    assert cfg.distill.bf16 is False and cfg.prepack is False  # a small target: float32, not packed
    assert "the draft trains in float32" in lines[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "native_bf16", lambda device="cpu": True)
        mp.setattr(pretrained, "native_bf16", lambda device="cpu": True)
        mp.setattr(loading, "AUTO_BF16_BYTES", 1)
        cfg = pretrained.prepare_models(load_config(None, pair), task, log=lines.append)
        assert cfg.dtype == "bfloat16" and cfg.distill.bf16 is True
        assert "under bfloat16 autocast" in lines[-1]
        assert Learner(text_pair[1], None, cfg.distill, objective=lambda *a: None).bf16
        cfg = pretrained.prepare_models(load_config(None, [*pair, "distill.bf16=false"]), task, log=lines.append)
        assert cfg.distill.bf16 is False
    cfg = pretrained.prepare_models(load_config(None, [*pair, "dtype=float32", "prepack=true"]), task, log=lines.append)
    assert cfg.prepack is True and "(set by prepack)" in lines[-1]
    assert ("laid out for the few-row kernel" if few_rows.available() else "prepacked for oneDNN") in lines[-1]


def test_train_top_k_trains_the_last_k_decoder_layers_only():
    from distillspec.config import load_config
    from distillspec.training.learner import freeze_all_but_layers

    model = tiny_llama(64, d=32, layers=4)
    trained = freeze_all_but_layers(model, top=2)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".layers.2." in n or ".layers.3." in n for n in names)
    assert trained == sum(p.numel() for n, p in model.named_parameters() if n in names)
    with pytest.raises(DistillSpecError, match="has 4 decoder layers"):
        freeze_all_but_layers(model, top=5)
    assert load_config(None, ["distill.train=top:8"]).distill.train == "top:8"
    with pytest.raises(DistillSpecError, match="distill.train"):
        load_config(None, ["distill.train=top:0"])


def assert_resumes_as_uninterrupted(learner: Learner, target, cfg: DistillConfig, batch) -> None:
    """A learner resumed from ``learner``'s draft and state takes the same next step on ``batch`` as ``learner``."""
    import copy

    resumed = Learner(copy.deepcopy(learner.draft), target, cfg, bf16=False)
    resumed.load_state_dict(copy.deepcopy(learner.state_dict()))
    learner.step(batch), resumed.step(batch)
    for (name, mine), theirs in zip(learner.draft.state_dict().items(), resumed.draft.state_dict().values()):
        torch.testing.assert_close(mine, theirs, msg=name)


def test_lora_steps_as_lora_and_keeps_the_draft_an_ordinary_model(text_pair, tokenizer, task):
    """``distill.train=lora:R``: the gradients of A and B are those of an explicit LoRA forward (W0 + B A through
    ``functional_call``), each step moves the adapted weights by B A alone (rank <= R, everything else as it was),
    the draft keeps its parameter names (a copy of it is an ordinary model), and a resumed learner carries on as the one
    that never stopped."""
    import copy

    from torch.func import functional_call

    from distillspec.config import load_config

    target, base = text_pair
    draft = copy.deepcopy(base)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    cfg = DistillConfig(recipe="supkd", divergence="fkl", train="lora:2", lr=1e-2, warmup_steps=0, steps=10)
    learner = Learner(draft, target, cfg, bf16=False)
    assert len(learner.adapter.weights) == 7  # q, k, v, o, gate, up, down of the one decoder layer
    batch = encode_examples(tokenizer, task.train[:4], max_len=64)
    with torch.no_grad():  # B starts at 0: the draft is as it was; give B a value so dA is not 0 either
        for b in learner.adapter.b:
            b.normal_(0, 0.01)
        learner.adapter.merge()
    names = {id(w): n for n, w in draft.named_parameters()}
    recipe = resolve_recipe(cfg)

    def explicit_loss(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
        lora = learner.adapter
        weights = {names[id(w)]: w0 + bi @ ai for w, (a0, b0), ai, bi in
                   zip(lora.weights, lora.merged, a, b) for w0 in [w.detach() - b0 @ a0]}  # fmt: skip
        model = lambda **kw: functional_call(draft, weights, args=(), kwargs=kw)
        model.config = draft.config
        return kd_loss(model, target, batch, recipe)

    a = [x.detach().clone().requires_grad_() for x in learner.adapter.a]
    b = [x.detach().clone().requires_grad_() for x in learner.adapter.b]
    explicit_loss(a, b).backward()
    learner.optimizer.zero_grad(set_to_none=True)  # the adapted layers' hooks saw that pass too
    kd_loss(draft, target, batch, recipe).backward()
    learner.adapter.gradients()
    for mine, theirs in zip(learner.adapter.params, [*a, *b]):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6)
    assert all(w.grad is None for w in learner.adapter.weights)
    learner.optimizer.zero_grad(set_to_none=True)

    start = {k: v.clone() for k, v in draft.state_dict().items()}
    record = learner.step(batch)
    assert set(draft.state_dict()) == set(before)
    adapted = {names[id(w)] for w in learner.adapter.weights}
    for name, value in draft.state_dict().items():
        moved = value - before[name]  # W0 + B A: B A of rank 2 at most, and this step moved it
        if name in adapted:
            assert not torch.equal(value, start[name]) and torch.linalg.matrix_rank(moved, atol=1e-6) <= 2
        else:
            assert torch.equal(moved, torch.zeros_like(moved))
    losses = [record["loss"]] + [learner.step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]

    # A copy of the trained draft is an ordinary model: the same outputs, and no factor of its own takes gradients.
    copied, ids = copy.deepcopy(draft), batch.input_ids[:1]
    assert draft(input_ids=ids).logits.requires_grad and not copied(input_ids=ids).logits.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(copied(input_ids=ids).logits, draft(input_ids=ids).logits)

    assert_resumes_as_uninterrupted(learner, target, cfg, batch)

    assert load_config(None, ["distill.train=lora:16"]).distill.train == "lora:16"
    with pytest.raises(DistillSpecError, match="distill.train"):
        load_config(None, ["distill.train=lora:0"])
    with pytest.raises(DistillSpecError, match="float32"):
        Learner(copy.deepcopy(base).to(torch.bfloat16), target, cfg)


def test_scales_train_the_draft_on_the_grids_its_4bit_decoding_copy_holds(text_pair, tokenizer, task):
    """``distill.train=scales``: the draft starts as its 4-bit rounding (``int4_groups``, as a 4-bit decoding copy
    rounds it), the gradients of the groups' scales and zero points are those of an explicit forward through
    ``(code - 8) * scale + zero``, the steps move the scales and zero points alone (the codes stay, and rounding the
    trained weights to 4 bits again gives them back exactly: what a 4-bit decoding copy holds is what trained), the
    loss falls, and a resumed learner carries on as the one that never stopped."""
    import copy

    from torch.func import functional_call

    from distillspec.config import load_config
    from distillspec.models.packing import INT4_GROUP, int4_groups

    target, base = text_pair
    draft = copy.deepcopy(base)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    cfg = DistillConfig(recipe="supkd", divergence="fkl", train="scales", lr=1e-3, warmup_steps=0, steps=10)
    learner = Learner(draft, target, cfg, bf16=False)
    grids = learner.adapter
    names = {id(w): n for n, w in draft.named_parameters()}
    rounded = {names[id(w)] for w in grids.weights}
    tied = draft.get_output_embeddings().weight is draft.get_input_embeddings().weight
    assert len(grids.weights) == 7 + (not tied)  # q, k, v, o, gate, up, down of the one decoder layer (and the head)

    def dequantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales_zeros = int4_groups(weight)
        rows, cols = weight.shape
        scale, zero = scales_zeros.transpose(0, 1).reshape(rows, cols // INT4_GROUP, 1, 2).unbind(-1)
        groups = (codes.reshape(rows, -1, INT4_GROUP) - 8) * scale + zero
        return groups.reshape(rows, cols), codes

    for name, value in draft.state_dict().items():  # the draft as its 4-bit decoding copy holds it
        if name in rounded:
            torch.testing.assert_close(value, dequantized(before[name])[0], rtol=0, atol=1e-6)
        else:
            assert torch.equal(value, before[name])

    batch = encode_examples(tokenizer, task.train[:4], max_len=64)
    recipe = resolve_recipe(cfg)

    def explicit_loss(scale: list[torch.Tensor], zero: list[torch.Tensor]) -> torch.Tensor:
        weights = {names[id(w)]: (codes.float() * s[..., None] + z[..., None]).reshape(w.shape)
                   for w, codes, s, z in zip(grids.weights, grids.codes, scale, zero)}  # fmt: skip
        model = lambda **kw: functional_call(draft, weights, args=(), kwargs=kw)
        model.config = draft.config
        return kd_loss(model, target, batch, recipe)

    scale = [x.detach().clone().requires_grad_() for x in grids.scale]
    zero = [x.detach().clone().requires_grad_() for x in grids.zero]
    explicit_loss(scale, zero).backward()
    learner.optimizer.zero_grad(set_to_none=True)
    kd_loss(draft, target, batch, recipe).backward()
    grids.gradients()
    for mine, theirs in zip(grids.params, [*scale, *zero]):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-6)
    assert all(w.grad is None for w in grids.weights)
    learner.optimizer.zero_grad(set_to_none=True)

    start = {k: v.clone() for k, v in draft.state_dict().items()}
    losses = [learner.step(batch)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0]
    assert set(draft.state_dict()) == set(before)
    for name, value in draft.state_dict().items():
        if name in rounded:  # moved, on the grids of the same codes
            again, codes = dequantized(value)
            assert not torch.equal(value, start[name])
            groups, first = codes.view(len(codes), -1, INT4_GROUP), dequantized(start[name])[1].view(len(codes), -1, 32)
            # a group whose scale crossed 0 is found with its codes the other way up (a grid of positive steps)
            assert ((groups == first).all(-1) | (groups == 15 - first).all(-1)).all()
            torch.testing.assert_close(again, value, rtol=0, atol=1e-5)
        else:
            assert torch.equal(value, start[name])

    assert_resumes_as_uninterrupted(learner, target, cfg, batch)
    assert load_config(None, ["distill.train=scales"]).distill.train == "scales"
