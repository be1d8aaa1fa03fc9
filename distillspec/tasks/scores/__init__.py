"""The project's scores as Hugging Face ``evaluate`` modules, shipped in the package and loaded offline by path.

    >>> from distillspec.tasks import scores
    >>> scores.load("bleu").compute(predictions=["ein Hund läuft im Park"], references=["ein Hund läuft im Park"])
    {'bleu': 100.00000000000004}

Task scores: ``gsm8k_accuracy`` (the final number of each answer), ``bleu`` (sacrebleu), ``rouge`` (rouge-score
ROUGE-2 and ROUGE-L). Speculative-decoding measures, from per-request counts (``blocks``, ``accepted``,
``rejected``: see :class:`distillspec.decoding.metrics.AcceptanceCounts`): ``acceptance_rate`` (alpha) and
``block_efficiency`` (tau).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from distillspec.config import check_choice

HERE = Path(__file__).resolve().parent
NAMES = ("gsm8k_accuracy", "bleu", "rouge", "acceptance_rate", "block_efficiency")


def path(name: str) -> str:
    """The folder of the module ``name`` (what ``evaluate.load`` takes)."""
    if name not in NAMES:
        check_choice("score", name, NAMES)
    return str(HERE / name)


@lru_cache
def load(name: str):  # -> evaluate.EvaluationModule
    """``evaluate.load`` of the shipped module ``name``, offline (loaded once per process)."""
    import evaluate  # here: 4.5 s to import (it imports datasets); a process loads it when it asks for a score

    return evaluate.load(path(name))


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


def metric_info(description: str, inputs_description: str, citation: str, inputs: dict[str, str]) -> Any:
    """The ``evaluate.MetricInfo`` of a shipped module whose inputs are columns of ``datasets`` value types."""
    import datasets  # here, as in load: only the shipped modules call this, under evaluate.load
    import evaluate

    return evaluate.MetricInfo(
        description=description,
        citation=citation,
        inputs_description=inputs_description,
        features=datasets.Features({name: datasets.Value(kind) for name, kind in inputs.items()}),
    )
