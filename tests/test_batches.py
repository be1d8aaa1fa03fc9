"""The buffer's bookkeeping and the rollout batch (distillspec/training/batches.py), without Ray."""

import random

import numpy as np
import pytest
import torch

from distillspec import DistillSpecError
from distillspec.training.batches import MAX_REFUSALS, RolloutBatch, SampleBuffer, make_batch
from distillspec.training.divergences import compress_topk


def test_ledger_balances_through_a_random_run():
    rng = random.Random(0)
    buf = SampleBuffer(capacity=8, max_policy_lag=2)
    version, next_id, seen = 0, 0, set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.55:
            made_at = version - rng.choice([0, 0, 0, 1, 3])  # some rollouts come back late
            bad = "malformed" if rng.random() < 0.05 else None
            answer = buf.put(next_id, version=made_at, current_version=version, problem=bad)
            assert answer in ("ok", "full") or answer.startswith("refused: ")
            if answer != "full":
                next_id += 1
        elif op < 0.9:
            for item_version, item in buf.take(rng.randint(1, 4), current_version=version):
                assert version - item_version <= 2  # nothing stale reaches the learner
                assert item not in seen  # nothing is handed out twice
                seen.add(item)
        else:
            version += 1
        assert len(buf) <= 8
        assert buf.ledger.balanced(len(buf)), buf.ledger
    ledger = buf.ledger
    assert ledger.produced == next_id
    assert min(ledger.refused, ledger.dropped, ledger.consumed) > 0  # every path was taken
    assert ledger.consumed == len(seen)
    assert len(buf.refusals) == min(ledger.refused, MAX_REFUSALS)  # the latest reasons only: the ledger stays small


def test_full_buffer_pushes_back_without_counting():
    buf = SampleBuffer(capacity=1, max_policy_lag=0)
    assert buf.put("a", version=0, current_version=0) == "ok"
    assert buf.put("b", version=0, current_version=0) == "full"
    assert buf.ledger.produced == 1
    assert buf.put("c", version=0, current_version=5) == "full"
    assert buf.take(5, current_version=1) == []  # "a" went stale and was dropped
    assert buf.ledger.to_dict() == {"produced": 1, "refused": 0, "dropped": 1, "consumed": 0}
    assert buf.put("d", version=0, current_version=1).startswith("refused: version 0 is more than 0 behind 1")
    with pytest.raises(DistillSpecError, match="capacity=0"):
        SampleBuffer(capacity=0, max_policy_lag=1)


def good_batch(version: int = 0, source: str = "draft") -> RolloutBatch:
    tokens = make_batch(
        torch.tensor([[0, 5, 6], [4, 5, 6]]),
        torch.tensor([[0, 1, 1], [1, 1, 1]]),
        torch.tensor([[7, 8], [9, 0]]),
        torch.tensor([2, 1]),
    )
    return RolloutBatch.from_batch(tokens, version=version, source=source)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: setattr(b, "loss_mask", None), "must be arrays"),
        (lambda b: setattr(b, "input_ids", b.input_ids.astype(float)), "integer array"),
        (lambda b: setattr(b, "attention_mask", b.attention_mask[:, :3]), "attention_mask must have the shape"),
        (lambda b: setattr(b, "loss_mask", np.zeros_like(b.loss_mask)), "no position to learn from"),
        (lambda b: b.input_ids.__setitem__((0, 0), 50), "token ids outside [0, 32)"),
        (lambda b: setattr(b, "source", "elsewhere"), "unknown source 'elsewhere'"),
        (
            lambda b: b.__dict__.update(
                input_ids=np.zeros((40, 5), dtype=np.int64),
                attention_mask=np.ones((40, 5)),
                loss_mask=np.ones((40, 5)),
            ),
            "200 tokens > max_tokens 64",
        ),
    ],
)
def test_a_rollout_batch_names_what_is_wrong(mutate, reason):
    assert good_batch().problem(max_tokens=64, vocab_size=32) is None
    batch = good_batch()
    mutate(batch)
    assert reason in batch.problem(max_tokens=64, vocab_size=32)
    header = batch.header(max_tokens=64, vocab_size=32)  # what the buffer reads instead of the arrays
    assert reason in header.problem and (header.version, header.source) == (batch.version, batch.source)


def test_a_rollout_batch_carries_tokens_and_the_target_distribution():
    batch = good_batch(version=3, source="target")
    tokens = batch.batch()
    assert batch.rows == 2 and batch.tokens == tokens.tokens == 3 and batch.version == 3
    assert torch.equal(tokens.loss_mask, torch.as_tensor(batch.loss_mask))
    assert batch.target(1.0) is None  # the learner computes it
    logits = torch.randn(2, 3, 32)
    batch.set_target(logits, topk=0, temperature=1.0)
    assert torch.equal(batch.target(1.0), logits)
    topk = good_batch()
    topk.set_target(logits, topk=4, temperature=0.5)
    shipped, expected = topk.target(0.5), compress_topk(logits, 4, 0.5)
    assert torch.equal(shipped.indices, expected.indices) and torch.allclose(shipped.logprobs, expected.logprobs)


def test_checksums_name_each_tensor_that_changed():
    from distillspec.integrity import checksums, mismatches

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.float32)}
    sums = checksums(arrays)
    assert mismatches(arrays, sums) == []
    assert mismatches({**arrays, "a": arrays["a"][::-1].copy()}, sums) == ["a"]  # scrambled
    assert mismatches({**arrays, "a": arrays["a"].reshape(3, 2)}, sums) == ["a"]  # same bytes, another shape
    assert mismatches({**arrays, "b": arrays["b"].astype(np.float16)}, sums) == ["b"]  # another dtype
    assert mismatches({"a": arrays["a"]}, sums) == ["b"]  # missing
