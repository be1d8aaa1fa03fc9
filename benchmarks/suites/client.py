"""What a client of the OpenAI API gets: one request per field the endpoint takes, sent through the official
``openai`` client to a running endpoint, printed as sent and as answered (text, finish reason, log-probs, usage).

    python jobs/serve.py &                                   # the garden pair on http://127.0.0.1:8000
    python -m benchmarks.suites.client --url http://127.0.0.1:8000/v1

Writes ``client.json`` (every answer whole) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from openai import APIStatusError, OpenAI

PROMPT = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
CHAT = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


def requests_by_field() -> dict[str, tuple[str, dict[str, Any]]]:
    """``{field: (route, arguments)}``: a request for each field (the vLLM extensions in ``extra_body``)."""
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    extra = lambda **kw: base | {"extra_body": kw}
    return {
        "max_tokens (finish_reason length)": ("completions", base | {"max_tokens": 4}),
        "stop": ("completions", base | {"stop": ["\n"]}),
        "seed (sent twice)": ("completions", base),
        "n": ("completions", base | {"n": 3}),
        "top_p": ("completions", base | {"top_p": 0.5}),
        "top_k": ("completions", extra(top_k=3)),
        "min_p": ("completions", extra(min_p=0.2)),
        "presence_penalty": ("completions", base | {"presence_penalty": 1.5}),
        "frequency_penalty": ("completions", base | {"frequency_penalty": 1.5}),
        "repetition_penalty": ("completions", extra(repetition_penalty=1.5)),
        "logit_bias": ("completions", base | {"logit_bias": {"0": 100}}),
        "stop_token_ids": ("completions", extra(stop_token_ids=[0])),
        "logprobs": ("completions", base | {"logprobs": 2, "max_tokens": 3}),
        "logprobs, streamed": ("completions", base | {"logprobs": 1, "max_tokens": 3, "stream": True}),
        "echo, max_tokens 0 (a text scored)": (
            "completions",
            {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0},
        ),  # fmt: skip
        "stream_options.include_usage": (
            "completions",
            base | {"stream": True, "stream_options": {"include_usage": True}},
        ),  # fmt: skip
        "chat: logprobs, top_logprobs": (
            "chat",
            {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "seed": 7},
        ),  # fmt: skip
        "chat: system message, max_completion_tokens": (
            "chat",
            {"messages": [{"role": "system", "content": "Answer with a number."}, *CHAT], "max_completion_tokens": 6},
        ),
    }


def send(client: OpenAI, route: str, args: dict) -> Any:
    """One request; a streamed one's chunks gathered (text, log-probs, usage)."""
    create = client.completions.create if route == "completions" else client.chat.completions.create
    try:
        answer = create(model="distillspec", **args)
    except APIStatusError as exc:  # the endpoint's answer is what this tour reports, a refusal or a failure alike
        return {"status": exc.status_code, "error": str(exc)[:300]}
    if not args.get("stream"):
        return answer.model_dump()
    text, logprobs, usage = "", [], None
    for chunk in answer:
        for choice in chunk.choices:
            text += choice.text
            logprobs += (choice.logprobs.token_logprobs or []) if choice.logprobs else []
        usage = chunk.usage or usage
    return {"streamed_text": text, "token_logprobs": logprobs, "usage": usage and usage.model_dump()}


def summary(answer: dict) -> str:
    """What came back, in a line."""
    if "error" in answer:
        return f"HTTP {answer['status']}: {answer['error']}"
    if "streamed_text" in answer:
        return f"streamed {answer['streamed_text']!r}, log-probs {answer['token_logprobs']}, usage {answer['usage']}"
    parts = []
    for choice in answer["choices"]:
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        lp = choice.get("logprobs") or {}
        scores = lp.get("token_logprobs") or [c["logprob"] for c in lp.get("content") or []]
        shown = f", log-probs {[None if s is None else round(s, 3) for s in scores[:6]]}" if scores else ""
        parts.append(f"{text!r} ({choice['finish_reason']}{shown})")
    return "; ".join(parts) + f"; usage {answer['usage']['completion_tokens']} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="-")
    parser.add_argument("--out", type=Path, default=Path("outputs/client"))
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0)
    answers = {}
    for field, (route, kwargs) in requests_by_field().items():
        answers[field] = send(client, route, kwargs)
        print(f"{field}: {summary(answers[field])}")
        if field.startswith("seed") and "choices" in answers[field]:
            again = send(client, route, kwargs)
            same = [c.get("text") for c in again["choices"]] == [c.get("text") for c in answers[field]["choices"]]
            print(f"  sent again: {summary(again)} ({'the same text' if same else 'ANOTHER TEXT'})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client.json").write_text(json.dumps(answers, indent=1, default=str))


if __name__ == "__main__":
    main()
