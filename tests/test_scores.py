"""The shipped `evaluate` modules: loaded offline by path, the same figures as the libraries underneath."""

import math

import pytest
import sacrebleu
from rouge_score import rouge_scorer

from distillspec import DistillSpecError
from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.tasks import scores
from distillspec.tasks.scores import final_number, score


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_task_scores_match_the_libraries_underneath():
    predictions = ["Ein Mann fährt mit dem Fahrrad durch die Stadt.", "Zwei Hunde spielen im Schnee."]
    references = ["Ein Mann fährt mit seinem Fahrrad durch die Stadt.", "Zwei Hunde spielen draußen im Schnee."]
    bleu = scores.load("bleu").compute(predictions=predictions, references=references)["bleu"]
    assert bleu == pytest.approx(sacrebleu.corpus_bleu(predictions, [references]).score)
    assert 0 < bleu < 100
    rouge = scores.load("rouge").compute(predictions=predictions, references=references)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    expected = sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)) / 2
    assert rouge["rougeL"] == pytest.approx(expected) and 0 < rouge["rouge2"] < rouge["rougeL"] < 1
    gsm8k = scores.load("gsm8k_accuracy")
    answers = ["She has 3 + 4 = 7 apples. #### 7", "The answer is 1,200.", "#### 5"]
    truths = ["#### 7", "#### 1200", "#### 6"]
    assert gsm8k.compute(predictions=answers, references=truths)["accuracy"] == pytest.approx(2 / 3)
    assert score("accuracy", answers, truths) == {"accuracy": pytest.approx(2 / 3)}  # the tasks score through them


def test_acceptance_rate_and_block_efficiency_are_the_decoders_alpha_and_tau():
    requests = [AcceptanceCounts(24, 96, 0), AcceptanceCounts(10, 5, 8), AcceptanceCounts(3, 2, 3)]
    columns = {k: [getattr(r, k) for r in requests] for k in ("blocks", "accepted", "rejected")}
    total = sum(requests, AcceptanceCounts(0, 0, 0))
    alpha = scores.load("acceptance_rate").compute(**columns)["acceptance_rate"]
    tau = scores.load("block_efficiency").compute(**columns)["block_efficiency"]
    assert alpha == pytest.approx(total.alpha) == pytest.approx(103 / 114)
    assert tau == pytest.approx(total.tau) == pytest.approx((103 + 37) / 37)
    assert math.isnan(scores.load("acceptance_rate").compute(blocks=[0], accepted=[0], rejected=[0])["acceptance_rate"])


def test_an_unknown_score_says_what_there_is():
    with pytest.raises(DistillSpecError, match="did you mean 'bleu'"):
        scores.path("bleuu")


def test_task_scores_by_metric_name():
    assert final_number("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert final_number("it is 42.") == "42"
    assert score("accuracy", ["#### 5", "#### 6"], ["x #### 5", "#### 7"]) == {"accuracy": 0.5}
    assert score("bleu", ["ein Hund läuft über die Wiese"], ["ein Hund läuft über die Wiese"])["bleu"] == pytest.approx(
        100.0
    )
    rouge = score("rouge", ["the cat sat on the mat"], ["the cat sat on a mat"])
    assert 0 < rouge["rouge2"] < 1 and 0 < rouge["rougeL"] < 1
