"""Loading a model over weights another process shares (distillspec.models.loading.share_weights)."""

from __future__ import annotations

import logging

import pytest
import torch

from distillspec.models.loading import SharedWeights, load_model, share_weights

from .conftest import tiny_llama


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
    for a in arrays.values():
        a.flags.writeable = False
    return SharedWeights(shared.name, shared.dtype, arrays, shared.dtypes)


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
