import random

import pytest
import torch

from distillspec import DistillSpecError
from distillspec.buffer import SampleBuffer, check_batch
from distillspec.distill import make_batch


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


def good_batch():
    return make_batch(
        torch.tensor([[0, 5, 6], [4, 5, 6]]),
        torch.tensor([[0, 1, 1], [1, 1, 1]]),
        torch.tensor([[7, 8], [9, 0]]),
        torch.tensor([2, 1]),
    ).__dict__


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b.pop("loss_mask"), "missing ['loss_mask']"),
        (lambda b: b.update(input_ids=b["input_ids"].float()), "integer array"),
        (lambda b: b.update(attention_mask=b["attention_mask"][:, :3]), "attention_mask must have the shape"),
        (lambda b: b.update(loss_mask=torch.zeros_like(b["loss_mask"])), "no position to learn from"),
        (lambda b: b["input_ids"].__setitem__((0, 0), 50), "token ids outside [0, 32)"),
        (
            lambda b: b.update(
                input_ids=torch.zeros(40, 5, dtype=torch.long),
                attention_mask=torch.ones(40, 5),
                loss_mask=torch.ones(40, 5),
            ),
            "200 tokens > max_tokens 64",
        ),
    ],
)
def test_check_batch_names_what_is_wrong(mutate, reason):
    assert check_batch(good_batch(), max_tokens=64, vocab_size=32) is None
    batch = good_batch()
    mutate(batch)
    assert reason in check_batch(batch, max_tokens=64, vocab_size=32)
    assert "mapping" in check_batch([1, 2], max_tokens=64)
