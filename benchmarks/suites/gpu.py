"""Decoding costs on a CUDA GPU at real model shapes, and the speculative speedup they predict.

Random weights in bfloat16 of real shapes: a Llama-3.1-8B target with a Llama-3.2-1B draft, and the Qwen2.5-Coder
1.5B target with its 0.5B draft. For each model, the time of one decoding step (KV cache of ``--context`` tokens)
by new positions k = 1..8 at batch 1, 8 and 32, in three ways of running the project's step:

- ``eager``: the lean forward pass, one kernel launch at a time (``compile=False``);
- ``graphs``: the same step captured once per shape as a CUDA graph and replayed (:class:`~distillspec.decoding.kvcache.
  CudaGraphs`);
- ``compiled``: the step through ``torch.compile`` (dynamic shapes here, so that 24 shapes a model cost a few
  compiles; the decoder compiles each shape it meets) and replayed as CUDA graphs: what ``compile=True`` runs.

From them: ``c`` (a 1-token draft step over a 1-token target step) and ``v(k)`` (a k-token target step over a
1-token one) per batch; the target alone's tokens/s at batch 1 through the project's decoder
(:func:`~distillspec.decoding.speculative.autoregressive_generate`, eager and compiled) against the limit that reading
its weights and cache once a token from device memory sets (bandwidth measured by a device-to-device copy); and the
speedup ``E[tau] / (c gamma + v(gamma + 1))`` predicted for alpha 0.6, 0.7, 0.8 at the best gamma, also for drafts
whose head keeps a 32,768-token draft vocabulary (:mod:`distillspec.models.draft_vocab`; alpha taken as unchanged).

    python -m benchmarks.suites.gpu --out results/gpu                 # every variant
    python -m benchmarks.suites.gpu --variants eager graphs --decoders eager   # no compilation: 2 min 20 s, H200
    python -m benchmarks.suites.gpu --pairs qwen2.5-coder-1.5b        # one pair
    python -m benchmarks.suites.gpu --variants compiled --batches 1   # compiled, batch 1 alone
    python -m benchmarks.suites.gpu --variants graphs --decoders compiled   # the compiled decoder's tokens/s

The ``compiled`` variant compiles each model's step anew for each batch size (100-150 s a model and batch on an
H200 with 16 cores): budget for it, or ask for fewer batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from distillspec.cli import run_main
from distillspec.decoding.kvcache import CachedLM, CudaGraphs, compile_cache, static_step
from distillspec.decoding.metrics import expected_tau, predicted_speedup
from distillspec.decoding.speculative import autoregressive_generate
from distillspec.models.draft_vocab import restrict_head

SHAPES = {
    "llama-3.1-8b": LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "qwen2.5-coder-1.5b": Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "qwen2.5-coder-0.5b": Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}
PAIRS = [("llama-3.1-8b", "llama-3.2-1b"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]
DRAFT_VOCAB = 32768  #: the draft vocabulary of the restricted drafts (FR-Spec's size for Llama-3)
BATCHES = (1, 8, 32)
KS = tuple(range(1, 9))
VARIANTS = ("eager", "graphs", "compiled")
DECODERS = ("eager", "compiled")  #: the target alone's decoders: ``compile=False`` and ``compile=True``
ALPHAS = (0.6, 0.7, 0.8)


def bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Device-memory bandwidth in bytes/s: a device-to-device copy, bytes read plus bytes written."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (gpu_time(lambda: dst.copy_(src), reps=reps) / 1e3)


def gpu_time(fn: Callable[[], object], reps: int = 20, warmup: int = 3, after: Callable[[], object] | None = None):
    """Median milliseconds of ``fn`` between CUDA events, the device idle before each call (a decoder waits for
    each step's tokens); ``after`` runs untimed after each call."""
    times = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
        if after is not None:
            after()
    return statistics.median(times)


def random_model(name: str) -> PreTrainedModel:
    """A model of ``name``'s shape with random weights, built in bfloat16 on the GPU."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(SHAPES[name])
    finally:
        torch.set_default_dtype(default)
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes a decoding step reads of the weights: all of them but an untied input embedding (one row a token)."""
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (0 if tied else embed.numel() * embed.element_size())


def kv_bytes(model: PreTrainedModel, tokens: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * tokens


@torch.inference_mode()
def step_times(
    model: PreTrainedModel, variants: list[str], context: int, batches=BATCHES, ks=KS, reps: int = 20
) -> dict:
    """``{variant: {batch: {k: ms}}}``: one decoding step of k new tokens after ``context`` cached ones."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    steps = {"graphs": CudaGraphs(static_step(model), limit=64)}
    if "compiled" in variants:
        compile_cache()
        steps["compiled"] = CudaGraphs(torch.compile(static_step(model), dynamic=True), limit=64)
    out = {v: {} for v in variants}
    for batch in batches:
        lm = CachedLM(model, capacity=context + max(ks))
        prompt = torch.randint(model.config.vocab_size, (batch, context), device="cuda")
        lm.prefill(prompt, torch.ones_like(prompt))
        for variant in variants:
            out[variant][batch] = {k: _time_step(lm, steps.get(variant), context, k, reps) for k in ks}
            print(f"  {variant:8s} batch {batch:2d}: " + " ".join(f"k={k} {out[variant][batch][k]:.2f}" for k in ks))
        del lm
        torch.cuda.empty_cache()
    return out


def _time_step(lm: CachedLM, step: CudaGraphs | None, context: int, k: int, reps: int) -> float:
    """Milliseconds of one step of ``k`` tokens on ``lm``'s cache: its own eager step (``step`` None, the tokens
    rolled back after each call), or ``step`` at static shapes (writing the same cache columns each call)."""
    batch, vocab = len(lm.next_pos), lm.model.config.vocab_size
    tokens = torch.randint(vocab, (batch, k), device="cuda")
    if step is None:
        return gpu_time(lambda: lm.step(tokens), reps, after=lambda: lm.reject_tail(torch.full_like(lm.next_pos, k)))
    mask = torch.zeros(batch, lm.keys[0].shape[2], dtype=torch.long, device="cuda")
    mask[:, : context + k] = 1
    positions = context + torch.arange(k, device="cuda").expand(batch, k)
    start = torch.tensor(context, device="cuda")
    return gpu_time(lambda: step(lm.keys, lm.values, tokens, positions, start, mask), reps)


@torch.inference_mode()
def target_alone(model: PreTrainedModel, compile: bool, prompt_len: int = 128, tokens: int = 128) -> float:
    """Tokens/s of the project's plain decoder at batch 1 (greedy, no EOS), the second of two runs."""
    prompt = torch.randint(model.config.vocab_size, (1, prompt_len), device="cuda")
    rate = 0.0
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = autoregressive_generate(
            model, prompt, max_new_tokens=tokens, temperature=0, eos_token_id=[], compile=compile
        )
        torch.cuda.synchronize()
        rate = int(out.num_new_tokens[0]) / (time.perf_counter() - t0)
    return rate


def best_speedup(alpha: float, c: float, verify: dict[int, float]) -> tuple[int, float]:
    """The gamma (1..7) that maximises the predicted speedup, and that speedup."""
    options = [(g, predicted_speedup(expected_tau(alpha, g), c, g, verify[g + 1])) for g in range(1, max(verify))]
    return max(options, key=lambda o: o[1])


def predictions(times: dict, pair: tuple[str, str], variants: list[str]) -> list[dict]:
    """Rows of c, v(gamma + 1) and the predicted speedups per batch measured and variant, for the full and the
    restricted draft."""
    target, draft = pair
    rows = []
    for variant in variants:
        for batch, t in times[target][variant].items():
            verify = {k: t[k] / t[1] for k in t}
            for kind, name in (("full", draft), (f"V={DRAFT_VOCAB}", f"{draft}/V{DRAFT_VOCAB}")):
                if batch not in times.get(name, {}).get(variant, {}):
                    continue
                c = times[name][variant][batch][1] / t[1]
                row = {"pair": f"{target} / {draft}", "draft": kind, "variant": variant, "batch": batch, "c": c}
                row["v"] = {k: round(v, 3) for k, v in verify.items()}
                for alpha in ALPHAS:
                    gamma, speedup = best_speedup(alpha, c, verify)
                    row[f"alpha={alpha}"] = {"gamma": gamma, "speedup": speedup}
                rows.append(row)
    return rows


def format_tables(result: dict) -> str:
    lines = [f"device: {result['device']}; bandwidth {result['bandwidth_gbs']:.0f} GB/s (device-to-device copy)", ""]
    lines.append("| model | variant | batch | " + " | ".join(f"k={k} ms" for k in KS) + " |")
    lines.append("|---|---|---|" + "---|" * len(KS))
    for name, by_variant in result["times"].items():
        for variant, by_batch in by_variant.items():
            for batch, by_k in by_batch.items():
                cells = " | ".join(f"{by_k[k]:.2f}" for k in KS if k in by_k)
                lines.append(f"| {name} | {variant} | {batch} | {cells} |")
    lines += [
        "",
        "| pair | draft | variant | batch | c | v(4) | v(6) | v(8) | "
        + " | ".join(f"alpha {a}: gamma, speedup" for a in ALPHAS)
        + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(ALPHAS),
    ]
    for row in result["predictions"]:
        v = row["v"]
        best = " | ".join(f"{row[f'alpha={a}']['gamma']}, {row[f'alpha={a}']['speedup']:.2f}x" for a in ALPHAS)
        lines.append(
            f"| {row['pair']} | {row['draft']} | {row['variant']} | {row['batch']} | {row['c']:.3f} | "
            f"{v[4]:.2f} | {v[6]:.2f} | {v[8]:.2f} | {best} |"
        )
    lines += ["", "| target | decoder | tokens/s | limit tokens/s | fraction |", "|---|---|---|---|---|"]
    for row in result["target_alone"]:
        lines.append(
            f"| {row['model']} | {row['decoder']} | {row['tokens_s']:.1f} | {row['limit_tokens_s']:.1f} | "
            f"{row['fraction']:.2f} |"
        )
    return "\n".join(lines)


def suite_gpu(
    variants: list[str],
    context: int,
    out: Path,
    reps: int = 20,
    pairs: list[tuple[str, str]] = PAIRS,
    batches: tuple[int, ...] = BATCHES,
    decoders: tuple[str, ...] = DECODERS,
) -> dict:
    """The whole suite (see the module docstring) over ``pairs``; writes ``gpu.json`` and ``gpu.md`` into ``out``."""
    if not torch.cuda.is_available():
        raise SystemExit("the gpu suite needs a CUDA GPU: none is visible here")
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}",
        "bandwidth_gbs": bandwidth() / 1e9,
        "context": context,
        "times": {},
        "target_alone": [],
    }
    print(result["device"], f"bandwidth {result['bandwidth_gbs']:.0f} GB/s")
    for target_name, draft_name in pairs:
        for name in (target_name, draft_name):
            t0 = time.perf_counter()
            model = random_model(name)
            print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
            result["times"][name] = step_times(model, variants, context, batches, reps=reps)
            if name == target_name:
                for decoder in decoders:
                    rate = target_alone(model, compile=decoder == "compiled")
                    bytes_token = weight_bytes(model) + kv_bytes(model, 128 + 64)
                    limit = result["bandwidth_gbs"] * 1e9 / bytes_token
                    result["target_alone"].append(
                        {
                            "model": name,
                            "decoder": decoder,
                            "tokens_s": rate,
                            "limit_tokens_s": limit,
                            "fraction": rate / limit,
                            "bytes_per_token": bytes_token,
                        }
                    )
                    print(f"  target alone ({decoder}): {rate:.1f} tokens/s, limit {limit:.1f}")
            else:
                restrict_head(model, torch.randperm(model.config.vocab_size)[:DRAFT_VOCAB].sort().values)
                result["times"][f"{name}/V{DRAFT_VOCAB}"] = step_times(
                    model, variants, context, batches, ks=(1,), reps=reps
                )
            del model
            torch.cuda.empty_cache()
            print(f"  ({time.perf_counter() - t0:.0f} s)")
            (out / "gpu.json").write_text(json.dumps(result, indent=1))
    result["predictions"] = [row for pair in pairs for row in predictions(result["times"], pair, variants)]
    (out / "gpu.json").write_text(json.dumps(result, indent=1))
    (out / "gpu.md").write_text(format_tables(result) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--context", type=int, default=512, help="tokens in the KV cache before each timed step")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per cell (the median is kept)")
    parser.add_argument(
        "--pairs", nargs="+", choices=[t for t, _ in PAIRS], default=[t for t, _ in PAIRS], help="the pairs, by target"
    )
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES), help="batch sizes of the step times")
    parser.add_argument(
        "--decoders",
        nargs="*",
        choices=DECODERS,
        default=list(DECODERS),
        help="the target alone's decoders (none: skip)",
    )
    args = parser.parse_args()
    pairs = [pair for pair in PAIRS if pair[0] in args.pairs]
    result = suite_gpu(
        args.variants, args.context, args.out, args.reps, pairs, tuple(args.batches), tuple(args.decoders)
    )
    print(format_tables(result))


if __name__ == "__main__":
    run_main(main)
