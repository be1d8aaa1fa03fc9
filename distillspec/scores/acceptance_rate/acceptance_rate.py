"""Acceptance rate alpha: accepted / judged draft tokens (the estimate of 1 - E[TVD(p, q)])."""

import datasets
import evaluate

from distillspec.metrics import AcceptanceCounts

_DESCRIPTION = (
    "Acceptance rate alpha: accepted / judged draft tokens (the estimate of 1 - E[TVD(p, q)])."
    " Computed from per-request counts of speculative decoding, as both this project's decoder and "
    "vLLM's scheduler count them (Leviathan et al., 2023; Zhou et al., 2024)."
)
_KWARGS = """
Args:
    blocks: draft-and-verify blocks (target calls) of each request.
    accepted: draft tokens the target accepted, per request.
    rejected: blocks that ended in a rejection, per request.
Returns:
    acceptance_rate: in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class AcceptanceRate(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Zhou et al., DistillSpec: Improving Speculative Decoding via Knowledge Distillation, ICLR 2024",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {
                    "blocks": datasets.Value("int64"),
                    "accepted": datasets.Value("int64"),
                    "rejected": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, blocks: list[int], accepted: list[int], rejected: list[int]) -> dict[str, float]:
        return {"acceptance_rate": AcceptanceCounts(sum(blocks), sum(accepted), sum(rejected)).alpha}
