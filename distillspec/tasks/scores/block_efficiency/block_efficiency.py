"""Block efficiency tau: tokens per target call (accepted + 1 per block), at most gamma + 1."""

import evaluate

from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.tasks import scores

_DESCRIPTION = (
    "Block efficiency tau: tokens per target call (accepted + 1 per block), at most gamma + 1." + scores.COUNTS_SOURCE
)
_KWARGS = (
    scores.COUNT_ARGS
    + """Returns:
    block_efficiency: in [1, gamma + 1].
"""
)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class BlockEfficiency(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return scores.metric_info(_DESCRIPTION, _KWARGS, scores.DISTILLSPEC, scores.COUNT_INPUTS)

    def _compute(self, blocks: list[int], accepted: list[int], rejected: list[int]) -> dict[str, float]:
        return {"block_efficiency": AcceptanceCounts(sum(blocks), sum(accepted), sum(rejected)).tau}
