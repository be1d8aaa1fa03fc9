"""Shared fixtures: tiny real Llama models and a tokenizer trained on the embedded task."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distillspec.config import ModelSize
from distillspec.data import arith_task
from distillspec.garden import make_model, train_tokenizer

torch.set_num_threads(2)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def tiny_llama(vocab: int, d: int = 32, layers: int = 1, seed: int = 0, sharpness: float = 1.0) -> LlamaForCausalLM:
    """A random-init Llama; ``sharpness`` scales the output layer (peakier distributions, no near-ties)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=layers,
        intermediate_size=2 * d,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.eos_token_id = None  # compare full-length outputs with HF generate
    return model


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 0) -> LlamaForCausalLM:
    """A copy of ``model`` with noise on every weight: a draft that agrees often but not always."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


@pytest.fixture(scope="session")
def task():
    return arith_task(n_train=400, n_test=40, seed=0)


@pytest.fixture(scope="session")
def tokenizer(task):
    return train_tokenizer([e.prompt + e.reference for e in task.train], vocab_size=300)


@pytest.fixture(scope="session")
def text_pair(tokenizer):
    """Random-init target (2 layers) and draft (1 layer) over the garden tokenizer."""
    target = make_model(ModelSize(d_model=64, n_layers=2, n_heads=2, d_ff=128), tokenizer).eval()
    torch.manual_seed(1)
    draft = make_model(ModelSize(d_model=32, n_layers=1, n_heads=2, d_ff=64), tokenizer).eval()
    return target, draft
