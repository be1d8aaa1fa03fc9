"""GSM8K accuracy: the share of answers whose final number equals the reference's."""

import evaluate

from distillspec.tasks.scores import final_number, info

_DESCRIPTION = (
    "Exact-match accuracy of the final number of each answer (the number after '####', else the last number), "
    "as GSM8K is scored (Cobbe et al., 2021)."
)
_KWARGS = """
Args:
    predictions: generated solutions (strings).
    references: reference solutions (strings, GSM8K's '#### <answer>' format or any text ending in the answer).
Returns:
    accuracy: the share of predictions whose final number equals the reference's, in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Gsm8kAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return info.metric_info(
            _DESCRIPTION,
            _KWARGS,
            "Cobbe et al., Training Verifiers to Solve Math Word Problems, arXiv 2110.14168 (2021)",
            info.TEXT_INPUTS,
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        hits = [
            final_number(p) is not None and final_number(p) == final_number(r) for p, r in zip(predictions, references)
        ]
        return {"accuracy": sum(hits) / len(hits) if hits else float("nan")}
