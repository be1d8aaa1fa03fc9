"""ROUGE-2 and ROUGE-L F-measures computed by rouge-score, averaged over the predictions."""

import evaluate
from rouge_score import rouge_scorer

from distillspec.tasks.scores import info

_DESCRIPTION = "Mean ROUGE-2 and ROUGE-L F-measures (0-1, Porter stemming) computed by rouge-score (Lin, 2004)."
_KWARGS = """
Args:
    predictions: summaries (strings).
    references: one reference summary per prediction (strings).
Returns:
    rouge2, rougeL: mean F-measures in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Rouge(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return info.metric_info(
            _DESCRIPTION,
            _KWARGS,
            "Lin, ROUGE: A Package for Automatic Evaluation of Summaries, ACL workshop 2004",
            info.TEXT_INPUTS,
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        scorer = rouge_scorer.RougeScorer(["rouge2", "rougeL"], use_stemmer=True)
        scores = [scorer.score(r, p) for p, r in zip(predictions, references)]
        return {k: sum(s[k].fmeasure for s in scores) / len(scores) for k in ("rouge2", "rougeL")}
