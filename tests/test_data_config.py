import gzip
import json

import pytest

from distillspec import DistillSpecError
from distillspec.config import JobConfig, load_config
from distillspec.tasks.data import arith_task, load_task

from .conftest import SHARED_DATA


def test_arith_is_reproducible_and_answers_are_right():
    a, b = arith_task(n_train=50, n_test=5, seed=3), arith_task(n_train=50, n_test=5, seed=3)
    assert a.train == b.train and a.train != arith_task(n_train=50, n_test=5, seed=4).train
    for ex in a.train:
        equations = [line for line in ex.reference.split(".") if "=" in line]
        for eq in equations:  # every worked step is correct arithmetic
            lhs, rhs = eq.split("=")
            assert eval(lhs.split()[-3] + lhs.split()[-2] + lhs.split()[-1]) == int(rhs.split()[0])


def test_local_layouts(tmp_path):
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2\n#### 2"}) + "\n")
    task = load_task(str(tmp_path / "qa"))
    assert task.metric == "accuracy" and task.train[0].prompt.endswith("Answer:") and task.test
    (tmp_path / "mt").mkdir()
    for lang, lines in (("en", "a dog\na cat\n"), ("de", "ein Hund\neine Katze\n")):
        with gzip.open(tmp_path / "mt" / f"train.{lang}.gz", "wt") as f:
            f.write(lines)
    task = load_task(str(tmp_path / "mt"))
    assert task.metric == "bleu" and task.train[0].reference.strip() in ("ein Hund", "eine Katze")
    (tmp_path / "lm.txt").write_text(("To be or not to be, that is the question. " * 30 + "\n") * 10)
    assert load_task(str(tmp_path / "lm.txt")).metric is None


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="../shared/data is not beside this checkout")
def test_shared_data_layouts():
    gsm = load_task(str(SHARED_DATA / "gsm8k"))
    assert (len(gsm.train), len(gsm.test), gsm.metric) == (7473, 1319, "accuracy")
    mt = load_task(str(SHARED_DATA / "multi30k"))
    assert (len(mt.train), len(mt.test), mt.metric) == (29000, 1000, "bleu")
    assert load_task(str(SHARED_DATA / "tinyshakespeare")).train


def test_bad_datasets(tmp_path):
    with pytest.raises(DistillSpecError, match="does not exist"):
        load_task("./no/such/dir")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DistillSpecError, match="no training examples"):
        load_task(str(tmp_path / "empty.txt"))
    with pytest.raises(DistillSpecError, match="dataset='squad'"):
        load_task("squad")


def test_config_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distill:\n  recipe: supkd\n  lr: 1e-3\neval:\n  gammas: [3]\n")
    cfg = load_config(path, ["distill.steps=7", "eval.temperatures=[0]", "seed=3"])
    assert isinstance(cfg, JobConfig)
    assert (cfg.distill.recipe, cfg.distill.lr, cfg.distill.steps, cfg.eval.gammas, cfg.seed) == (
        "supkd",
        1e-3,
        7,
        [3],
        3,
    )
    assert cfg.eval.temperatures == [0.0]
    partial = load_config(None, ["garden.draft.d_model=80"])
    assert (partial.garden.draft.d_model, partial.garden.draft.n_layers) == (80, 2)  # merged into the draft default


def test_the_canary_decodes_at_the_temperature_the_replicas_serve():
    assert load_config(None, []).canary_temperature == 1.0  # requests that name none: OpenAI's default
    assert load_config(None, ["serve.temperature=0.7"]).canary_temperature == 0.7
    assert load_config(None, ["serve.temperature=0.7", "evaluator.canary_temperature=0"]).canary_temperature == 0.0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["eval.gammas=[0]"], r"eval\.gammas\[0\]=0: input should be greater than or equal to 1"),
        (["distill.recipe=bogus"], "distill.recipe='bogus': choose one of"),
        (["distill.recipe=distilspec"], "did you mean 'distillspec'"),
        (["distill.divergence=kl"], "distill.divergence='kl'"),
        (["distill.max_new_tokens=0"], "distill.max_new_tokens=0"),
        (["distill.stepz=3"], r"unknown config key 'distill.stepz' \(did you mean 'steps'\?\)"),
        (["rollout.worker=3"], "did you mean 'workers'"),
        (["ray.eval_every=3"], "config key 'ray.eval_every' is now 'evaluator.every'"),
        (["distill.steps=many"], "distill.steps='many': input should be a valid integer"),
        (["target=a"], "give both --target and --draft"),
        (["dtype=half"], "dtype='half'"),
        (["target_dtype=bfloat16"], "config key 'target_dtype' is now 'dtype'"),
        (["nonsense"], "section.key=value"),
        (["serve.follow.sync_every_s=.inf"], r"serve\.follow\.sync_every_s=inf: input should be a finite number"),
        (["distill.lr=nan"], "distill.lr='nan': input should be a finite number"),
        (["buffer.max_batch_tokens=1000"], r"distill.batch_size=32 x \(max_prompt_tokens 256 \+ max_new_tokens 64\)"),
        (["rollout.backend=vllm", "vllm.max_model_len=256"], "a rollout's engine would refuse its longest prompts"),
        (["rollout.online_mix=0.5"], r"rollout.online_mix=0.5 mixes the data set into served prompts: it needs"),
        (["rollout.online=true", "rollout.online_mix=1"], "rollout.online_mix=1: input should be less than 1"),
        (["rollout.online_samples=true"], "rollout.online_samples=true trains on served completions: it needs"),
        (["rollout.online=true", "rollout.online_samples=true"], "recipe 'distillspec' never draws the target's"),
        (
            ["rollout.online=true", "rollout.online_samples=true", "distill.recipe=seqkd", "distill.temperature=0.7"],
            "distill.temperature=0.7 would need them at its own",
        ),
        (["serve.record_samples=8", "serve.backend=vllm"], "serve.record_samples=8 keeps the scores"),
        (["serve.draft_context=512", "serve.backend=vllm"], "serve.draft_context=512 is this project's decoder's"),
        (["serve.draft_context=0"], "serve.draft_context"),
        (["serve.draft_context=some"], "serve.draft_context"),
        (["serve.autoscaling.look_back_period_s=2"], "look_back_period_s=2: the window must be longer than the 10 s"),
    ],
)
def test_bad_config(overrides, match):
    with pytest.raises(DistillSpecError, match=match):
        load_config(None, overrides)


def test_served_samples_stand_in_for_the_targets_where_a_recipe_draws_them():
    for recipe in ("seqkd", "fdistill"):
        overrides = ["rollout.online=true", "rollout.online_samples=true", f"distill.recipe={recipe}"]
        assert load_config(None, overrides).rollout.online_samples
    assert load_config(None, ["serve.record_samples=64"]).serve.record_samples == 64
    assert load_config(None, ["serve.draft_context=512"]).serve.draft_context == 512
    assert load_config(None, []).serve.draft_context == "auto"  # vLLM's drafts read whole prompts: auto allows it
    assert load_config(None, ["serve.backend=vllm"]).serve.draft_context == "auto"
    assert load_config(None, ["serve.draft_context=none"]).serve.draft_context is None


def test_the_garden_trains_in_float32_unless_told_otherwise(monkeypatch):
    """By default the garden trains in float32 on every CPU (the same garden from the same seed; an AVX2-only CPU would
    emulate bfloat16, a step 18-33x slower); null follows the hardware and shares its cache entry with the explicit
    value it resolves to."""
    from dataclasses import replace

    from distillspec.config import GardenConfig
    from distillspec.models import garden

    assert GardenConfig().bf16 is False
    auto = GardenConfig(bf16=None)
    for native in (False, True):
        monkeypatch.setattr(garden, "native_bf16", lambda device="cpu", native=native: native)
        assert garden.garden_bf16(GardenConfig()) is False
        assert garden.garden_bf16(auto) is native and garden.garden_bf16(replace(auto, bf16=not native)) is not native
        assert garden.garden_keys("arith", auto, 0) == garden.garden_keys("arith", replace(auto, bf16=native), 0)
        assert garden.garden_keys("arith", auto, 0) != garden.garden_keys("arith", replace(auto, bf16=not native), 0)
    assert load_config(None, ["garden.bf16=true"]).garden.bf16 is True
    assert load_config(None, ["garden.bf16=null"]).garden.bf16 is None


def test_precision_suite_times_each_dtype_and_names_the_hardware(tmp_path):
    from benchmarks.suites.precision import suite_precision
    from distillspec.models.loading import native_bf16

    tiny = [f"garden.{k}={v}" for k, v in {"vocab_size": 300, "target": {"d_model": 32, "n_layers": 1}}.items()]
    result = suite_precision(tiny, 0.0, tmp_path)
    assert result["hardware"]["bfloat16"] is native_bf16("cpu")
    assert set(result["train_step_s"]) == {"float32", "bfloat16 autocast"}
    assert set(result["forward_s"]) == {"float32", "bfloat16", "float16"}
    assert all(s > 0 for s in [*result["train_step_s"].values(), *result["forward_s"].values()])


def test_an_empty_or_partial_model_folder_says_what_is_missing(tmp_path):
    from distillspec.models.loading import check_pair_sources

    (tmp_path / "empty").mkdir()
    with pytest.raises(DistillSpecError, match="lacks config.json, tokenizer_config.json, weights"):
        check_pair_sources(str(tmp_path / "empty"), str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(DistillSpecError, match=r"lacks tokenizer_config.json, weights \(\*.safetensors\)"):
        check_pair_sources(str(tmp_path / "empty"), str(tmp_path / "empty"))


def test_a_config_file_written_before_the_serve_sections_still_loads(tmp_path):
    """A run's config.yaml from before serve.* was split into sections loads into the sections; an override by an
    old name is taken with a warning naming the new one."""
    old = tmp_path / "config.yaml"
    old.write_text("serve:\n  max_batch_size: 3\n  replica_cpus: 0.5\n  follow_version: latest\n  max_tokens: 99\n")
    cfg = load_config(old, ["serve.limits.max_tokens=77"])
    assert cfg.serve.batching.max_batch_size == 3 and cfg.serve.replica.cpus == 0.5
    assert cfg.serve.follow.version == "latest"
    assert cfg.serve.limits.max_tokens == 77  # the new name, set too, wins
    with pytest.warns(FutureWarning, match=r"serve\.sync_every_s is now serve\.follow\.sync_every_s"):
        assert load_config(None, ["serve.sync_every_s=3"]).serve.follow.sync_every_s == 3
