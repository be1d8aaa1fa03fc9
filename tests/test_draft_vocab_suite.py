"""The draft-vocabulary suite (benchmarks/suites/draft_vocab.py) on the tiny garden pair: vocabularies counted on the
held-out questions' own data set and on another one (``--vocab-from``)."""

import json

from benchmarks.suites.draft_vocab import suite_draft_vocab

from .conftest import garden_overrides


def test_a_vocabulary_counted_on_another_task_leaves_more_of_the_target_outside(tiny_garden, task, tmp_path):
    words = tmp_path / "words"  # a task of words alone: its vocabulary keeps few of the digits arith's answers hold
    words.mkdir()
    for split, examples in (("train", task.train), ("test", task.test)):
        lines = [json.dumps({"prompt": "spell " + e.prompt, "reference": "yes no maybe"}) for e in examples]
        (words / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    result = suite_draft_vocab(
        garden_overrides(tiny_garden),
        sizes=[24],
        samples=[0],
        held=4,
        max_new_tokens=6,
        out=tmp_path / "out",
        vocab_from=["arith", str(words)],
    )
    whole, own, other = result["rows"]
    assert whole["counted_on"] is None and whole["outside"] == 0.0
    assert (own["counted_on"], other["counted_on"]) == ("arith", "words") and own["size"] == other["size"] == 24
    assert other["outside"] > own["outside"] >= 0.0
    table = (tmp_path / "out" / "draft_vocab.md").read_text()
    assert "4 held-out questions of arith" in table and "| words: the text |" in table
