"""Wall-clock bookkeeping of distillspec/evaluation/measure.py: a decoding call split at its first block."""

import math

import torch

from distillspec.evaluation.measure import FirstBlock


def test_a_call_splits_at_its_first_block_and_a_call_of_one_block_counts_whole_as_its_first():
    timing = FirstBlock()
    timing.start()
    timing.on_block(torch.zeros(1, 8), torch.tensor([3]), None)  # the first block emitted 3 tokens
    timing.on_block(torch.zeros(1, 8), torch.tensor([6]), None)  # later blocks do not move the split
    timing.stop(8)
    assert (timing.calls, timing.tokens, timing.first_tokens) == (1, 8, 3)
    assert 0 < timing.first_seconds <= timing.seconds
    timing.start()
    timing.stop(2)  # no callback: the whole call was its first block
    assert (timing.calls, timing.tokens, timing.first_tokens) == (2, 10, 5)

    pooled = FirstBlock.pooled([timing, timing])
    assert pooled["tokens_per_s"] == timing.tokens_per_s
    assert pooled["ttft_s"] == timing.first_seconds / 2
    only_first = FirstBlock()
    only_first.start()
    only_first.stop(1)
    assert math.isnan(only_first.decode_tokens_per_s)  # nothing after the first block to time
