"""The speculative-decoding endpoint on Ray Serve: an OpenAI-compatible ``/v1/completions`` whose draft
follows a running distillation job.

    serve run cluster/serve_config.yaml        # or: python jobs/serve.py

One deployment, :class:`Completions`, is both the FastAPI ingress and the model holder. With ``serve.backend=hf`` its
replicas batch concurrent requests (:class:`distillspec.serving.RequestBatcher`) into
:class:`distillspec.serving.Completer` calls; with
``serve.backend=vllm`` each replica runs vLLM's async engine with the draft as its ``draft_model``
(:class:`distillspec.vllm_backend.VLLMCompleter`, continuous batching), behind the same routes and errors. A thread
in each replica checks the run's weight store (``<run>-weights`` in namespace ``distillspec``) and swaps in each new
serving version (one the evaluator's canary passed) whose weights pass their integrity check; a request keeps the
draft it started with (vLLM: the swap takes effect at the engine's next step, and a response names the version it
ended on too). Each replica tracks live alpha per version; when a new version's falls more than
``serve.rollback_margin`` below the previous version's, it returns to the previous version and rolls the version back
in the store, so the whole deployment follows. With ``serve.record_prompts`` the replica sends
every served prompt to the run's prompt log (``<run>-prompts``), from which an online distillation job samples.

Both backends are :class:`distillspec.serving.DraftServer`\ s; the request schemas and the shapes of responses and
stream events are in :mod:`cluster.openai_api`; the following of the weight store and the rollback are
:class:`cluster.follower.DraftFollower`'s.
"""

import asyncio
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
import yaml
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.common import NAMESPACE, prompts_name
from cluster.follower import DraftFollower
from cluster.openai_api import (
    CONTROL_FIELDS,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DecodingRequest,
    HTTPError,
    completion_response,
    error_body,
    logprobs_body,
    param_of,
    sample_seed,
    sd_stats,
    stream_events,
    usage,
)
from distillspec.config import JobConfig, load_config
from distillspec.data import load_task
from distillspec.errors import DistillSpecError
from distillspec.models import load_decoding_pair, load_tokenizer
from distillspec.pretrained import prepare_models
from distillspec.sampling import SamplingControls
from distillspec.serving import (
    Completer,
    Completion,
    CompletionJob,
    DecodingArgs,
    DraftServer,
    RequestBatcher,
    ScoredDelta,
    merge_stats,
)

log = logging.getLogger("distillspec.serve")

#: name -> (kind, description, tag keys) of the endpoint's metrics (Prometheus: ``ray_<name>``)
SERVE_SPECS: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "distillspec_serve_requests": (metrics.Counter, "completion requests by outcome", ("status",)),
    "distillspec_serve_acceptance_rate": (metrics.Gauge, "alpha of the latest served batch", ()),
    "distillspec_serve_block_efficiency": (metrics.Gauge, "tau of the latest served batch", ()),
    "distillspec_serve_tokens_per_s": (metrics.Gauge, "completion tokens per second of the latest batch", ()),
    "distillspec_serve_latency_s": (metrics.Histogram, "request latency in seconds", ()),
    "distillspec_serve_draft_version": (metrics.Gauge, "draft weight version the replica serves", ()),
    "distillspec_serve_rollbacks": (metrics.Counter, "draft versions the replica rolled back (live alpha fell)", ()),
    "distillspec_serve_gamma": (metrics.Histogram, "draft tokens per block chosen by gamma=auto", ()),
    "distillspec_serve_batch_size": (metrics.Histogram, "requests decoded together in one batch (torch backend)", ()),
    "distillspec_serve_expected_tokens_per_s": (
        metrics.Gauge,
        "gamma=auto: tokens/s its choices were expected to reach (moving average over blocks)",
        (),
    ),
    "distillspec_serve_measured_tokens_per_s": (
        metrics.Gauge,
        "gamma=auto: tokens/s the blocks reached (moving average over blocks)",
        (),
    ),
}
LATENCY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


app = FastAPI(title="DistillSpec speculative decoding", version="1")
#: this replica's ``serve.api_key`` and ``serve.max_body_bytes`` (one replica per process)
_guard: dict[str, Any] = {"key": None, "max_body_bytes": None}


def guard(key: str | None, max_body_bytes: int | None = None) -> None:
    """Make this process's routes answer only requests with ``key`` (None: every request) and bodies of at most
    ``max_body_bytes``. A function of this module, so that the deployment, which Ray ships to its replica by value,
    sets the globals the middleware reads."""
    _guard.update(key=key or None, max_body_bytes=max_body_bytes)


class _BodyLimit:
    """A body over ``serve.max_body_bytes`` gets a 413: by its Content-Length before a byte of it is read, or, sent
    without one (chunked), as soon as what arrived passes the limit (what arrives before is buffered, then replayed
    to the route). Runs after the key check."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        limit = _guard["max_body_bytes"]
        if scope["type"] != "http" or not limit:
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit():
            if int(length) > limit:
                return await _too_large(limit)(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunks.append(message.get("body", b""))
            size, more = size + len(chunks[-1]), message.get("more_body", False)
            if size > limit:
                return await _too_large(limit)(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def _cpu_seconds() -> float:
    """CPU seconds this replica's process and its children (vLLM's engine core) have run so far: the machine's work
    its serving took, whatever share of the cores other processes held meanwhile."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # a child that ended meanwhile
            continue
        total += times.user + times.system
    return total


def _too_large(limit: int) -> JSONResponse:
    message = f"the request body is larger than this server's limit of {limit} bytes (serve.max_body_bytes)"
    return JSONResponse(status_code=413, content=error_body(message, None))


app.add_middleware(_BodyLimit)  # added first: it runs inside the key check below


@app.middleware("http")
async def _require_key(request: Request, call_next):
    """With ``serve.api_key``, every route (``/docs`` and ``/openapi.json`` too) answers 401 to a request without the
    key, before its body is read: an unauthenticated client learns nothing of the schema and costs no parsing."""
    if (key := _guard["key"]) is not None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):
            message = "missing or wrong API key (Authorization: Bearer ...)"
            return JSONResponse(status_code=401, content=error_body(message, None, "authentication_error"))
    return await call_next(request)


@app.exception_handler(RequestValidationError)
async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return JSONResponse(status_code=400, content=error_body("the request body is not valid JSON", None))
    param = loc[0] if loc else None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg"))
    if first.get("type") == "extra_forbidden":
        message = f"{param}: unknown or unsupported field"
    return JSONResponse(status_code=400, content=error_body(message, param))


@app.exception_handler(StarletteHTTPException)
async def _routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404), wrong methods (405), ...: OpenAI's error shape, as on every route."""
    message = {
        404: f"no route {request.method} {request.url.path}: this server serves /v1/completions, "
        "/v1/chat/completions, /v1/models and /v1/stats",
        405: f"{request.method} is not allowed on {request.url.path}",
    }
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        status_code=exc.status_code,
        content=error_body(message.get(exc.status_code, str(exc.detail)), None, kind),
        headers=getattr(exc, "headers", None),
    )


@app.exception_handler(HTTPError)
async def _http_error(_request: Request, exc: HTTPError) -> JSONResponse:
    content = error_body(exc.message, exc.param, exc.kind)
    return JSONResponse(status_code=exc.status, content=content, headers=exc.headers)


@ray.remote(num_cpus=0)
class StopSignal:
    """Set once, when the job that serves an application stops (``jobs/serve.py``): each replica of the application
    waits on it, then ends its streams (:meth:`Completions.stop`)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()

    def set(self) -> None:
        self.event.set()


def stop_signal(app: str) -> ray.actor.ActorHandle:
    """The :class:`StopSignal` of Serve application ``app`` (made by whoever asks first)."""
    return StopSignal.options(name=f"stop:{app}", namespace=NAMESPACE, get_if_exists=True).remote()


class ShuttingDown(DistillSpecError):
    def __init__(self) -> None:
        super().__init__("the server is shutting down: the completion is incomplete; retry on another server")


def scoring(body: DecodingRequest) -> tuple[int | None, bool]:
    """A request's log-probs (how many likeliest tokens at each position; None: none asked) and ``echo``, or a 400
    for a combination the endpoint does not take."""
    chat = isinstance(body, ChatRequest)
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise HTTPError(400, "top_logprobs: give logprobs=true with it", "top_logprobs")
        logprobs, echo = (body.top_logprobs or 0) if body.logprobs else None, False
    else:
        logprobs, echo = body.logprobs, body.echo
    if body.max_tokens == 0 and not echo:
        raise HTTPError(
            400, "max_tokens: 0 generates nothing; it scores a prompt with echo=true (completions)", "max_tokens"
        )
    if body.stream and echo:
        raise HTTPError(400, "echo: a prompt's log-probs are answered whole: set stream=false", "echo")
    return logprobs, echo


@serve.deployment(max_ongoing_requests=64)
@serve.ingress(app)
class Completions:
    """An OpenAI-compatible completions server with a target, a draft that follows a weight store, and SD."""

    def __init__(self, cfg: JobConfig) -> None:
        s = cfg.serve
        guard(s.api_key, s.max_body_bytes)
        torch.set_num_threads(s.threads or max(1, round(s.replica_cpus)))
        logging.basicConfig(level=logging.INFO)
        self.cfg, self.s, seed = cfg, s, int(time.time_ns() % 2**31)
        self.stopping = False  #: the endpoint is shutting down (:meth:`stop`): no new request is taken
        #: the event queues of the streams in flight, with their loops (:meth:`stop` runs in a thread of its own)
        self.streams: dict[asyncio.Queue, asyncio.AbstractEventLoop] = {}
        self.completer: DraftServer
        if s.backend == "vllm":
            from distillspec.vllm_backend import VLLMCompleter  # the optional extra, imported only when asked for

            self.completer = VLLMCompleter(
                cfg.vllm,
                cfg.target,
                cfg.draft,
                load_tokenizer(cfg.target),
                gamma=s.gamma,
                max_gamma=s.max_gamma,
                max_prompt_tokens=s.max_prompt_tokens,
                seed=seed,
            )
        else:
            target, draft, tokenizer = load_decoding_pair(cfg.models)
            completer = Completer(
                target, draft, tokenizer, max_prompt_tokens=s.max_prompt_tokens, seed=seed, max_gamma=s.max_gamma
            )
            log.info("replica warmed up in %.1f s", completer.warm_up(s.max_batch_size))
            self.completer = completer
        self.tokenizer = self.completer.tokenizer  # its chat template formats chat requests
        self.vllm = s.backend == "vllm"
        #: the weights' dtype that serves (a bfloat16 target is another model than its float32 original)
        self.dtype = cfg.vllm.dtype if self.vllm else str(target.dtype).removeprefix("torch.")
        self.gamma_counted: dict[str, int] = {}  #: gamma=auto: the choices already on the dashboard, by gamma
        self.gamma_polled = 0.0  #: when they were last brought to the dashboard (at most once a second)
        self.batcher = RequestBatcher(self._decode, s.max_batch_size, s.batch_wait_timeout_s)
        self.run = s.follow_run or cfg.ray.run_name
        boundaries = {
            "distillspec_serve_latency_s": LATENCY_BOUNDARIES,
            "distillspec_serve_gamma": [g + 0.5 for g in range(s.max_gamma)],  # one bucket per gamma
            "distillspec_serve_batch_size": [b + 0.5 for b in range(s.max_batch_size)],  # one bucket per size
        }
        self.metrics = {
            name: kind(
                name, description=d, tag_keys=tags, **({"boundaries": boundaries[name]} if name in boundaries else {})
            )
            for name, (kind, d, tags) in SERVE_SPECS.items()
        }
        self.held = 0  #: prompts of requests in progress on this replica (``serve.max_queued_prompts``)
        self.replica = serve.get_replica_context().replica_id.unique_id  #: named in each response
        self.follower = DraftFollower(
            self.completer,
            self.run,
            follow_version=s.follow_version,
            sync_every_s=s.sync_every_s,
            rollback_window=s.rollback_window,
            rollback_margin=s.rollback_margin,
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
        if not self.s.record_prompts:
            return
        try:
            ray.get_actor(prompts_name(self.run), namespace=NAMESPACE).add.remote(prompts)
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
            "cpu_s": await asyncio.to_thread(_cpu_seconds),  # it reads every process's parent: not on the loop
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(self, body: CompletionRequest, request: Request) -> dict | StreamingResponse:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        return await self._serve(body, lambda: prompts, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, body: ChatRequest, request: Request) -> dict | StreamingResponse:
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        return await self._serve(body, lambda: [self._chat_prompt(body.messages)], chat=True)

    def _chat_prompt(self, messages: list[ChatMessage]) -> str:
        """The conversation as the model's prompt, through its tokenizer's chat template."""
        if not self.tokenizer.chat_template:
            raise HTTPError(
                400,
                f"model {self.s.model_name!r} has no chat template (its tokenizer defines none): use /v1/completions "
                "with a prompt in the model's own format",
                "messages",
            )
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in messages]
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may refuse a conversation (e.g. roles out of order)
            raise HTTPError(400, f"messages: the chat template refused them: {exc}", "messages") from None

    async def _serve(self, body: DecodingRequest, prompts, *, chat: bool) -> dict | StreamingResponse:
        start, held = time.perf_counter(), 0
        if self.stopping:
            raise HTTPError(503, str(ShuttingDown()), None, "server_error", {"Retry-After": "5"})
        try:
            # The chat template and the tokenizer run in a thread: a long prompt never stalls the other streams.
            jobs = await asyncio.to_thread(lambda: self._jobs(body, prompts()))
            held = self._hold(len(jobs))
            if body.stream:
                if len(jobs) != body.n:
                    raise HTTPError(400, "prompt: streaming takes one prompt", "prompt")
                self._count("ok")
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
            self._count("client_error")
            raise exc
        except Exception:
            self._count("server_error")
            raise
        finally:
            self.held -= held
        self._count("ok")
        self._record([j.prompt for j in jobs])
        self.metrics["distillspec_serve_latency_s"].observe(time.perf_counter() - start)
        return completion_response(done, chat, self.s.model_name, self.replica, self._token_text)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _count(self, status: str) -> None:
        self.metrics["distillspec_serve_requests"].inc(tags={"status": status})

    def _hold(self, prompts: int) -> int:
        """Count ``prompts`` as held by this replica (queued or decoding), or answer 429 when they would pass
        ``serve.max_queued_prompts``; returns the count to let go of when the request ends."""
        if self.held + prompts > self.s.max_queued_prompts:
            raise HTTPError(
                429,
                f"this replica holds {self.held} prompts, its limit is {self.s.max_queued_prompts} "
                "(serve.max_queued_prompts): retry shortly",
                None,
                "rate_limit_error",
                {"Retry-After": "1"},
            )
        self.held += prompts
        return prompts

    def _jobs(self, body: DecodingRequest, prompts: list[str]) -> list[CompletionJob]:
        if len(prompts) > self.s.max_prompts:
            raise HTTPError(
                413,
                f"prompt: {len(prompts)} prompts, more than this server's limit of {self.s.max_prompts} per request "
                "(serve.max_prompts)",
                "prompt",
            )
        if body.model not in (None, self.s.model_name):
            raise HTTPError(
                404, f"model: {body.model!r} is not served here (this serves {self.s.model_name!r})", "model"
            )
        if body.max_tokens > self.s.max_tokens:
            raise HTTPError(
                400, f"max_tokens: {body.max_tokens} is above this server's limit {self.s.max_tokens}", "max_tokens"
            )
        gamma = (body.gamma or self.s.gamma) if body.speculative else 0
        try:
            controls = SamplingControls.of(**body.model_dump(include=CONTROL_FIELDS))
            args = DecodingArgs(
                gamma=gamma,
                temperature=self.s.temperature if body.temperature is None else body.temperature,
                lenience=body.lenience,
                epsilon=body.epsilon,
                controls=controls,
            )
            stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
            logprobs, echo = scoring(body)
            jobs = [
                CompletionJob(p, body.max_tokens, args, stop, sample_seed(body.seed, i), logprobs, echo)
                for p in prompts
                for i in range(body.n)
            ]
            for job in jobs:
                self.completer.check(job)
        except DistillSpecError as exc:
            raise HTTPError(400, str(exc), param_of(str(exc))) from None
        return jobs

    # -- decoding -------------------------------------------------------------------------------------------
    async def _decode(self, jobs: list[CompletionJob]) -> list[Completion | Exception]:
        """One batch of :class:`distillspec.serving.RequestBatcher`: decoded in a thread, observed here."""
        self.metrics["distillspec_serve_batch_size"].observe(len(jobs))
        done = await asyncio.to_thread(self.completer.complete, jobs)
        if ok := [d for d in done if isinstance(d, Completion)]:
            self._observe(ok)
        return done

    def _observe(self, done: list[Completion]) -> None:
        self.follower.judge(done)
        sd = merge_stats([c.stats for c in done])
        if sd["alpha"] is not None:
            self.metrics["distillspec_serve_acceptance_rate"].set(sd["alpha"])
        if sd["tau"] is not None:
            self.metrics["distillspec_serve_block_efficiency"].set(sd["tau"])
        seconds = max(c.seconds for c in done)
        self.metrics["distillspec_serve_tokens_per_s"].set(sum(c.completion_tokens for c in done) / max(seconds, 1e-9))
        if time.monotonic() - self.gamma_polled >= 1.0:  # the choices' running counts: nothing is lost between
            self.gamma_polled = time.monotonic()
            if (summary := self.completer.gamma_summary()) is not None:
                self._gamma_metrics(summary)

    def _gamma_metrics(self, summary: dict) -> None:
        """The gammas chosen since the last call (from the summary's running counts) and the expected and measured
        tokens/s, on the dashboard."""
        for gamma, n in summary["chosen"].items():
            for _ in range(n - self.gamma_counted.get(gamma, 0)):
                self.metrics["distillspec_serve_gamma"].observe(int(gamma))
        self.gamma_counted = dict(summary["chosen"])
        if summary["expected_tokens_per_s"] is not None and summary["measured_tokens_per_s"] is not None:
            self.metrics["distillspec_serve_expected_tokens_per_s"].set(summary["expected_tokens_per_s"])
            self.metrics["distillspec_serve_measured_tokens_per_s"].set(summary["measured_tokens_per_s"])

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
                    self.metrics["distillspec_serve_latency_s"].observe(time.perf_counter() - start)
                    sd = {**sd_stats([item]), "replica": self.replica}
                    yield event("", item.finish_reason, index=index, usage=usage([item]), distillspec=sd)
        except Exception as exc:  # the headers are sent: the error travels as an event, as OpenAI sends one
            if not isinstance(exc, ShuttingDown):
                log.exception("a stream failed")
            self._count("server_error")
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


def resolve_models(cfg: JobConfig) -> JobConfig:
    """The pair to serve, with local paths made absolute (replicas may run in another working directory):

    - ``serve.run`` (``--run``): that jobs/distill.py output folder's ``draft/`` with the target it was distilled for
      (its ``config.yaml``);
    - ``--draft`` alone, when it is such a run's ``draft/`` folder: the same;
    - ``--target`` and ``--draft``: those; neither: the garden pair (built, or taken from its cache).
    """
    run = Path(cfg.serve.run) if cfg.serve.run else None
    if run is None and cfg.draft is not None and cfg.target is None:
        run = Path(cfg.draft).parent
        if not (run / RUN_CONFIG).exists():
            raise DistillSpecError(
                f"--draft {cfg.draft}: give its --target too (only a jobs/distill.py run's draft/ folder, next to its "
                f"{RUN_CONFIG}, knows its target)"
            )
    if run is not None:
        return replace(cfg, **run_models(run))
    return prepare_models(cfg, load_task(cfg.dataset, seed=cfg.seed))


#: Seconds a replica being stopped waits for its requests in flight (then it is killed); its streams were told to end.
STOP_GRACE_S = 2.0

RUN_CONFIG = "config.yaml"  #: what jobs/distill.py writes into its output folder: the resolved config of the run


def run_models(run: Path) -> dict[str, str]:
    """The ``target``, distilled ``draft`` and ``dataset`` of a jobs/distill.py output folder."""
    config, draft = run / RUN_CONFIG, run / "draft"
    if not config.exists():
        raise DistillSpecError(f"--run {run}: no {RUN_CONFIG} there: not an output folder of jobs/distill.py")
    if not (draft / "config.json").exists():
        raise DistillSpecError(
            f"--run {run}: no distilled draft yet ({draft}): the run has not finished. While it runs, serve its "
            "latest version with serve.follow_run=<its ray.run_name>"
        )
    recorded = yaml.safe_load(config.read_text()) or {}
    target = recorded.get("target")
    if not target:
        raise DistillSpecError(f"--run {run}: {config} names no target")
    return {"target": target, "draft": str(draft.resolve()), "dataset": recorded.get("dataset", "arith")}


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
    autoscaling = {
        "min_replicas": s.min_replicas,
        "max_replicas": s.max_replicas,
        "target_ongoing_requests": s.target_ongoing_requests,
        "upscale_delay_s": s.upscale_delay_s,
        "downscale_delay_s": s.downscale_delay_s,
    }
    return Completions.options(
        autoscaling_config=autoscaling,
        max_ongoing_requests=s.max_queued_prompts,  # requests reach the replica, which answers 429 past its limit
        ray_actor_options={"num_cpus": s.replica_cpus, "num_gpus": s.replica_gpus},
        graceful_shutdown_timeout_s=STOP_GRACE_S,
    ).bind(cfg)
