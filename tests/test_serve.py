"""The Serve endpoint on the test session's Ray cluster, driven as users drive it: the official ``openai``
client and raw HTTP. Greedy output must equal the target's own; bad requests get 4xx JSON naming the field;
the draft swaps to each version the run's weight store publishes while requests keep succeeding."""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
import yaml

from distillspec.config import load_config
from distillspec.models.loading import encode_prompts, load_pair

from .conftest import free_port, greedy_text

RUN = "serve-test"
PROMPTS = ["12+7=", "3*4=", "100-1=", "9+9+9=", "50+50=", "2*8="]


@pytest.fixture(scope="module")
def endpoint(ray_cluster, tiny_garden, tmp_path_factory):
    from ray import serve

    from cluster.serve import bind

    port = free_port()
    common = [
        f"target={tiny_garden.target}",
        f"draft={tiny_garden.draft}",
        f"ray.run_name={RUN}",
        "serve.limits.max_prompt_tokens=64",
        "serve.limits.max_tokens=48",
        "serve.batching.max_batch_size=4",
        "serve.replica.cpus=0.25",
        "serve.follow.sync_every_s=0.2",
        "serve.record_prompts=true",
        "serve.record_samples=4",  # every test's requests at T = 0 or 1 keep the target's top 4: the client sees none
        "serve.gamma=3",
        "serve.limits.max_body_bytes=65536",
        "serve.limits.max_prompts=16",
        "serve.limits.max_queued_prompts=40",
    ]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(bind(load_config(None, common)), name="sd", route_prefix="/")
    serve.run(bind(load_config(None, [*common, "serve.api_key=sesame"])), name="keyed", route_prefix="/keyed")
    plain = tmp_path_factory.mktemp("no-chat-template")
    for role in ("target", "draft"):  # the same pair, its tokenizer without a chat template
        shutil.copytree(getattr(tiny_garden, role), plain / role)
        (plain / role / "chat_template.jinja").unlink(missing_ok=True)
        config = plain / role / "tokenizer_config.json"
        config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    no_chat = [*common, f"target={plain / 'target'}", f"draft={plain / 'draft'}", "serve.follow.sync_every_s=0"]
    serve.run(bind(load_config(None, no_chat)), name="plain", route_prefix="/plain")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(endpoint):
    from openai import OpenAI

    return OpenAI(base_url=f"{endpoint}/v1", api_key="unused", max_retries=0)


def target_greedy(tiny_garden, prompt: str, n: int) -> str:
    target, _, tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    return greedy_text(target, tokenizer, prompt, n)


def test_openai_client_gets_the_targets_greedy_text(client, tiny_garden):
    for prompt in PROMPTS[:3]:
        r = client.completions.create(model="distillspec", prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == target_greedy(tiny_garden, prompt, 20)
        sd = r.model_extra["distillspec"]
        assert sd["gamma"] == 3 and sd["drafted"] > 0 and 1.0 <= sd["tau"] <= 4.0
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 2
    models = client.models.list()
    assert [m.id for m in models.data] == ["distillspec"]


def test_streaming_matches_the_whole_response(client):
    for prompt in PROMPTS[3:5]:
        whole = client.completions.create(model="distillspec", prompt=prompt, max_tokens=24, temperature=0)
        chunks = list(
            client.completions.create(
                model="distillspec", prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body={"gamma": 2}
            )
        )
        assert len(chunks) >= 2
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert chunks[-1].model_extra["distillspec"]["gamma"] == 2


def test_chat_completions_through_the_models_chat_template(client, tiny_garden):
    question = "Mia has 3 pens. How many?"
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
    prompt = f"Question: {question}\nAnswer:"  # the garden's template: its own prompt format
    expected = target_greedy(tiny_garden, prompt, 16)
    whole = client.chat.completions.create(model="distillspec", messages=messages, max_tokens=16, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens >= 1 and whole.model_extra["distillspec"]["drafted"] > 0
    chunks = list(
        client.chat.completions.create(
            model="distillspec", messages=messages, max_completion_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_every_route_answers_errors_in_openais_shape(endpoint):
    chat = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4}
    r = requests.post(f"{endpoint}/plain/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "no chat template" in r.json()["error"]["message"]
    ok = requests.post(f"{endpoint}/plain/v1/completions", json={"prompt": "1+1=", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text
    for method, path, status in [
        ("get", "/v1/nothing", 404),
        ("post", "/v2/completions", 404),
        ("get", "/v1/completions", 405),
        ("get", "/v1/chat/completions", 405),
    ]:
        r = getattr(requests, method)(f"{endpoint}{path}", timeout=30)
        assert r.status_code == status, (path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and path in error["message"]
    bad = requests.post(f"{endpoint}/v1/chat/completions", json={"messages": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    role = requests.post(
        f"{endpoint}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}, timeout=30
    )
    assert role.status_code == 400 and role.json()["error"]["param"] == "messages"


def test_sampling_lossy_and_no_speculation_fields(client):
    lossy = dict(
        prompt=PROMPTS[0], max_tokens=16, temperature=1.0, seed=3, extra_body={"lenience": "lin", "epsilon": 0.5}
    )
    r, again = (client.completions.create(model="distillspec", **lossy) for _ in range(2))
    assert r.choices[0].text == again.choices[0].text  # a seed fixes the sample
    off = client.completions.create(
        model="distillspec", prompt=PROMPTS[1], max_tokens=8, temperature=0, extra_body={"speculative": False}
    )
    assert off.model_extra["distillspec"]["drafted"] == 0


def test_sampling_controls_through_the_openai_client(client, tiny_garden):
    """OpenAI's sampling fields and vLLM's extensions are honoured: a bias forces a token, a stop token id ends the
    completion at it, truncation and penalties decode (seeded: the same text twice)."""
    tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))[2]
    seven = tokenizer.encode("7", add_special_tokens=False)[-1]
    forced = client.completions.create(
        model="distillspec", prompt=PROMPTS[0], max_tokens=5, temperature=0, logit_bias={str(seven): 100}
    )
    assert forced.choices[0].text == tokenizer.decode([seven] * 5) and forced.usage.completion_tokens == 5
    stopped = client.completions.create(
        model="distillspec",
        prompt=PROMPTS[0],
        max_tokens=5,
        temperature=0,
        logit_bias={str(seven): 100},
        extra_body={"stop_token_ids": [seven]},
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    sampled = dict(
        model="distillspec",
        messages=[{"role": "user", "content": "Mia has 3 pens. How many?"}],
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=5,
        extra_body={"top_k": 8, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    first, again = (client.chat.completions.create(**sampled) for _ in range(2))
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.model_extra["distillspec"]["drafted"] > 0


def test_n_samples_seeded_streamed_and_whole(client):
    """``n`` samples of a prompt: distinct, reproduced by a seed, the same streamed (choices by index) as whole."""
    kw = dict(model="distillspec", prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=9, n=3)
    whole, again = (client.completions.create(**kw) for _ in range(2))
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) > 1 and whole.usage.completion_tokens >= 3
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    two = client.completions.create(**(kw | {"prompt": PROMPTS[:2], "n": 2}))
    assert [c.index for c in two.choices] == [0, 1, 2, 3]


def test_logprobs_and_echo_score_under_the_target(client, tiny_garden):
    """Completions' ``logprobs`` (greedy: each token the likeliest), ``echo`` with ``max_tokens=0`` (a text scored,
    as evaluation harnesses ask: the target's own log-probabilities), chat's ``logprobs``/``top_logprobs``."""
    r = client.completions.create(model="distillspec", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == r.usage.completion_tokens
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and value == pytest.approx(max(top.values()), abs=1e-5) and value <= 0
    text = "Question: Tom has 4 apples. How many?\nAnswer: 4"
    scored = client.completions.create(model="distillspec", prompt=text, max_tokens=0, echo=True, logprobs=0)
    choice = scored.choices[0]
    assert choice.text == text and choice.logprobs.token_logprobs[0] is None
    target, _, tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    ids = encode_prompts(tokenizer, [text])[0]  # as the endpoint encodes a prompt (with its BOS)
    with torch.no_grad():
        expected = torch.log_softmax(target(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).sum()
    assert len(choice.logprobs.tokens) == ids.shape[1]
    assert sum(choice.logprobs.token_logprobs[1:]) == pytest.approx(float(expected), abs=1e-3)
    chat = client.chat.completions.create(
        model="distillspec",
        messages=[{"role": "user", "content": "Mia has 3 pens. How many?"}],
        max_tokens=6,
        temperature=1.0,
        seed=1,  # drawn tokens that decode one by one (a token that is part of a character shows as U+FFFD)
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_streamed_logprobs_are_the_whole_responses_chunk_by_chunk(client):
    """A streamed request with log-probs gets each chunk's tokens scored (completions: offsets continuing from the
    chunks before; chat: ``logprobs.content``), the same as the whole response's, seeded at T = 1 with a stop."""
    kw = dict(model="distillspec", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=3, logprobs=2, stop=["?"])
    whole = client.completions.create(**kw).choices[0]
    text, tokens, values, offsets = "", [], [], []
    for chunk in client.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6) and len(tokens) > 1
    chat = dict(model="distillspec", messages=[{"role": "user", "content": "Mia has 3 pens."}], max_tokens=8,
                temperature=0.0, logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [c for chunk in client.chat.completions.create(**chat, stream=True) for choice in chunk.choices
                for c in (choice.logprobs.content if choice.logprobs else [])]  # fmt: skip
    assert [c.token for c in streamed] == [c.token for c in whole] and len(whole) > 1
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in whole], abs=1e-6)


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ("completions", {"prompt": "1+1=", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "1+1=", "echo": True, "logprobs": 1, "stream": True}, "echo"),
        ("completions", {"prompt": "1+1=", "logprobs": 21}, "logprobs"),
    ],
)
def test_scoring_requests_refused_naming_the_field(endpoint, route, body, field):
    r = requests.post(f"{endpoint}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_stopping_endpoint_ends_its_streams_with_an_error_event(endpoint, tiny_garden):
    """When the job that serves it stops (its :class:`~cluster.stopping.StopSignal` set), each replica ends the streams
    in flight with an error event and ``[DONE]``, and answers new requests 503."""
    from ray import serve

    from cluster.serve import bind
    from cluster.stopping import stop_signal

    cfg = load_config(None, [f"target={tiny_garden.target}", f"draft={tiny_garden.draft}", "serve.replica.cpus=0.25"])
    serve.run(bind(cfg), name="stoppable", route_prefix="/stoppable")
    eos = load_pair(str(tiny_garden.target), str(tiny_garden.draft))[2].eos_token_id
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "stream": True, "logit_bias": {str(eos): -100}}
    try:
        with requests.post(f"{endpoint}/stoppable/v1/completions", json=body, stream=True, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith(b"data: {")  # the stream is flowing
            stop_signal("stoppable").set.remote()
            rest = [line.decode() for line in lines if line]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"] and rest[-1] == "data: [DONE]"
        late = requests.post(f"{endpoint}/stoppable/v1/completions", json={"prompt": "1+1="}, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"
    finally:
        serve.delete("stoppable")


def test_a_seed_gives_one_text_under_concurrent_load(client):
    """The same seeded request sent 3 times among 5 other requests at once (batched together, gamma chosen live)
    returns one text, the text it gets alone at gamma 1 and without speculation."""
    from concurrent.futures import ThreadPoolExecutor

    seeded = dict(model="distillspec", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, seed=42)
    others = [dict(model="distillspec", prompt=p, max_tokens=16, temperature=1.0) for p in PROMPTS[:5]]
    with ThreadPoolExecutor(8) as pool:
        done = list(
            pool.map(lambda kw: client.completions.create(**kw), [seeded, *others[:2], seeded, *others[2:], seeded])
        )
    texts = {done[i].choices[0].text for i in (0, 3, 7)}
    alone = client.completions.create(**seeded, extra_body={"gamma": 1}).choices[0].text
    plain = client.completions.create(**seeded, extra_body={"speculative": False}).choices[0].text
    assert texts == {alone} == {plain}


@pytest.mark.parametrize(
    "body, field",
    [
        ('{"prompt": "1+1=", "max_tokens": ', None),  # malformed JSON
        ({"prompt": ""}, "prompt"),
        ({"prompt": "1+1=" * 60}, "prompt"),  # longer than serve.limits.max_prompt_tokens
        ({"prompt": "1+1=", "gamma": 0}, "gamma"),
        ({"prompt": "1+1=", "gamma": "some"}, "gamma"),
        ({"prompt": "1+1=", "epsilon": 0}, "epsilon"),
        ({"prompt": "1+1=", "epsilon": 1.5}, "epsilon"),
        ({"prompt": "1+1=", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "1+1=", "max_tokens": 10_000}, "max_tokens"),
        ({"prompt": "1+1=", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "1+1=", "temperature": "hot"}, "temperature"),
        ({"prompt": "1+1=", "lenience": "cubic"}, "lenience"),
        ({"prompt": "1+1=", "stream": "yes"}, "stream"),
        ({"prompt": 42}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "1+1=", "seed": 2**64}, "seed"),  # more than torch.manual_seed takes
        ({"prompt": "1+1=", "top_p": 0}, "top_p"),
        ({"prompt": "1+1=", "top_k": -3}, "top_k"),
        ({"prompt": "1+1=", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "1+1=", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"prompt": "1+1=", "logit_bias": {"five": 1}}, "logit_bias"),
        ({"prompt": "1+1=", "stop_token_ids": [-1]}, "stop_token_ids"),
        ('{"prompt": "1+\\ud800="}', "prompt"),  # a lone surrogate: no tokenizer encodes it
    ],
)
def test_bad_requests_get_a_4xx_naming_the_field(endpoint, body, field):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(f"{endpoint}/v1/completions", data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"]


def test_a_bad_request_among_seven_good_ones_fails_alone(endpoint):
    """Eight concurrent requests batched together, one of them with a prompt no tokenizer encodes: it gets a 400,
    the seven others their completions."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 6, "temperature": 0} for i in range(8)]
    bodies[3]["prompt"] = "1+\ud800="

    def post(body: dict) -> requests.Response:
        data = json.dumps(body)  # ensure_ascii: the surrogate travels as \ud800, as a client's JSON would carry it
        return requests.post(f"{endpoint}/v1/completions", data=data, headers={"Content-Type": "application/json"})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, bodies))
    assert answers[3].status_code == 400 and answers[3].json()["error"]["param"] == "prompt", answers[3].text
    assert [r.status_code for i, r in enumerate(answers) if i != 3] == [200] * 7


def test_api_key(endpoint):
    """With a key, every route answers 401 without it (or with another), before the body is read or validated: a
    malformed body gets 401, not a schema error; the key opens them all."""
    url = f"{endpoint}/keyed/v1/completions"
    body = {"prompt": "1+1=", "max_tokens": 4}
    routes = [("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("get", "/v1/models")]
    routes += [("get", "/v1/stats"), ("get", "/docs"), ("get", "/openapi.json")]
    for headers in ({}, {"Authorization": "Bearer sesam"}, {"Authorization": "sesame"}):
        for method, route in routes:
            r = requests.request(method, f"{endpoint}/keyed{route}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (route, r.text)
        bad = requests.post(url, data=b"{not json", headers=headers, timeout=30)
        assert bad.status_code == 401, bad.text
    key = {"Authorization": "Bearer sesame"}
    ok = requests.post(url, json=body, headers=key, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    for route in ("/v1/models", "/v1/stats", "/openapi.json"):
        assert requests.get(f"{endpoint}/keyed{route}", headers=key, timeout=30).status_code == 200, route
    model = requests.get(f"{endpoint}/keyed/v1/models", headers=key, timeout=30).json()["data"][0]
    assert "/" not in model["target"] and "/" not in model["draft"]  # names, not the server's file paths


def test_concurrent_load_and_a_live_draft_swap(endpoint, client, tiny_garden):
    """Requests from 8 threads (half with gamma chosen live) while the learner's weight store publishes a new
    version: none fails, greedy text stays the target's (SD is lossless whatever the draft and gamma), and responses
    turn to the new version."""
    import ray

    from actors.common import NAMESPACE, weights_name
    from actors.weights import WeightStore, publish

    expected = {p: target_greedy(tiny_garden, p, 16) for p in PROMPTS}
    store = WeightStore.options(name=weights_name(RUN), namespace=NAMESPACE).remote(RUN)
    _, draft, _ = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    results, errors, stop = [], [], threading.Event()

    def worker(i: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                extra = {"gamma": "auto"} if i % 2 else {}
                r = client.completions.create(
                    model="distillspec", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra
                )
                results.append((prompt, r.choices[0].text, r.model_extra["distillspec"]["draft_version"]))
            except Exception as exc:
                errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    publish(store, draft, 7, serving=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(v == 7 for *_, v in results):
        time.sleep(0.2)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    versions = [v for *_, v in results]
    assert -1 in versions and 7 in versions and versions.index(7) > 0
    assert all(text == expected[prompt] for prompt, text, _ in results)
    stats = requests.get(f"{endpoint}/v1/stats", timeout=10).json()
    assert stats["draft_version"] == 7 and stats["swaps"][-1]["to"] == 7 and stats["cpu_s"] > 0
    assert stats["dtype"] == "float32"  # the garden pair: auto keeps float32 for a target this small
    assert sum(stats["auto_gamma"]["chosen"].values()) > 0 and stats["auto_gamma"]["measured_tokens_per_s"] > 0
    batches = {int(b): n for b, n in stats["batch_sizes"].items()}  # every prompt decoded in one batch or another
    assert sum(b * n for b, n in batches.items()) >= len(results) and max(batches) > 1  # 8 clients: some batched
    assert stats["prompt_cache"]["tokens_looked_up"] > 0  # serve.prompt_cache_mb: on by default (prompts this short
    # hold no whole block of 16 tokens)
    ray.kill(store)


def test_served_prompts_and_samples_reach_the_prompt_log(client):
    import ray

    from actors.common import NAMESPACE, prompts_name
    from actors.prompts import PromptLog

    log = PromptLog.options(name=prompts_name(RUN), namespace=NAMESPACE).remote(RUN, 16)
    ray.get(log.stats.remote())
    done = client.completions.create(model="distillspec", prompt=["7+7=", "8+8="], max_tokens=4, temperature=0)
    assert all(choice.logprobs is None for choice in done.choices)  # recorded scores are not the client's
    stream = client.completions.create(model="distillspec", prompt="9+9=", max_tokens=4, temperature=1, stream=True)
    chunks = list(stream)  # a sample at T = 1 (its text may be empty: an end of text drawn first)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    client.completions.create(model="distillspec", prompt="6+6=", max_tokens=4, temperature=0.5)  # not a sample
    deadline = time.monotonic() + 10
    while ray.get(log.stats.remote())["samples_received"] < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(ray.get(log.sample.remote(8))) == ["6+6=", "7+7=", "8+8=", "9+9="]
    stats = ray.get(log.stats.remote())
    assert stats["samples_received"] == 3, stats
    greedy, sampled = ray.get(log.take_samples.remote(2, 0.0)), ray.get(log.take_samples.remote(1, 1.0))
    assert len(greedy) == 2 and len(sampled) == 1 and not ray.get(log.take_samples.remote(1, 0.5))
    assert all(s.top.shape == s.top_ids.shape == (len(s.tokens), 4) for s in greedy + sampled)
    assert sum(len(s.tokens) for s in greedy) == done.usage.completion_tokens
    ray.kill(log)


def test_serve_finds_a_runs_draft_and_its_target(tmp_path, tiny_garden):
    from distillspec import DistillSpecError
    from distillspec.models.pretrained import resolve_models

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"target": str(tiny_garden.target), "dataset": "arith"}))
    with pytest.raises(DistillSpecError, match="no distilled draft yet"):
        resolve_models(load_config(None, [f"serve.run={run}"]))
    shutil.copytree(tiny_garden.draft, run / "draft")
    for overrides in ([f"serve.run={run}"], [f"draft={run / 'draft'}"]):
        cfg = resolve_models(load_config(None, overrides))
        assert (cfg.target, cfg.draft) == (str(tiny_garden.target), str((run / "draft").resolve()))
    with pytest.raises(DistillSpecError, match="not an output folder of jobs/distill.py"):
        resolve_models(load_config(None, [f"serve.run={tmp_path}"]))
    with pytest.raises(DistillSpecError, match="give its --target too"):
        resolve_models(load_config(None, [f"draft={tiny_garden.draft}"]))


def test_serve_cuts_the_draft_vocabulary_as_the_job_does(tiny_garden):
    """A replica that follows a run with a draft vocabulary must hold the same cut draft, or it cannot take the run's
    versions."""
    from distillspec.models.draft_vocab import CONFIG_KEY
    from distillspec.models.pretrained import prepare_pair, resolve_models
    from distillspec.tasks.data import load_task

    overrides = [f"target={tiny_garden.target}", f"draft={tiny_garden.draft}", "dataset=arith", "draft_vocab=64"]
    served = resolve_models(load_config(None, overrides))
    job = prepare_pair(load_config(None, overrides), load_task("arith"))[0]
    assert served.draft == job.draft != str(tiny_garden.draft)
    assert json.loads((Path(served.draft) / "config.json").read_text())[CONFIG_KEY] == 64


def test_the_key_can_come_from_the_environment(monkeypatch):
    from cluster.serve import API_KEY_ENV, with_api_key

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert with_api_key(load_config(None, [])).serve.api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert with_api_key(load_config(None, [])).serve.api_key == "from-env"
    assert with_api_key(load_config(None, ["serve.api_key=given"])).serve.api_key == "given"  # the config wins


def test_limits_answer_413_and_429_in_openais_shape(endpoint):
    """A body over serve.limits.max_body_bytes (with a Content-Length or chunked), more prompts than
    serve.limits.max_prompts, and prompts past what the replica holds (serve.limits.max_queued_prompts): each gets its
    4xx, the others their answers."""
    from concurrent.futures import ThreadPoolExecutor

    url = f"{endpoint}/v1/completions"
    big = requests.post(url, json={"prompt": "1+1=" * 20_000}, timeout=30)
    assert big.status_code == 413 and "max_body_bytes" in big.json()["error"]["message"]
    chunks = iter([b'{"prompt": "', b"1" * 70_000, b'"}'])
    chunked = requests.post(url, data=chunks, headers={"Content-Type": "application/json"}, timeout=30)
    assert chunked.status_code == 413, chunked.text
    many = requests.post(url, json={"prompt": ["1+1="] * 10_000}, timeout=30)  # 70 KB: the body limit answers
    assert many.status_code == 413
    many = requests.post(url, json={"prompt": ["1+1="] * 1_000}, timeout=30)
    assert many.status_code == 413 and many.json()["error"]["param"] == "prompt"

    body = {"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(16)], "max_tokens": 48, "temperature": 1.0}
    with ThreadPoolExecutor(3) as pool:  # 3 x 16 prompts at once; the replica holds at most 40
        answers = list(pool.map(lambda _: requests.post(url, json=body, timeout=120), range(3)))
    assert sorted(r.status_code for r in answers) == [200, 200, 429], [r.text[:200] for r in answers]
    refused = next(r for r in answers if r.status_code == 429)
    assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["type"] == "rate_limit_error"
    assert requests.post(url, json=body, timeout=120).status_code == 200  # the holds were let go


def test_an_8_mb_request_while_8_streams_flow(endpoint, client):
    """An 8 MB body is refused (413) without stalling the replica: 8 streams running meanwhile all finish."""
    from concurrent.futures import ThreadPoolExecutor

    def stream(i: int) -> str:
        chunks = client.completions.create(
            model="distillspec", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=48, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, i) for i in range(8)]
        huge = requests.post(f"{endpoint}/v1/completions", json={"prompt": "x" * (8 << 20)}, timeout=60)
        texts = [s.result(timeout=120) for s in streams]
    assert huge.status_code == 413
    assert all(texts)


def test_a_replica_killed_mid_stream(endpoint, tiny_garden):
    """A replica killed (-9) while it streams: the client's stream ends (with no ``[DONE]``: the completion is
    incomplete) instead of hanging, and Serve replaces the replica, which answers the next request."""
    import psutil
    from ray import serve

    from cluster.serve import bind

    overrides = [
        f"target={tiny_garden.target}",
        f"draft={tiny_garden.draft}",
        "ray.run_name=killed",
        "serve.limits.max_tokens=900",
        "serve.replica.cpus=0.25",
        "serve.follow.sync_every_s=0",
    ]
    serve.run(bind(load_config(None, overrides)), name="killed", route_prefix="/killed")
    url = f"{endpoint}/killed/v1/completions"
    # The test garden's target never emits EOS within 900 greedy tokens: the stream is still running when killed.
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True}
    events, ended = [], None
    try:
        replica = next(
            p for p in psutil.process_iter(["cmdline"]) if "ServeReplica:killed:" in " ".join(p.info["cmdline"] or ())
        )
        with requests.post(url, json=body, stream=True, timeout=60) as r:
            assert r.status_code == 200
            try:
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        events.append(line[6:].decode())
                        if len(events) == 5:
                            replica.kill()  # kill -9, once
                ended = "the stream closed"
            except requests.exceptions.RequestException as exc:  # the connection broke off
                ended = type(exc).__name__
        assert len(events) >= 5 and "[DONE]" not in events, events[-3:]
        deadline = time.monotonic() + 120
        while True:  # the replacement replica loads the pair, then serves
            try:
                again = requests.post(url, json={**body, "stream": False, "max_tokens": 8}, timeout=60)
                if again.status_code == 200:
                    break
            except requests.exceptions.RequestException:
                pass
            assert time.monotonic() < deadline, "no replica answered after the kill"
            time.sleep(1)
        print(f"killed mid-stream after {len(events)} events: {ended}; a new replica answered")
    finally:
        serve.delete("killed")
