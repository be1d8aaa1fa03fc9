"""DistillSpec: speculative decoding and draft-model distillation (Zhou et al., ICLR 2024)."""

from distillspec.divergences import (
    DIVERGENCES,
    TopKLogprobs,
    compress_topk,
    divergence,
    forward_kl,
    jsd,
    reverse_kl,
    tvd,
)
from distillspec.errors import DistillSpecError
from distillspec.metrics import alpha_from_tvd, expected_tau, measure_cost_ratio, predicted_speedup
from distillspec.speculative import (
    LENIENCES,
    GenerationOutput,
    SpecStats,
    autoregressive_generate,
    speculative_generate,
)

__all__ = [
    "DIVERGENCES",
    "LENIENCES",
    "DistillSpecError",
    "GenerationOutput",
    "SpecStats",
    "TopKLogprobs",
    "alpha_from_tvd",
    "autoregressive_generate",
    "compress_topk",
    "divergence",
    "expected_tau",
    "forward_kl",
    "jsd",
    "measure_cost_ratio",
    "predicted_speedup",
    "reverse_kl",
    "speculative_generate",
    "tvd",
]
