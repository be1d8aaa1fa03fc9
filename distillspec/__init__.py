"""DistillSpec: speculative decoding and draft-model distillation (Zhou et al., ICLR 2024).

The library API is importable from here; submodules load on first use (PEP 562), so ``import distillspec`` and
the command-line ``--help`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "distillspec.training.divergences": [
        "DIVERGENCES",
        "TopKLogprobs",
        "compress_topk",
        "divergence",
        "forward_kl",
        "jsd",
        "reverse_kl",
        "tvd",
    ],
    "distillspec.errors": ["DistillSpecError"],
    "distillspec.training.learner": ["Learner"],
    "distillspec.training.batches": ["RolloutBatch", "SampleBuffer"],
    "distillspec.training.rollout": ["Sampler"],
    "distillspec.decoding.metrics": [
        "AcceptanceCounts",
        "alpha_from_tvd",
        "expected_tau",
        "measure_cost_ratio",
        "predicted_speedup",
    ],
    "distillspec.decoding.speculative": [
        "LENIENCES",
        "GenerationOutput",
        "SpecStats",
        "autoregressive_generate",
        "speculative_generate",
    ],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'distillspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
