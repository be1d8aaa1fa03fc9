"""Shared fixtures: tiny real Llama models and a tokenizer trained on the embedded task."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from distillspec.config import ModelSize
from distillspec.models.garden import make_model, train_tokenizer
from distillspec.tasks.data import arith_task

torch.set_num_threads(2)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


#: Test modules whose every test starts a vLLM engine (the fast lane leaves them out, as it does Ray).
ENGINE_MODULES = {"test_vllm"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``cluster`` every test that starts Ray (it uses the ``ray_cluster`` fixture, itself or through another
    fixture) or a vLLM engine: ``pytest -m "not cluster"`` is the fast lane of Ray-free tests."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) or item.module.__name__.split(".")[-1] in ENGINE_MODULES:
            item.add_marker(pytest.mark.cluster)


#: torch.compile's CPU backend writes C++ and builds it with the system's compiler.
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler")


def on_4_bit_grids(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (float32; in place) with its decoder layers' linear weights rounded to 4-bit groups of 32 (min-max,
    in float32), as a 4-bit GGUF's layers dequantize: weights on 4-bit grids; its head as it was."""
    from distillspec.models.packing import int4_groups

    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, torch.nn.Linear) and name != "lm_head":
                codes, scales_zeros = int4_groups(layer.weight)
                scale, zero = (scales_zeros[..., i].T.repeat_interleave(32, 1) for i in (0, 1))
                layer.weight.copy_((codes - 8) * scale + zero)
    return model


def tiny_llama(vocab: int, d: int = 32, layers: int = 1, seed: int = 0, sharpness: float = 1.0) -> LlamaForCausalLM:
    """A random-init Llama; ``sharpness`` scales the output layer (peakier distributions, no near-ties)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        num_hidden_layers=layers,
        intermediate_size=2 * d,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.eos_token_id = None  # compare full-length outputs with HF generate
    return model


def exact_joint(target, prompt: torch.Tensor) -> torch.Tensor:
    """The target's distribution of the next two tokens after ``prompt`` [1, L] at temperature 1, flattened [V*V]
    (float64 from its logits, on the CPU)."""
    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target(prompt).logits[0, -1].double(), -1)
        ext = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab, device=prompt.device)[:, None]], 1)
        p2 = torch.softmax(target(ext).logits[:, -1].double(), -1)
    return (p1[:, None] * p2).flatten().cpu()


def pooled_chisquare(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts ``observed`` against probabilities ``probs``, the cells expected to hold under 5
    pooled into one, and that one into the least other cell while it still holds under 5 (one draw in a cell
    expected to hold 0.01 would otherwise reject an exact sampler: at 12,000 draws of two tokens of a tiny pair, 7%
    of exact samples failed at 1e-3 unpooled)."""
    from scipy.stats import chisquare

    expected = probs.double() * observed.sum() / probs.sum()
    observed, rare = observed.double(), expected < 5
    if rare.any():
        observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
        if expected[-1] < 5 and len(expected) > 1:
            least = int(expected[:-1].argmin())
            observed[least] += observed[-1]
            expected[least] += expected[-1]
            observed, expected = observed[:-1], expected[:-1]
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def perturbed(model: LlamaForCausalLM, scale: float, seed: int = 0) -> LlamaForCausalLM:
    """A copy of ``model`` with noise on every weight: a draft that agrees often but not always."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


def greedy_text(target, tokenizer, prompt: str, n: int) -> str:
    """The target's own greedy continuation (transformers' generate), cut after EOS, as text."""
    from distillspec.models.loading import encode_prompts

    ids, _ = encode_prompts(tokenizer, [prompt])
    out = target.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1] :].tolist()
    if tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.fixture(scope="session", autouse=True)
def project_cache(tmp_path_factory):
    """The project's cache (garden, dequantized GGUF models, layer drafts) in a folder of the test session, for this
    process and the jobs it starts, never the user's ``~/.cache/distillspec``."""
    root = tmp_path_factory.mktemp("distillspec-cache")
    old, os.environ["DISTILLSPEC_CACHE"] = os.environ.get("DISTILLSPEC_CACHE"), str(root)
    yield root
    if old is None:
        os.environ.pop("DISTILLSPEC_CACHE", None)
    else:
        os.environ["DISTILLSPEC_CACHE"] = old


@pytest.fixture(scope="session")
def task():
    return arith_task(n_train=400, n_test=40, seed=0)


@pytest.fixture(scope="session")
def tokenizer(task):
    return train_tokenizer([e.prompt + e.reference for e in task.train], vocab_size=300)


@pytest.fixture(scope="session")
def text_pair(tokenizer):
    """Random-init target (2 layers) and draft (1 layer) over the garden tokenizer."""
    target = make_model(ModelSize(d_model=64, n_layers=2, n_heads=2, d_ff=128), tokenizer).eval()
    torch.manual_seed(1)
    draft = make_model(ModelSize(d_model=32, n_layers=1, n_heads=2, d_ff=64), tokenizer).eval()
    return target, draft


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (started on first use, stopped at the end)."""
    import ray

    from actors.common import NAMESPACE

    ray.init(
        address="local",  # never join a stale cluster left in Ray's temp folder
        namespace=NAMESPACE,
        num_cpus=2,
        object_store_memory=300_000_000,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


GARDEN_TINY = {
    "vocab_size": 300,
    "train_examples": 300,
    "target_steps": 15,
    "draft_steps": 15,
    "batch_size": 8,
    "target": {"d_model": 64, "n_layers": 2, "d_ff": 128, "n_heads": 2},
    "draft": {"d_model": 32, "n_layers": 2, "d_ff": 64, "n_heads": 2},
}


@pytest.fixture(scope="session")
def tiny_garden(tmp_path_factory, task):
    """A tiny trained target/draft pair on disk (the garden's format)."""
    from distillspec.config import GardenConfig, load_config
    from distillspec.models.garden import build_garden

    overrides = [f"{k}={v}" for k, v in GARDEN_TINY.items()] + [f"cache_dir={tmp_path_factory.mktemp('garden')}"]
    cfg = load_config(None, overrides, cls=GardenConfig)
    return build_garden(task, cfg, seed=0)


def garden_overrides(garden, *extra: str) -> list[str]:
    """Config overrides that name a garden pair on the embedded task, small batches of short continuations."""
    return [f"target={garden.target}", f"draft={garden.draft}", "dataset=arith", "distill.batch_size=4",
            "distill.max_new_tokens=6", *extra]  # fmt: skip


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for an endpoint a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = Path(__file__).resolve().parents[1]


def start_job(*args: str, job: str = "distill.py", env: dict | None = None, **popen) -> subprocess.Popen:
    """A script of jobs/ started as a user starts it: from the repository root, progress bars off."""
    env = {**os.environ, "TQDM_DISABLE": "1", **(env or {})}
    return subprocess.Popen([sys.executable, str(ROOT / "jobs" / job), *args], text=True, env=env, cwd=ROOT, **popen)


def run_job(*args: str, job: str = "distill.py", env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`start_job` to its end (10 minutes at most), its output and errors captured."""
    with start_job(*args, job=job, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_here(
    script: Callable[[], object], capsys, monkeypatch, argv: list[str] | None = None
) -> subprocess.CompletedProcess:
    """A script's entry point (``jobs/*.py``'s ``cli``, ``run_main(main)``) run in this process, with ``sys.argv`` set
    to ``argv`` where given: its exit status, output and errors, as :func:`run_job` gives them, without the seconds a
    new interpreter takes to import torch and Ray. What only a new process shows (environment read at import, output
    below Python's) stays with :func:`run_job`."""
    from distillspec.cli import QUIET

    for key in QUIET:  # run_main sets these; the test's end undoes them
        monkeypatch.setenv(key, os.environ.get(key, QUIET[key]))
    if argv is not None:
        monkeypatch.setattr(sys, "argv", argv)
    sigterm = signal.getsignal(signal.SIGTERM)  # run_main's handler, undone too
    try:
        script()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv or [], code, captured.out, captured.err)


def finished_run(garden, folder: Path, *extra: str) -> Path:
    """A jobs/distill.py output folder as a finished run leaves it (its resolved ``config.yaml`` and ``draft/``), for
    the garden pair, with the garden's draft standing in for the distilled one."""
    from distillspec.config import load_config, to_dict
    from distillspec.models.pretrained import RUN_CONFIG

    folder.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, garden_overrides(garden, *extra))
    (folder / RUN_CONFIG).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    shutil.copytree(garden.draft, folder / "draft")
    return folder
