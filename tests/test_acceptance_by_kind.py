"""The acceptance-by-kind suite (benchmarks/suites/acceptance_by_kind.py) on the tiny garden pair: alpha and greedy
agreement split by the kind of token the target emits, adding up to the figures the trajectory suite measures."""

import json

import pytest
import torch

from benchmarks.suites.acceptance_by_kind import KINDS, emitted_kinds, suite_acceptance_by_kind, token_kinds
from benchmarks.suites.trajectory import held_out, suite_trajectory
from distillspec.models.loading import load_pair

from .conftest import garden_overrides


def test_tokens_are_classed_by_their_text(tokenizer):
    ids = torch.tensor([tokenizer.encode("12 + 3 = 15 apples.")])
    texts = [tokenizer.decode([i]) for i in ids[0].tolist()]
    kinds = token_kinds(tokenizer, ids)
    assert kinds.shape == ids.shape
    for text, kind in zip(texts, kinds[0].tolist()):
        expected = "number" if any(c.isdigit() for c in text) else "word" if any(c.isalpha() for c in text) else None
        assert KINDS[kind] == (expected or "space and punctuation"), text
    assert {KINDS[k] for k in kinds[0].tolist()} == set(KINDS)  # the sentence has each kind


def test_each_position_is_classed_by_the_token_it_predicts(tiny_garden, task):
    target, draft, tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    batch, _ = held_out(target, draft, tokenizer, task.test[:3], max_new_tokens=5, seed=0)[1.0]
    kinds = emitted_kinds(tokenizer, batch)
    assert kinds.shape == batch.window_mask.shape
    assert bool(((kinds >= 0) == batch.window_mask.bool()).all())
    row, column = batch.window_mask.nonzero()[0].tolist()  # the first position scored predicts the first new token
    token = batch.input_ids[row, batch.window + column + 1]
    assert kinds[row, column] == token_kinds(tokenizer, token.view(1))[0]


def test_the_suite_splits_acceptance_by_kind_and_the_parts_add_up(tiny_garden, tmp_path):
    from distillspec.models.packing import fbgemm_available

    kernels = ["weight-only", "fbgemm"] if fbgemm_available() else ["weight-only"]
    result = suite_acceptance_by_kind(
        garden_overrides(tiny_garden),
        drafts=[str(tiny_garden.target)],
        sets=["0:3", "3:5"],
        max_new_tokens=6,
        out=tmp_path,
        decoding=["dtype", *kernels],
    )
    assert list(result["sets"]) == ["0:3", "3:5"]
    whole = suite_trajectory(garden_overrides(tiny_garden), [], steps=0, every=1, held=3, out=tmp_path / "t")["start"]
    first = result["sets"]["0:3"][str(tiny_garden.draft)]
    for key in ("alpha", "greedy"):  # the trajectory suite's figures, then the kinds' parts add up to them
        assert first[key]["all"]["acceptance"] == pytest.approx(whole[key], abs=1e-6)
        parts = [first[key][kind] for kind in KINDS]
        assert sum(p["share"] for p in parts) == pytest.approx(1.0)
        assert sum(p["positions"] for p in parts) == first[key]["all"]["positions"]
        mean = sum(p["acceptance"] * p["share"] for p in parts if p["positions"])
        assert mean == pytest.approx(first[key]["all"]["acceptance"], abs=1e-6)
        if first[key]["all"]["acceptance"] < 1.0:
            assert sum(p["lost"] for p in parts) == pytest.approx(1.0)
    draft = str(tiny_garden.draft)  # the garden runs in float32: the dtype's copy is the draft; int8 is near it
    assert list(result["sets"]["0:3"]) == [draft, f"{draft} [float32]", *(f"{draft} [int8 {k}]" for k in kernels),
                                           str(tiny_garden.target)]  # fmt: skip
    for key in ("alpha", "greedy"):
        assert result["sets"]["0:3"][f"{draft} [float32]"][key] == first[key]
        for kernel in kernels:
            near = result["sets"]["0:3"][f"{draft} [int8 {kernel}]"][key]["all"]["acceptance"]
            assert near == pytest.approx(first[key]["all"]["acceptance"], abs=0.1)
    for drafts in result["sets"].values():  # the target as its own draft loses nothing of any kind
        own = drafts[str(tiny_garden.target)]
        assert own["alpha"]["all"]["acceptance"] == pytest.approx(1.0, abs=1e-5)
        assert own["greedy"]["all"]["acceptance"] == 1.0
    assert json.loads((tmp_path / "acceptance_by_kind.json").read_text()) == json.loads(json.dumps(result))
    assert "| 3:5 |" in (tmp_path / "acceptance_by_kind.md").read_text()
    assert (tmp_path / "acceptance_by_kind.png").stat().st_size > 0


@pytest.mark.parametrize(("sets", "message"), [(["0-3"], "START:STOP"), (["5:3"], "need 0 <= START < STOP")])
def test_the_suite_refuses_a_set_it_cannot_score(tiny_garden, tmp_path, sets, message):
    with pytest.raises(SystemExit, match=message):
        suite_acceptance_by_kind(garden_overrides(tiny_garden), drafts=[], sets=sets, max_new_tokens=6, out=tmp_path)
