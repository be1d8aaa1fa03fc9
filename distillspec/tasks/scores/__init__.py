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

import re
from functools import lru_cache
from pathlib import Path

from distillspec.config import check_choice
from distillspec.errors import DistillSpecError

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
    import evaluate  # noqa: PLC0415 (1.2 s of import, made only where a score is computed)

    return evaluate.load(path(name))


def final_number(text: str) -> str | None:
    """The answer of a GSM8K-style solution: the number after '####', else the last number."""
    m = re.search(r"####\s*(-?[\d,]*\.?\d+)", text)
    numbers = [m.group(1)] if m else re.findall(r"-?[\d,]*\.?\d+", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def score(metric: str | None, predictions: list[str], references: list[str]) -> dict[str, float]:
    """Task score through the shipped ``evaluate`` modules (:mod:`distillspec.tasks.scores`): GSM8K answer accuracy,
    sacrebleu BLEU, rouge-score ROUGE-2/L."""
    if metric is None or not predictions:
        return {}
    module = {"accuracy": "gsm8k_accuracy", "bleu": "bleu", "rouge": "rouge"}.get(metric)
    if module is not None:
        return load(module).compute(predictions=predictions, references=references)
    raise DistillSpecError(f"metric={metric!r}: choose accuracy, bleu, rouge or None")
