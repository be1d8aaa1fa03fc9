"""Block efficiency tau: tokens per target call (accepted + 1 per block), at most gamma + 1."""

import evaluate

from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.tasks.scores import info

_DESCRIPTION = (
    "Block efficiency tau: tokens per target call (accepted + 1 per block), at most gamma + 1." + info.COUNTS_SOURCE
)
_KWARGS = (
    info.COUNT_ARGS
    + """Returns:
    block_efficiency: in [1, gamma + 1].
"""
)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class BlockEfficiency(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return info.metric_info(_DESCRIPTION, _KWARGS, info.DISTILLSPEC, info.COUNT_INPUTS)

    def _compute(self, blocks: list[int], accepted: list[int], rejected: list[int]) -> dict[str, float]:
        return {"block_efficiency": AcceptanceCounts(sum(blocks), sum(accepted), sum(rejected)).tau}
