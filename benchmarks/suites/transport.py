"""How draft versions and batches move between the pipeline's actors.

Suite ``integrity``: what the per-tensor checksums of the serving gate add to a weight sync, for the garden draft and
a draft of Llama-160M's shape (seconds, GB/s, and the share of the sync's own time).

    python benchmarks/benchmark.py integrity

Suite ``trace``: the path of a draft version (learner -> weight store -> consumer) and of a batch (rollout actor ->
buffer -> learner), each hop timed, for drafts of two sizes (and the job's draft, when ``draft=`` names one), each
version in float32 and in float16, and batches with and without the target's distribution.

    python benchmarks/benchmark.py trace
    python benchmarks/benchmark.py trace draft=qwen2.5-coder-0.5b-instruct target=qwen2.5-coder-1.5b-instruct \
        dataset=../shared/data/gsm8k draft_vocab=32768 ray.object_store_memory=1000000000
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.buffer import BufferActor
from actors.weights import WeightStore
from benchmarks.suites.common import with_garden
from cluster.connect import connect
from distillspec.config import JobConfig, load_config
from distillspec.integrity import check, checksums
from distillspec.models.garden import make_model, train_tokenizer
from distillspec.models.loading import load_arrays, load_model
from distillspec.training.batches import BatchHeader, RolloutBatch
from distillspec.versions import state_arrays


def weight_suite_drafts(overrides: list[str]) -> tuple[JobConfig, dict[str, torch.nn.Module]]:
    """Suites integrity and trace: the config (Ray connected, an object store large enough) and drafts of two shapes
    with random float32 weights: the garden's default draft and Llama-160M's (12 layers, 768 wide, 32000 tokens)."""
    cfg = load_config(None, ["ray.object_store_memory=2000000000", *overrides])
    connect(cfg.ray)
    torch.manual_seed(cfg.seed)
    tokenizer = train_tokenizer([f"{i} + {i} = {2 * i}" for i in range(200)], cfg.garden.vocab_size)
    llama = LlamaConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=32000
    )
    return cfg, {"garden draft": make_model(cfg.garden.draft, tokenizer), "Llama-160M shape": LlamaForCausalLM(llama)}


def suite_integrity(overrides: list[str], budget: float, out: Path) -> dict:
    """What the integrity check adds to a weight sync, for drafts of two shapes (float32, random weights): the
    garden's default draft and Llama-160M's (12 layers, 768 wide, 32000 tokens). A sync without the check: the
    publisher puts the weights into Ray's object store, a consumer in another process gets them and copies them into
    its model. The check: a checksum pass at the publisher and one at each consumer (with vLLM, one more in each
    engine worker)."""
    del budget
    cfg, drafts = weight_suite_drafts(overrides)

    @ray.remote(num_cpus=0)
    class Consumer:
        def __init__(self, model: torch.nn.Module) -> None:
            torch.set_num_threads(1)
            self.model = model

        def sync(self, refs: list, sums: dict | None) -> tuple[float, float]:
            """Seconds to get and load the weights, and to check them (0 without sums)."""
            start = time.perf_counter()
            arrays = ray.get(refs[0])
            checked = time.perf_counter()
            if sums is not None:
                check(arrays, sums)
            loading = time.perf_counter()
            load_arrays(self.model, arrays)
            return time.perf_counter() - loading + checked - start, loading - checked

    def median(values: list[float]) -> float:
        return statistics.median(values)

    rows = {}
    for name, model in drafts.items():
        consumer = Consumer.remote(model)
        arrays = state_arrays(model)
        gb = sum(a.nbytes for a in arrays.values()) / 1e9
        put, publisher_check, consumer_sync, consumer_check = [], [], [], []
        for _ in range(4):
            start = time.perf_counter()
            refs = [ray.put(state_arrays(model))]
            put.append(time.perf_counter() - start)
            start = time.perf_counter()
            sums = checksums(arrays)
            publisher_check.append(time.perf_counter() - start)
            moved, checked = ray.get(consumer.sync.remote(refs, sums))
            consumer_sync.append(moved)
            consumer_check.append(checked)
            del refs
        ray.kill(consumer)
        sync = median(put[1:]) + median(consumer_sync[1:])  # the first round warms up
        checks = median(publisher_check[1:]) + median(consumer_check[1:])
        rows[name] = {
            "gb": gb,
            "parameters": sum(p.numel() for p in model.parameters()),
            "sync_s": sync,
            "publisher_check_s": median(publisher_check[1:]),
            "consumer_check_s": median(consumer_check[1:]),
            "check_gb_per_s": gb / median(consumer_check[1:]),
            "overhead": checks / sync,
        }
    print("\nintegrity check per weight sync (median of 3 after a warm-up; one publisher, one consumer):")
    print(f"{'draft':>18} {'GB':>6} {'sync s':>7} {'check s (pub+cons)':>19} {'GB/s':>6} {'overhead':>9}")
    for name, r in rows.items():
        print(
            f"{name:>18} {r['gb']:>6.3f} {r['sync_s']:>7.3f} "
            f"{r['publisher_check_s']:>9.3f}+{r['consumer_check_s']:.3f} {r['check_gb_per_s']:>6.2f} "
            f"{r['overhead']:>8.1%}"
        )
    return rows


def clock(f, *args):
    """``f(*args)`` and the seconds it took."""
    start = time.perf_counter()
    value = f(*args)
    return value, time.perf_counter() - start


def call(method, *args):
    """An actor's method called and waited for."""
    return ray.get(method.remote(*args))


def median_rows(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each hop's median over the rounds after the first (a warm-up)."""
    return {k: statistics.median(s[k] for s in samples[1:]) for k in samples[0]}


@ray.remote(num_cpus=0)
class TraceConsumer:
    """A consumer of versions (a rollout actor, the evaluator, a replica) and of batches (the learner)."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        torch.set_num_threads(1)
        self.model = model

    def load(self, held) -> dict[str, float]:
        arrays, get = clock(ray.get, held.weights[0])
        _, checked = clock(check, arrays, held.sums)
        _, loaded = clock(load_arrays, self.model, arrays)
        return {"consumer get": get, "consumer check": checked, "consumer load (copy into the model)": loaded}

    def take(self, refs: list) -> dict[str, float]:
        batch, get = clock(ray.get, refs[0])
        _, to_torch = clock(batch.batch)
        return {"learner get": get, "learner to tensors (copy)": to_torch}


@ray.remote(num_cpus=0)
class TraceProducer:
    """A rollout actor that has sampled ``batch``."""

    def __init__(self, batch: RolloutBatch) -> None:
        self.batch = batch

    @ray.method(num_returns=2)
    def sample(self, max_tokens: int, vocab_size: int) -> tuple[BatchHeader, RolloutBatch]:
        return self.batch.header(max_tokens=max_tokens, vocab_size=vocab_size), self.batch


def trace_version(model: torch.nn.Module, store_name: str, rounds: int, dtype: str = "float32") -> dict:
    """The hops of a draft version of ``model`` in ``dtype`` (``learner.version_dtype``): publisher -> weight store
    -> consumer, median seconds per hop."""
    store, consumer = WeightStore.remote(store_name), TraceConsumer.remote(model)
    samples = []
    for step in range(rounds):
        arrays, to_numpy = clock(state_arrays, model, dtype)
        sums, summed = clock(checksums, arrays)
        refs, put = clock(lambda a: [ray.put(a)], arrays)
        _, stored = clock(call, store.publish, step, refs, None, sums)
        del refs  # the publisher's copy goes
        held = ray.get(store.follow.remote("latest")).held
        samples.append(
            {
                "publisher to numpy": to_numpy,
                "publisher checksums": summed,
                "publisher put (copy 1)": put,
                "store publish (copy 2, the store's own)": stored,
                **ray.get(consumer.load.remote(held)),
            }
        )
    ray.kill(consumer)
    ray.kill(store)
    return {"mib": sum(a.nbytes for a in arrays.values()) / 2**20, "seconds": median_rows(samples)}


def trace_batch(batch: RolloutBatch, vocab: int, store_name: str, rounds: int) -> dict:
    """The hops of ``batch``: rollout actor -> buffer -> learner, pulled by the buffer and, beside it, put by a
    producer the buffer does not call; median seconds per hop."""
    store = WeightStore.remote(store_name)
    buffer = BufferActor.remote(
        capacity=2, max_policy_lag=10**6, max_batch_tokens=10**9, vocab_size=vocab, run="trace", store=store
    )
    learner, producer = TraceConsumer.remote(), TraceProducer.remote(batch)
    samples = []
    for _ in range(rounds):
        (answer,), pulled = clock(call, buffer.feed, producer, 0, 1)
        assert answer["status"] == "ok", answer
        samples.append({"buffer pulls: the rollout returns it (the one copy) and its header": pulled})
        samples[-1].update(ray.get(learner.take.remote(ray.get(buffer.take.remote(1, 0, 10.0)))))
        # the path of a producer the buffer does not call: it puts the batch, the buffer keeps its own copy
        refs, put = clock(lambda b: [ray.put(b)], batch)
        status, offered = clock(call, buffer.put, refs)
        assert status == "ok", status
        del refs
        ray.get(buffer.take.remote(1, 0, 10.0))
        samples[-1]["(put path) producer put (copy 1)"] = put
        samples[-1]["(put path) buffer's own copy (copy 2)"] = offered
    for actor in (learner, buffer, store, producer):
        ray.kill(actor)
    mb = sum(getattr(batch, k).nbytes for k in vars(batch) if isinstance(getattr(batch, k), np.ndarray))
    return {"mib": mb / 2**20, "seconds": median_rows(samples)}


def trace_batch_kinds(rows: int, length: int, columns: int, vocab: int) -> dict[str, RolloutBatch]:
    """A batch of ``rows`` x ``length`` tokens alone, with the target's top-20 log-probs and with its full logits
    (``columns`` scored positions each)."""
    ids = np.random.default_rng(0).integers(0, vocab, (rows, length))
    kinds = {}
    for kind in ("tokens only", "top-20 log-probs", "full logits"):
        batch = RolloutBatch(ids, np.ones_like(ids), np.ones_like(ids), version=0, source="draft")
        if kind == "top-20 log-probs":
            batch.target_topk_logprobs = np.zeros((rows, columns, 20), np.float32)
            batch.target_topk_indices = np.zeros((rows, columns, 20), np.int64)
        elif kind == "full logits":
            batch.target_logits = np.zeros((rows, columns, vocab), np.float32)
        kinds[kind] = batch
    return kinds


def suite_trace(overrides: list[str], budget: float, out: Path) -> dict:
    """The path of a draft version and of a training batch through the pipeline's actors, each hop timed: a version
    (the weights of the garden's draft and of Llama-160M's shape, and of the job's draft when ``draft=`` names one,
    each in float32 and in float16: ``learner.version_dtype``) from the publisher through the weight store to a
    consumer (:func:`actors.weights.publish`, then what a consumer does: get, check, load); a batch (the job's
    ``distill.batch_size`` rows of ``distill.max_prompt_tokens + distill.max_new_tokens`` tokens, alone and with the
    target's top-k log-probs or full logits attached by a scorer) from a rollout actor through the buffer to the
    learner, pulled by the buffer and, beside it, put by a producer the buffer does not call. Each copy of the bytes
    is named with the hop that writes it."""
    del budget
    cfg, drafts = weight_suite_drafts(overrides)
    if any(o.startswith("draft=") for o in overrides):
        cfg, _ = with_garden(cfg)
        drafts[Path(cfg.draft).name] = load_model(cfg.draft)[0]
    rounds = 5
    versions = {
        f"{name}, {dtype}": trace_version(model, f"trace-{i}-{dtype}", rounds, dtype)
        for i, (name, model) in enumerate(drafts.items())
        for dtype in ("float32", "float16")
    }
    rows, length = cfg.distill.batch_size, cfg.distill.max_prompt_tokens + cfg.distill.max_new_tokens
    vocab = 49152  # SmolLM2's vocabulary, for the logits a scorer attaches
    kinds = trace_batch_kinds(rows, length, cfg.distill.max_new_tokens + 1, vocab)
    batches = {kind: trace_batch(batch, vocab, f"trace-b{i}", rounds) for i, (kind, batch) in enumerate(kinds.items())}
    ray.shutdown()
    print(f"\nthe path of a draft version (median of {rounds - 1} after a warm-up), milliseconds per hop:")
    for title, table in (("version", versions), ("batch", batches)):
        if title == "batch":
            print(f"\nthe path of a batch ({rows} rows x {length} tokens), milliseconds per hop:")
        for name, r in table.items():
            hops = ", ".join(f"{hop} {1000 * t:.1f}" for hop, t in r["seconds"].items())
            total = sum(t for hop, t in r["seconds"].items() if not hop.startswith("(put path)"))
            print(f"  {name} ({r['mib']:.1f} MiB): {hops}; total {1000 * total:.1f}")
    return {"versions": versions, "batches": batches, "batch_rows": rows, "batch_tokens": length}
