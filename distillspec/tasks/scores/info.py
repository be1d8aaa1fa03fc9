"""What the shipped ``evaluate`` modules share: their inputs, descriptions and ``MetricInfo``. Only those modules
import this, under ``evaluate.load``, so ``datasets`` and ``evaluate`` are imported here at the top."""

from __future__ import annotations

import datasets
import evaluate

#: The inputs of the task scores and of the speculative-decoding measures (``datasets`` value types).
TEXT_INPUTS = {"predictions": "string", "references": "string"}
COUNT_INPUTS = {"blocks": "int64", "accepted": "int64", "rejected": "int64"}
#: What the speculative-decoding measures are computed from, and their arguments.
COUNTS_SOURCE = (
    " Computed from per-request counts of speculative decoding, as both this project's decoder and vLLM's scheduler "
    "count them (Leviathan et al., 2023; Zhou et al., 2024)."
)
COUNT_ARGS = """
Args:
    blocks: draft-and-verify blocks (target calls) of each request.
    accepted: draft tokens the target accepted, per request.
    rejected: blocks that ended in a rejection, per request.
"""
DISTILLSPEC = "Zhou et al., DistillSpec: Improving Speculative Decoding via Knowledge Distillation, ICLR 2024"


def metric_info(
    description: str, inputs_description: str, citation: str, inputs: dict[str, str]
) -> evaluate.MetricInfo:
    """The ``evaluate.MetricInfo`` of a shipped module whose inputs are columns of ``datasets`` value types."""
    return evaluate.MetricInfo(
        description=description,
        citation=citation,
        inputs_description=inputs_description,
        features=datasets.Features({name: datasets.Value(kind) for name, kind in inputs.items()}),
    )
