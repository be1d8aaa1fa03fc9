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
