"""Corpus BLEU computed by sacrebleu, one reference per prediction."""

import evaluate
import sacrebleu

from distillspec.tasks.scores import info

_DESCRIPTION = "Corpus-level BLEU (0-100) computed by sacrebleu with its default 13a tokenizer (Post, 2018)."
_KWARGS = """
Args:
    predictions: translations (strings).
    references: one reference translation per prediction (strings).
Returns:
    bleu: corpus BLEU in [0, 100].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Bleu(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return info.metric_info(
            _DESCRIPTION, _KWARGS, "Post, A Call for Clarity in Reporting BLEU Scores, WMT 2018", info.TEXT_INPUTS
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        return {"bleu": sacrebleu.corpus_bleu(predictions, [references]).score}
