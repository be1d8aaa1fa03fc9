"""Acceptance rate alpha: accepted / judged draft tokens (the estimate of 1 - E[TVD(p, q)])."""

import evaluate

from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.tasks.scores import info

_DESCRIPTION = (
    "Acceptance rate alpha: accepted / judged draft tokens (the estimate of 1 - E[TVD(p, q)])." + info.COUNTS_SOURCE
)
_KWARGS = (
    info.COUNT_ARGS
    + """Returns:
    acceptance_rate: in [0, 1].
"""
)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class AcceptanceRate(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return info.metric_info(_DESCRIPTION, _KWARGS, info.DISTILLSPEC, info.COUNT_INPUTS)

    def _compute(self, blocks: list[int], accepted: list[int], rejected: list[int]) -> dict[str, float]:
        return {"acceptance_rate": AcceptanceCounts(sum(blocks), sum(accepted), sum(rejected)).alpha}
