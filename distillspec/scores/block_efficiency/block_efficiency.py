"""Block efficiency tau: tokens per target call (accepted + 1 per block), at most gamma + 1."""

import datasets
import evaluate

from distillspec.metrics import AcceptanceCounts

_DESCRIPTION = (
    "Block efficiency tau: tokens per target call (accepted + 1 per block), at most gamma + 1."
    " Computed from per-request counts of speculative decoding, as both this project's decoder and "
    "vLLM's scheduler count them (Leviathan et al., 2023; Zhou et al., 2024)."
)
_KWARGS = """
Args:
    blocks: draft-and-verify blocks (target calls) of each request.
    accepted: draft tokens the target accepted, per request.
    rejected: blocks that ended in a rejection, per request.
Returns:
    block_efficiency: in [1, gamma + 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class BlockEfficiency(evaluate.Metric):
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
        return {"block_efficiency": AcceptanceCounts(sum(blocks), sum(accepted), sum(rejected)).tau}
