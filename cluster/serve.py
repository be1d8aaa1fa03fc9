"""The speculative-decoding endpoint on Ray Serve: OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``
whose draft follows a running distillation job (``serve run cluster/serve_config.yaml``, or ``python jobs/serve.py``).

One deployment, :class:`Completions`, is the FastAPI ingress (:mod:`cluster.http_app`) and the model holder. With
``serve.backend=hf`` a replica batches concurrent requests (:class:`distillspec.serving.completer.RequestBatcher`) into
:class:`distillspec.serving.completer.Completer` calls; with ``serve.backend=vllm`` it runs vLLM's async engine with
the draft as its ``draft_model`` (:class:`distillspec.serving.vllm_backend.VLLMCompleter`). A thread follows the run's
weight store and swaps in each serving version whose weights pass their check, and rolls back a version whose live
alpha collapses (:class:`cluster.follower.DraftFollower`). Requests, responses and stream events:
:mod:`cluster.openai_api`; metrics: :mod:`cluster.serve_metrics`; stopping: :mod:`cluster.stopping`.
"""

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import ray
import torch
from fastapi import Request
from fastapi.responses import StreamingResponse
from ray import serve

from actors.common import NAMESPACE, prompts_name
from actors.target import shared_target
from cluster.follower import DraftFollower
from cluster.http_app import app, guard
from cluster.openai_api import (
    ChatRequest,
    CompletionRequest,
    DecodingRequest,
    HTTPError,
    chat_prompt,
    completion_jobs,
    completion_response,
    error_body,
    logprobs_body,
    param_of,
    sd_stats,
    stream_events,
    usage,
)
from cluster.serve_metrics import ServeMetrics, cpu_seconds
from cluster.stopping import ShuttingDown, stop_signal
from distillspec.config import JobConfig, load_config
from distillspec.errors import DistillSpecError
from distillspec.models.loading import load_decoding_pair, load_tokenizer
from distillspec.models.pretrained import resolve_models
from distillspec.serving.completer import (
    Completer,
    Completion,
    CompletionJob,
    DraftServer,
    RequestBatcher,
    ScoredDelta,
    recordable,
)

log = logging.getLogger("distillspec.serve")


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(app)
class Completions:
    """An OpenAI-compatible completions server with a target, a draft that follows a weight store, and SD."""

    def __init__(self, cfg: JobConfig) -> None:
        s = cfg.serve
        guard(s.api_key, s.limits.max_body_bytes)
        torch.set_num_threads(s.replica.threads or max(1, round(s.replica.cpus)))
        logging.basicConfig(level=logging.INFO)
        self.cfg, self.s, seed = cfg, s, int(time.time_ns() % 2**31)
        self.stopping = False  #: the endpoint is shutting down (:meth:`stop`): no new request is taken
        #: the event queues of the streams in flight, with their loops (:meth:`stop` runs in a thread of its own)
        self.streams: dict[asyncio.Queue, asyncio.AbstractEventLoop] = {}
        self.completer: DraftServer
        if s.backend == "vllm":
            from distillspec.serving.vllm_backend import VLLMCompleter  # noqa: PLC0415 (vLLM, optional)

            self.completer = VLLMCompleter(
                cfg.vllm,
                cfg.target,
                cfg.draft,
                load_tokenizer(cfg.target),
                gamma=s.gamma,
                max_gamma=s.max_gamma,
                max_prompt_tokens=s.limits.max_prompt_tokens,
                seed=seed,
            )
        else:
            # the target's weights the followed run shares on this node, if it runs (:mod:`actors.target`)
            shared = shared_target(s.follow.run or cfg.ray.run_name) if cfg.ray.share_target else None
            target, draft, tokenizer = load_decoding_pair(cfg.models, shared_target=shared)
            completer = Completer(
                target,
                draft,
                tokenizer,
                max_prompt_tokens=s.limits.max_prompt_tokens,
                seed=seed,
                max_gamma=s.max_gamma,
                compile=s.compile,
                draft_context=s.draft_context,
                prompt_cache_bytes=s.prompt_cache_mb << 20,
            )
            log.info("replica warmed up in %.1f s", completer.warm_up(s.batching.max_batch_size))
            self.completer = completer
        self.tokenizer = self.completer.tokenizer  # its chat template formats chat requests
        self.vllm = s.backend == "vllm"
        #: the weights' dtype that serves (a bfloat16 target is another model than its float32 original)
        self.dtype = cfg.vllm.dtype if self.vllm else str(target.dtype).removeprefix("torch.")
        self.batcher = RequestBatcher(self._decode, s.batching.max_batch_size, s.batching.batch_wait_timeout_s)
        self.run = s.follow.run or cfg.ray.run_name
        self.metrics = ServeMetrics(s.max_gamma, s.batching.max_batch_size)
        self.held = 0  #: prompts of requests in progress on this replica (``serve.limits.max_queued_prompts``)
        self.replica = serve.get_replica_context().replica_id.unique_id  #: named in each response
        self.follower = DraftFollower(
            self.completer,
            self.run,
            s.follow,
            version_gauge=self.metrics["distillspec_serve_draft_version"],
            rollbacks=self.metrics["distillspec_serve_rollbacks"],
        )
        self.follower.start()
        signal = stop_signal(serve.get_replica_context().app_name)
        threading.Thread(target=lambda: (ray.get(signal.wait.remote()), self.stop()), daemon=True).start()

    def stop(self) -> None:
        """The endpoint is stopping (its :class:`StopSignal` was set): every stream in flight ends with an error event
        at its next block and new requests are answered 503, so that no client waits on a connection about to close."""
        self.stopping = True
        for queue, loop in list(self.streams.items()):
            loop.call_soon_threadsafe(queue.put_nowait, (-1, ShuttingDown()))

    def check_health(self) -> None:
        """Ray Serve's periodic probe: a replica whose engine died, or whose draft stopped following the run, is
        reported unhealthy, and Serve replaces it (instead of it answering 500 or serving a stale draft)."""
        if not self.follower.alive():
            raise RuntimeError("the draft-sync thread stopped")
        self.completer.check_health()

    def _record(self, prompts: list[str]) -> None:
        if self.s.record_prompts:
            self._to_prompt_log("add", prompts)

    def _mark(self, jobs: list[CompletionJob]) -> None:
        """With ``serve.record_samples``, the jobs whose completions are samples of the target keep their tokens with
        the target's top-k (:func:`~distillspec.serving.completer.recordable`)."""
        for job in jobs:
            if self.s.record_samples and recordable(job):
                job.record = self.s.record_samples

    def _record_samples(self, done: list[Completion]) -> None:
        if samples := [d.sample for d in done if d.sample is not None]:
            self._to_prompt_log("add_samples", samples)

    def _to_prompt_log(self, method: str, items: list) -> None:
        try:
            getattr(ray.get_actor(prompts_name(self.run), namespace=NAMESPACE), method).remote(items)
        except ValueError:
            pass  # no online distillation job is running

    # -- routes ---------------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.s.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "distillspec",
                    "target": Path(self.cfg.target).name,  # a name, not where the files lie on the server
                    "draft": Path(self.cfg.draft).name,
                    "draft_version": self.completer.version,
                    "dtype": self.dtype,
                }
            ],
        }

    @app.get("/v1/stats")
    async def stats(self) -> dict:
        return {
            "draft_version": self.completer.version,
            "dtype": self.dtype,
            **self.follower.stats(),
            **({"auto_gamma": summary} if (summary := self.completer.gamma_summary()) else {}),
            **({} if self.vllm else {"batch_sizes": {str(b): n for b, n in sorted(self.batcher.sizes.items())}}),
            **({} if (cache := getattr(self.completer, "prompts", None)) is None else {"prompt_cache": cache.stats()}),
            "cpu_s": await asyncio.to_thread(cpu_seconds),  # it reads every process's parent: not on the loop
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(self, body: CompletionRequest, request: Request) -> dict | StreamingResponse:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        return await self._serve(body, lambda: prompts, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, body: ChatRequest, request: Request) -> dict | StreamingResponse:
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await self._serve(
            body, lambda: [chat_prompt(self.tokenizer, body.messages, self.s.model_name)], chat=True
        )

    async def _serve(self, body: DecodingRequest, prompts, *, chat: bool) -> dict | StreamingResponse:
        start, held = time.perf_counter(), 0
        if self.stopping:
            raise HTTPError(503, str(ShuttingDown()), None, "server_error", {"Retry-After": "5"})
        try:
            # The chat template and the tokenizer run in a thread: a long prompt never stalls the other streams.
            jobs = await asyncio.to_thread(lambda: completion_jobs(body, prompts(), self.s, self.completer.check))
            self._mark(jobs)
            held = self._hold(len(jobs))
            if body.stream:
                if len(jobs) != body.n:
                    raise HTTPError(400, "prompt: streaming takes one prompt", "prompt")
                self.metrics.count("ok")
                self._record([jobs[0].prompt])
                held = 0  # the stream lets go of its samples when it ends
                return StreamingResponse(self._stream(jobs, start, chat), media_type="text/event-stream")
            if self.vllm:  # the engine batches concurrent requests itself
                done = await asyncio.gather(*[self.completer.complete(job) for job in jobs])
                self._observe(done)
            else:
                done = await asyncio.gather(*[self.batcher.submit(job) for job in jobs])
                for d in done:  # a job that failed alone (its batch's other jobs did not fail with it)
                    if isinstance(d, DistillSpecError):
                        raise HTTPError(400, str(d), param_of(str(d)))
                    if isinstance(d, Exception):
                        raise d
        except HTTPError as exc:
            self.metrics.count("client_error")
            raise exc
        except Exception:
            self.metrics.count("server_error")
            raise
        finally:
            self.held -= held
        self.metrics.count("ok")
        self._record([j.prompt for j in jobs])
        self._record_samples(done)
        self.metrics["distillspec_serve_latency_s"].observe(time.perf_counter() - start)
        return completion_response(done, chat, self.s.model_name, self.replica, self._token_text)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _hold(self, prompts: int) -> int:
        """Count ``prompts`` as held by this replica (queued or decoding), or answer 429 when they would pass
        ``serve.limits.max_queued_prompts``; returns the count to let go of when the request ends."""
        if self.held + prompts > self.s.limits.max_queued_prompts:
            raise HTTPError(
                429,
                f"this replica holds {self.held} prompts, its limit is {self.s.limits.max_queued_prompts} "
                "(serve.limits.max_queued_prompts): retry shortly",
                None,
                "rate_limit_error",
                {"Retry-After": "1"},
            )
        self.held += prompts
        return prompts

    # -- decoding -------------------------------------------------------------------------------------------
    async def _decode(self, jobs: list[CompletionJob]) -> list[Completion | Exception]:
        """One batch of :class:`distillspec.serving.completer.RequestBatcher`: decoded in a thread, observed here."""
        self.metrics["distillspec_serve_batch_size"].observe(len(jobs))
        done = await asyncio.to_thread(self.completer.complete, jobs)
        if ok := [d for d in done if isinstance(d, Completion)]:
            self._observe(ok)
        return done

    def _observe(self, done: list[Completion]) -> None:
        self.follower.judge(done)
        self.metrics.observe(done, self.completer.gamma_summary, getattr(self.completer, "prompts", None))

    async def _stream(self, jobs: list[CompletionJob], start: float, chat: bool):
        """Server-sent events: each sample's text deltas as its tokens are accepted (``index``: its choice), then its
        final chunk with usage and SD stats."""
        event, queue = stream_events(chat, self.s.model_name), asyncio.Queue()

        async def pump(index: int, job: CompletionJob) -> None:
            try:
                async for item in self.completer.stream(job):
                    await queue.put((index, item))
            except Exception as exc:
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
        offsets = [0] * len(jobs)  # each choice's characters of token text scored so far (completions' text_offset)
        self.streams[queue] = asyncio.get_running_loop()
        try:
            if chat:
                for i in range(len(jobs)):
                    yield event(None, index=i)  # the role comes first, as OpenAI sends it
            for _ in range(len(jobs)):
                while (got := await queue.get())[1] is not None:
                    index, item = got
                    if isinstance(item, Exception):
                        raise item
                    if isinstance(item, str):
                        yield event(item, index=index)
                        continue
                    if isinstance(item, ScoredDelta):  # its tokens' log-probs, their offsets after the ones sent
                        scores = logprobs_body(item.logprobs, chat, self._token_text, offsets[index])
                        offsets[index] += sum(len(self._token_text(t)) for t in item.logprobs.tokens)
                        yield event(item.text, index=index, logprobs=scores)
                        continue
                    self._observe([item])
                    self._record_samples([item])
                    self.metrics["distillspec_serve_latency_s"].observe(time.perf_counter() - start)
                    sd = {**sd_stats([item]), "replica": self.replica}
                    yield event("", item.finish_reason, index=index, usage=usage([item]), distillspec=sd)
        except Exception as exc:  # the headers are sent: the error travels as an event, as OpenAI sends one
            if not isinstance(exc, ShuttingDown):
                log.exception("a stream failed")
            self.metrics.count("server_error")
            said = isinstance(exc, DistillSpecError)  # a message for the client: its mistake, or the server stopping
            kind = "invalid_request_error" if said and not isinstance(exc, ShuttingDown) else "server_error"
            message = str(exc) if said else f"decoding failed ({type(exc).__name__}); the completion is incomplete"
            yield f"data: {json.dumps(error_body(message, None, kind))}\n\n"
        finally:
            self.streams.pop(queue, None)
            for task in tasks:
                task.cancel()
            self.held -= len(jobs)
        yield "data: [DONE]\n\n"


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application builder ``serve run`` / ``serve deploy`` call with the config file's ``args``:
    ``config`` (a job YAML) and ``overrides`` (``section.key=value`` strings), as for the jobs."""
    unknown = set(args) - {"config", "overrides"}
    if unknown:
        raise DistillSpecError(f"unknown application args {sorted(unknown)}: give config and/or overrides")
    cfg = load_config(args.get("config"), list(args.get("overrides", [])))
    return bind(resolve_models(cfg))


#: Seconds a replica being stopped waits for its requests in flight (then it is killed); its streams were told to end.
STOP_GRACE_S = 2.0
#: Seconds between Serve's health probes of a replica (:meth:`Completions.check_health`). Serve replaces a replica
#: after 3 failed probes in a row: 6 s of 5xx answers after an engine dies, where Serve's default period gives 30 s.
HEALTH_CHECK_PERIOD_S = 2.0

API_KEY_ENV = "DISTILLSPEC_API_KEY"  #: the endpoint's key when serve.api_key is unset (kept out of shell histories)


def with_api_key(cfg: JobConfig) -> JobConfig:
    """``cfg`` with ``serve.api_key`` from the environment (:data:`API_KEY_ENV`) where the config sets none."""
    if cfg.serve.api_key is None and os.environ.get(API_KEY_ENV):
        return replace(cfg, serve=replace(cfg.serve, api_key=os.environ[API_KEY_ENV]))
    return cfg


def bind(cfg: JobConfig) -> serve.Application:
    """The deployment for ``cfg`` (its key taken from the environment where the config sets none)."""
    cfg = with_api_key(cfg)
    s = cfg.serve
    return Completions.options(
        autoscaling_config=asdict(s.autoscaling),  # its keys are Ray Serve's
        max_ongoing_requests=s.limits.max_queued_prompts,  # requests reach the replica: it answers 429 past its limit
        ray_actor_options={"num_cpus": s.replica.cpus, "num_gpus": s.replica.gpus},
        graceful_shutdown_timeout_s=STOP_GRACE_S,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    ).bind(cfg)
