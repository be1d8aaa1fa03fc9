"""Loading a model over weights another process shares (distillspec.models.loading.share_weights)."""

from __future__ import annotations

import logging

import pytest
import torch

from distillspec.models import few_rows
from distillspec.models.loading import SharedWeights, file_weights, load_model, share_weights
from distillspec.models.packing import FewRowLinear, Int4Linear, PackedLinear, grid_layouts

from .conftest import needs_compiler, on_4_bit_grids, tiny_llama


def _saved(tmp_path, tokenizer, *, tied: bool) -> str:
    model = tiny_llama(len(tokenizer), d=32, layers=2, seed=3)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _through_pickle(shared: SharedWeights) -> SharedWeights:
    """As the object store hands it out: arrays read-only, not the sharer's."""
    arrays = {k: a.copy() for k, a in shared.arrays.items()}
    layouts = {k: a.copy() for k, a in shared.layouts.items()}
    for a in [*arrays.values(), *layouts.values()]:
        a.flags.writeable = False
    return SharedWeights(shared.name, shared.dtype, arrays, shared.dtypes, layouts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_model_built_over_shared_weights_is_the_model_and_holds_no_copy(tmp_path, tokenizer, dtype, tied):
    name = _saved(tmp_path, tokenizer, tied=tied)
    own, _ = load_model(name, dtype=dtype)
    shared = _through_pickle(share_weights(own, name))
    built, _ = load_model(name, dtype=dtype, shared=shared)
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    assert torch.equal(_logits(built, ids), _logits(own, ids))
    # every parameter and buffer (the rotary table too) is a view of the shared arrays, frozen
    addresses = {a.__array_interface__["data"][0] for a in shared.arrays.values()}
    tensors = [*built.parameters(), *built.buffers()]
    assert all(t.data_ptr() in addresses for t in tensors)
    assert not any(p.requires_grad for p in built.parameters())
    head, embeddings = built.get_output_embeddings().weight, built.get_input_embeddings().weight
    assert (head is embeddings) == tied
    assert shared.nbytes == sum(t.numel() * t.element_size() for t in tensors)


def test_shared_weights_of_another_model_or_dtype_are_not_used(tmp_path, tokenizer, caplog):
    name = _saved(tmp_path, tokenizer, tied=False)
    shared = share_weights(load_model(name, dtype="bfloat16")[0], name)
    with caplog.at_level(logging.WARNING):
        model, _ = load_model(name, dtype="float32", shared=shared)
    assert model.dtype == torch.float32 and "loading it" in caplog.text
    addresses = {a.__array_interface__["data"][0] for a in shared.arrays.values()}
    assert not any(p.data_ptr() in addresses for p in model.parameters())


@needs_compiler
@pytest.mark.skipif(
    few_rows.unavailable_reason() is not None or not few_rows.bf16_rows(),
    reason="bfloat16 rows take an x86 CPU with AVX512-BF16",
)
def test_a_bfloat16_target_shares_its_few_row_layout_with_the_processes_that_decode(tmp_path, tokenizer):
    """A decoding target is laid out over the shared layouts (no copy of its own) and gives the logits of one laid
    out by itself; a target that only scores (kernel=onednn) keeps the shared dense weights."""
    name = _saved(tmp_path, tokenizer, tied=False)
    own, _ = load_model(name, dtype="bfloat16", prepack=True)
    shared = _through_pickle(share_weights(load_model(name, dtype="bfloat16")[0], name, layouts=True))
    assert len(shared.layouts) == 2 * 7 + 1  # every linear layer, the head among them
    built, _ = load_model(name, dtype="bfloat16", prepack=True, shared=shared)
    layers = [m for m in built.modules() if isinstance(m, PackedLinear)]
    addresses = {a.__array_interface__["data"][0] for a in shared.layouts.values()}
    assert len(layers) == 2 * 7 + 1 and all(m.packed.data_ptr() in addresses for m in layers)
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    assert torch.equal(_logits(built, ids), _logits(own, ids))
    scorer, _ = load_model(name, dtype="bfloat16", prepack=True, shared=shared, kernel="onednn")
    assert isinstance(scorer.lm_head, FewRowLinear)
    dense = {a.__array_interface__["data"][0] for a in shared.arrays.values()}
    assert scorer.lm_head.weight.data_ptr() in dense


@needs_compiler
@pytest.mark.skipif(
    few_rows.unavailable_reason() is not None or not few_rows.bf16_rows() or not few_rows.int4(),
    reason="bfloat16 rows take an x86 CPU with AVX512-BF16",
)
def test_a_target_on_4_bit_grids_shares_its_4_bit_layers_with_the_processes_that_decode(tmp_path, tokenizer):
    """prepack=int4 over shared weights: the sharer finds the layers on 4-bit grids on the float32 weights and shares
    them in 4 bits, the rest in the few-row layout; a decoding target is built over those layouts (no copy of its
    own) and gives the logits of one that loaded itself; a target that only scores keeps the shared dense weights."""
    on_4_bit_grids(tiny_llama(len(tokenizer), d=32, layers=2, seed=3)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    name = str(tmp_path)
    own, _ = load_model(name, dtype="bfloat16", prepack="int4")
    model, _ = load_model(name, dtype="bfloat16")
    int4 = grid_layouts(model, file_weights(name))  # as the run's sharing task finds them: on the file's values
    assert not grid_layouts(model)  # (the bfloat16 weights lie on no grid)
    shared = _through_pickle(share_weights(model, name, layouts=True, int4=int4))
    assert len(int4) == 2 * 7 and len(shared.layouts) == 2 * 7 + 1  # the decoder layers in 4 bits; the head not
    built, _ = load_model(name, dtype="bfloat16", prepack="int4", shared=shared)
    layers = [m for m in built.modules() if isinstance(m, (Int4Linear, PackedLinear))]
    addresses = {a.__array_interface__["data"][0] for a in shared.layouts.values()}
    assert len(layers) == 2 * 7 + 1 and all(m.packed.data_ptr() in addresses for m in layers)
    assert sum(isinstance(m, Int4Linear) for m in layers) == 2 * 7
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    assert torch.equal(_logits(built, ids), _logits(own, ids))
    scorer, _ = load_model(name, dtype="bfloat16", prepack="int4", shared=shared, kernel="onednn")
    assert not any(isinstance(m, Int4Linear) for m in scorer.modules())
    assert scorer.lm_head.weight.data_ptr() in {a.__array_interface__["data"][0] for a in shared.arrays.values()}
