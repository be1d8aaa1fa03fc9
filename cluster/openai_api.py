"""The OpenAI API as the endpoint speaks it: request schemas (with this project's decoding fields), errors, and the
shapes of responses and stream events. :mod:`cluster.serve` holds the routes that use them."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import PreTrainedTokenizerBase

from distillspec.config import Lenience, ServeConfig
from distillspec.decoding.sampling import SamplingControls
from distillspec.errors import DistillSpecError
from distillspec.serving.completer import Completion, CompletionJob, DecodingArgs, TokenLogprobs, merge_stats

#: The most likeliest tokens a request may ask scores of at each position (``logprobs``, ``top_logprobs``), as vLLM.
MAX_LOGPROBS = 20

#: The request fields that are :class:`~distillspec.decoding.sampling.SamplingControls`, by the same names.
CONTROL_FIELDS = {f.name for f in dataclasses.fields(SamplingControls)}


class DecodingRequest(BaseModel):
    """The decoding fields of OpenAI's requests, vLLM's sampling extensions (``top_k``, ``min_p``,
    ``repetition_penalty``, ``stop_token_ids``), plus ``gamma``, ``lenience``, ``epsilon`` and ``speculative``. The
    sampling controls' ranges are checked once, by :meth:`distillspec.decoding.sampling.SamplingControls.check` (a 400
    naming the field)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = Field(16, ge=0, strict=True, description="0 (completions with echo only): score the prompt")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="unset: serve.temperature (default 1)")
    top_p: float | None = Field(None, description="nucleus sampling: the likeliest tokens with this mass, (0, 1]")
    top_k: int | None = Field(None, description="the k likeliest tokens (vLLM); 0 or -1: all")
    min_p: float | None = Field(None, description="tokens at least min_p times as likely as the likeliest (vLLM)")
    presence_penalty: float | None = Field(None, description="subtracted once from a generated token's logit, [-2, 2]")
    frequency_penalty: float | None = Field(None, description="times a token's count, subtracted, [-2, 2]")
    repetition_penalty: float | None = Field(None, description="divides a seen token's logit (vLLM), (0, 2]")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias added to its logit, [-100, 100]")
    stop_token_ids: list[int] | None = Field(None, description="tokens that end the completion as EOS does (vLLM)")
    n: int = Field(1, ge=1, le=16, strict=True, description="samples of each prompt (rows of one batch)")
    stream: bool = Field(False, strict=True)
    stream_options: dict | None = None
    seed: int | None = Field(None, strict=True, ge=-(2**63), le=2**64 - 1, description="as torch.manual_seed takes")
    stop: str | list[str] | None = None
    user: str | None = None
    gamma: Annotated[int, Field(ge=1, le=32, strict=True)] | Literal["auto"] | None = Field(
        None, description="draft tokens per target call; auto: chosen per block (unset: serve.gamma)"
    )
    lenience: Lenience | None = None
    epsilon: float = Field(1.0, gt=0.0, le=1.0, description="lossy SD lenience parameter; 1 is lossless")
    speculative: bool = Field(True, strict=True, description="false: the target alone (for comparison)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop strings")
        return v


class CompletionRequest(DecodingRequest):
    """OpenAI's completion request."""

    prompt: str | list[str]
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, strict=True, description="the target's log-probs of the tokens, and of k likeliest"
    )
    echo: bool = Field(False, strict=True, description="the prompt before the completion (its tokens scored too)")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: str | list[str]) -> str | list[str]:
        items = [v] if isinstance(v, str) else v
        if not items or any(not p.strip() for p in items):
            raise ValueError("must be a non-empty string or a non-empty list of non-empty strings")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: accepted, not used

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The content; of a list of parts, its text parts joined."""
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatRequest(DecodingRequest):
    """OpenAI's chat completion request (text messages)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True, description="the newer name of max_tokens")
    logprobs: bool = Field(False, strict=True, description="the target's log-probs of the tokens")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, strict=True, description="with logprobs: the k likeliest tokens at each position"
    )


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's ``index``-th sample (``n`` > 1): ``seed + index`` as vLLM derives it, kept in the
    range a seed may take."""
    if seed is None:
        return None
    return seed + index if seed + index < 2**64 else seed + index - 2**64


def param_of(message: str) -> str | None:
    """The request field a :class:`DistillSpecError` from the decoder names (``"gamma=0: ..."``)."""
    head = message.split(":", 1)[0].split("=", 1)[0].strip()
    return {"max_new_tokens": "max_tokens"}.get(head, head) if head.isidentifier() else None


def usage(done: list[Completion]) -> dict:
    """OpenAI's usage: tokens, and the prompt's tokens read from the prompt cache (``cached_tokens``)."""
    prompt, completion = sum(c.prompt_tokens for c in done), sum(c.completion_tokens for c in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_prompt_tokens for c in done)},
    }


def sd_stats(done: list[Completion]) -> dict:
    """SD statistics of a response: pooled over its choices, with the draft version and decoding time (vLLM: a
    ``draft_version_end`` when a new version took over during the request)."""
    ends = [c.stats["draft_version_end"] for c in done if "draft_version_end" in c.stats]
    return {
        **merge_stats([c.stats for c in done]),
        **({"draft_version_end": max(ends)} if ends else {}),
        "draft_version": done[0].version,
        "seconds": max(c.seconds for c in done),
    }


def logprobs_body(
    scores: TokenLogprobs | None, chat: bool, decode: Callable[[int], str], offset: int = 0
) -> dict | None:
    """A choice's ``logprobs`` in OpenAI's shape: chat's ``content`` list, or the completions' parallel lists (with
    each token's character offset in the text, from ``offset``: a stream's chunk continues the ones before it);
    ``decode`` gives a token's text."""
    if scores is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}

    if chat:
        content = []
        for token, logprob, top in zip(scores.tokens, scores.logprobs, scores.top, strict=True):
            content.append({**entry(token, logprob), "top_logprobs": [entry(t, v) for t, v in (top or {}).items()]})
        return {"content": content}
    texts = [decode(t) for t in scores.tokens]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    tops = [None if top is None else {decode(t): max(v, -9999.0) for t, v in top.items()} for top in scores.top]
    logprobs = [None if v is None else max(v, -9999.0) for v in scores.logprobs]
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def completion_response(
    done: list[Completion], chat: bool, model: str, replica: str, decode: Callable[[int], str]
) -> dict:
    """A completion (``chat``: chat completion) response with one choice per completion in ``done`` (``decode``:
    a token's text, for log-probs)."""
    if chat:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs_body(c.logprobs, chat, decode),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(done)
        ]
    else:
        choices = [
            {
                "text": c.text,
                "index": i,
                "logprobs": logprobs_body(c.logprobs, chat, decode),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(done)
        ]
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(done),
        "distillspec": {**sd_stats(done), "replica": replica},
    }


def stream_events(chat: bool, model: str) -> Callable[..., str]:
    """The server-sent event of one stream's chunks: ``event(text, finish, index=0, logprobs=None, **extra)``
    (``index``: the choice; ``logprobs``: the chunk's, from :func:`logprobs_body`); ``text=None`` (chat only) is a
    choice's first chunk, which names the role."""
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(
        text: str | None, finish: str | None = None, index: int = 0, logprobs: dict | None = None, **extra: Any
    ) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"text": text or "", "index": index, "logprobs": logprobs, "finish_reason": finish}
        data = {"id": rid, "object": kind, "created": created, "model": model}
        return f"data: {json.dumps({**data, 'choices': [choice], **extra})}\n\n"

    return event


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


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], model: str) -> str:
    """The conversation as the model's prompt, through its tokenizer's chat template (``model``: its name here)."""
    if not tokenizer.chat_template:
        raise HTTPError(
            400,
            f"model {model!r} has no chat template (its tokenizer defines none): use /v1/completions with a prompt in "
            "the model's own format",
            "messages",
        )
    try:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a template may refuse a conversation (e.g. roles out of order)
        raise HTTPError(400, f"messages: the chat template refused them: {exc}", "messages") from None


def completion_jobs(
    body: DecodingRequest, prompts: list[str], s: ServeConfig, check: Callable[[CompletionJob], None]
) -> list[CompletionJob]:
    """The jobs of a request (each prompt ``n`` times), within the server's limits (``s``) and checked by the backend
    (``check``); a 4xx names what is wrong."""
    if len(prompts) > s.limits.max_prompts:
        raise HTTPError(
            413,
            f"prompt: {len(prompts)} prompts, more than this server's limit of {s.limits.max_prompts} per request "
            "(serve.limits.max_prompts)",
            "prompt",
        )
    if body.model not in (None, s.model_name):
        raise HTTPError(404, f"model: {body.model!r} is not served here (this serves {s.model_name!r})", "model")
    if body.max_tokens > s.limits.max_tokens:
        raise HTTPError(
            400, f"max_tokens: {body.max_tokens} is above this server's limit {s.limits.max_tokens}", "max_tokens"
        )
    gamma = (body.gamma or s.gamma) if body.speculative else 0
    try:
        controls = SamplingControls.of(**body.model_dump(include=CONTROL_FIELDS))
        args = DecodingArgs(
            gamma=gamma,
            temperature=s.temperature if body.temperature is None else body.temperature,
            lenience=body.lenience,
            epsilon=body.epsilon,
            controls=controls,
        )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        logprobs, echo = scoring(body)
        jobs = []
        for p in prompts:  # each prompt checked and tokenised once, then sampled n times
            job = CompletionJob(p, body.max_tokens, args, stop, sample_seed(body.seed, 0), logprobs, echo)
            check(job)
            jobs += [job, *(dataclasses.replace(job, seed=sample_seed(body.seed, i)) for i in range(1, body.n))]
    except DistillSpecError as exc:
        raise HTTPError(400, str(exc), param_of(str(exc))) from None
    return jobs
