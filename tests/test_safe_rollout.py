"""The safe draft rollout under load, with faults injected: a corrupted transfer, a worse draft and a draft that
collapses on live traffic, while 400 greedy requests at concurrency 8 go through a real Serve endpoint.

:func:`check_safe_rollout` drives an endpoint that follows a run's weight store; this module runs it on the
transformers backend, ``tests/test_vllm.py`` on the vLLM one.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import ray
import requests
import torch

from distillspec.config import JobConfig, load_config

from .conftest import free_port, greedy_text
from .test_serve import PROMPTS

RUN = "gate-test"
WINDOW = 16  #: serve.follow.rollback_window of the endpoints under test
CONCURRENCY = 8
#: requests per phase: (1) the canary promotes version 1, (2) a corrupted transfer of version 2, (3) the canary
#: refuses a worse version 3, (4) version 4 passes the gate (injected) and collapses live: 400 in all
PHASES = (40, 80, 40, 240)
GATE_SETTINGS = [
    f"serve.follow.rollback_window={WINDOW}",
    "serve.follow.rollback_margin=0.15",
    "serve.follow.sync_every_s=0.2",
]


def random_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with random weights: a draft the target almost never agrees with."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return other


def wait_for(what: str, check, timeout_s: float = 60.0, state=None) -> None:
    """Poll ``check`` until it holds; past ``timeout_s``, fail with ``state()`` (what was seen) in the message."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (f": {state()}" if state else "")
        time.sleep(0.2)


class Load:
    """Greedy requests of ``n`` tokens over ``prompts`` at concurrency 8, in phases; keeps every answer (its text,
    the draft versions it started and ended on, the replica) and every failure."""

    def __init__(self, url: str, prompts: list[str], n: int) -> None:
        self.url, self.prompts, self.n = url, prompts, n
        self.answers: list[dict] = []
        self.errors: list[str] = []

    def one(self, i: int) -> None:
        prompt = self.prompts[i % len(self.prompts)]
        try:
            r = requests.post(
                f"{self.url}/v1/completions",
                json={"prompt": prompt, "max_tokens": self.n, "temperature": 0},
                timeout=120,
            )
            if r.status_code != 200:
                self.errors.append(r.text)
                return
            body = r.json()
            sd = body["distillspec"]
            self.answers.append(
                {
                    "prompt": prompt,
                    "text": body["choices"][0]["text"],
                    "version": sd["draft_version"],
                    "end": sd.get("draft_version_end", sd["draft_version"]),
                    "replica": sd["replica"],
                }
            )
        except Exception as exc:  # every failure is counted and shown
            self.errors.append(repr(exc))

    def phase(self, count: int, event=None) -> None:
        """``count`` requests, 8 at a time; ``event()`` runs once the load is on."""
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            futures = [pool.submit(self.one, i) for i in range(count)]
            time.sleep(0.5)
            if event is not None:
                event()
            for f in futures:
                f.result()


def check_safe_rollout(
    url: str, cfg: JobConfig, draft: torch.nn.Module, expected: dict[str, str], n: int, slack: int = CONCURRENCY
) -> dict:
    """Drive the endpoint at ``url`` (following run ``cfg.ray.run_name``, with ``serve.follow.rollback_window=WINDOW``)
    through the four phases of ``PHASES`` at concurrency 8, every request greedy with ``n`` tokens, and check the
    rollback's bound: at most ``WINDOW + slack`` requests start on the collapsing version. Returns the figures
    (answers per version, requests that started on or touched the collapsing version)."""
    from actors.common import NAMESPACE, weights_name
    from actors.evaluator import EvalActor, EvalSettings
    from actors.weights import WeightStore, publish
    from distillspec.integrity import checksums
    from distillspec.versions import state_arrays

    run = cfg.ray.run_name
    store = WeightStore.options(name=weights_name(run), namespace=NAMESPACE).remote(run)
    evaluator = EvalActor.options(num_cpus=0.25).remote(EvalSettings.of(cfg), list(expected))
    load, canary = Load(url, list(expected), n), []
    answers, errors, phase = load.answers, load.errors, load.phase

    def stats() -> dict:
        return requests.get(f"{url}/v1/stats", timeout=30).json()

    try:
        # (1) The learner publishes version 1 (the draft as it is); the evaluator's canary passes it: it serves.
        def promote_1() -> None:
            publish(store, draft, 1)
            canary.append(ray.get(evaluator.evaluate.remote()))
            assert canary[-1]["served"], canary[-1]
            wait_for("the replica to take version 1", lambda: stats()["draft_version"] == 1)

        phase(PHASES[0], promote_1)

        # (2) Version 2 reaches the store as serving, one tensor scrambled in transit (the checksums are those of the
        # intact weights): the replica refuses it and keeps serving version 1.
        def corrupt_2() -> None:
            arrays = state_arrays(draft)
            name = next(k for k, a in arrays.items() if a.size > 1)
            rng = np.random.default_rng(0)
            scrambled = {**arrays, name: rng.permutation(arrays[name].ravel()).reshape(arrays[name].shape)}
            refs, sums = [ray.put(scrambled)], checksums(arrays)
            ray.get(store.publish.remote(2, refs, None, sums, serving=True))
            wait_for("the replica to refuse version 2", lambda: any(r["version"] == 2 for r in stats()["refused"]))

        phase(PHASES[1], corrupt_2)

        # (3) A worse draft (random weights) published as version 3: the canary refuses it; serving stays at 1.
        worse = random_copy(draft, seed=3)

        def worse_3() -> None:
            publish(store, worse, 3)
            canary.append(ray.get(evaluator.evaluate.remote()))
            assert not canary[-1]["served"], [c["canary"] for c in canary]

        phase(PHASES[2], worse_3)
        gate = ray.get(store.status.remote())._asdict()
        assert gate["latest"] == 3 and gate["serving"] == 1, gate

        # (4) Version 4 passes the gate (injected: published straight to serving) and collapses on live traffic: the
        # replica rolls it back to version 1 by itself, and the store's serving version returns to 1.
        collapse = random_copy(draft, seed=4)
        swapped_at: list[int] = []

        def collapse_4() -> None:
            publish(store, collapse, 4, serving=True)
            wait_for("the replica to take version 4", lambda: any(s["to"] == 4 for s in stats()["swaps"]))
            swapped_at.append(len(answers))
            seen = lambda: {k: stats().get(k) for k in ("draft_version", "swaps", "live_alpha", "auto_gamma")}
            wait_for("the rollback of version 4", lambda: stats()["rollbacks"], 120, seen)

        phase(PHASES[3], collapse_4)
        final, gate = stats(), ray.get(store.status.remote())._asdict()
    finally:
        ray.kill(evaluator)
        ray.kill(store)

    assert not errors, errors[:3]
    assert len(answers) == sum(PHASES) == 400
    wrong = [a for a in answers if a["text"] != expected[a["prompt"]]]
    assert not wrong, wrong[:3]  # greedy output is the target's throughout, whatever the draft
    by_version = Counter(a["version"] for a in answers)
    assert not {2, 3} & {v for a in answers for v in (a["version"], a["end"])}, by_version  # never served
    [rollback] = final["rollbacks"]
    assert rollback["from"] == 4 and rollback["to"] == 1 and rollback["reason"].startswith("rollback: live alpha")
    assert final["draft_version"] == 1 and [r["version"] for r in final["refused"]] == [2]
    assert final["refused"][0]["reason"].startswith("integrity:")
    assert gate["serving"] == 1 and gate["rolled_back"] == [4], gate
    reasons = {r["version"]: r["reason"].split(":")[0] for r in gate["refused"]}
    assert reasons == {2: "integrity", 3: "canary", 4: "rollback"}, gate["refused"]
    # The bound: version 4 is judged on its first WINDOW completions; the requests in flight then (at most
    # CONCURRENCY - 1) and those that start before the replica acts on the verdict start on it too (on vLLM, requests
    # wait while the engine reloads version 1). On vLLM, the requests in flight when version 4 came in (at most
    # CONCURRENCY) end on it as well (it swaps in place).
    started_4 = by_version[4]
    touched_4 = sum(1 for a in answers if 4 in (a["version"], a["end"]))
    assert WINDOW <= started_4 <= WINDOW + slack, by_version
    assert started_4 <= touched_4 <= started_4 + CONCURRENCY, (started_4, touched_4)
    last_4 = max(i for i, a in enumerate(answers) if 4 in (a["version"], a["end"]))
    assert all(a["version"] == 1 for a in answers[last_4 + 1 :]) and len(answers) - last_4 > 100
    # Decoded as the replicas decode: their engine, and the temperature of requests that name none
    assert {(c["canary"]["backend"], c["canary"]["temperature"]) for c in canary} == {
        (cfg.serve.backend, cfg.serve.temperature)
    }
    return {
        "canary_alpha": {1: canary[0]["canary"]["alpha"], 3: canary[1]["canary"]["alpha"]},
        "by_version": dict(by_version),
        "started_on_4": started_4,
        "touched_by_4": touched_4,
        "swapped_at": swapped_at[0],
        "live_alpha": final["live_alpha"],
        "rollback": rollback,
    }


@pytest.fixture(scope="module")
def endpoint(ray_cluster, tiny_garden):
    from ray import serve

    from cluster.serve import bind

    port = free_port()
    overrides = [
        f"target={tiny_garden.target}",
        f"draft={tiny_garden.draft}",
        f"ray.run_name={RUN}",
        "serve.batching.max_batch_size=4",
        "serve.replica.cpus=0.25",
        "serve.gamma=3",
        *GATE_SETTINGS,
    ]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(bind(load_config(None, overrides)), name="gate", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_safe_rollout_under_load_with_faults_injected(endpoint, tiny_garden):
    from distillspec.models.loading import load_pair

    target, draft, tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    expected = {p: greedy_text(target, tokenizer, p, 16) for p in PROMPTS}
    cfg = load_config(
        None,
        [
            f"target={tiny_garden.target}",
            f"draft={tiny_garden.draft}",
            f"ray.run_name={RUN}",
            "eval.speedup_gamma=3",
            "eval.max_new_tokens=16",
        ],
    )
    figures = check_safe_rollout(endpoint, cfg, draft, expected, 16)
    print("safe rollout (transformers backend):", figures)


@pytest.fixture(scope="module")
def two_replicas(endpoint, tiny_garden):
    """A second application on the same Serve instance: two replicas following run ``gate-two``."""
    from ray import serve

    from cluster.serve import bind

    overrides = [
        f"target={tiny_garden.target}",
        f"draft={tiny_garden.draft}",
        "ray.run_name=gate-two",
        "serve.batching.max_batch_size=4",
        "serve.replica.cpus=0.25",
        "serve.gamma=3",
        "serve.autoscaling.min_replicas=2",
        "serve.autoscaling.max_replicas=2",
        *GATE_SETTINGS,
    ]
    serve.run(bind(load_config(None, overrides)), name="gate-two", route_prefix="/two")
    yield f"{endpoint}/two"
    serve.delete("gate-two")


def test_every_replica_leaves_a_version_one_of_them_rolled_back(two_replicas, tiny_garden):
    """With two replicas, each judges its own traffic; the first to see the collapse rolls the version back in the
    store, and the other leaves it at its next check if it has not judged it itself: the deployment returns."""
    from actors.common import NAMESPACE, weights_name
    from actors.weights import WeightStore, publish
    from distillspec.models.loading import load_pair

    target, draft, tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    expected = {p: greedy_text(target, tokenizer, p, 16) for p in PROMPTS}
    store = WeightStore.options(name=weights_name("gate-two"), namespace=NAMESPACE).remote("gate-two")
    load = Load(two_replicas, PROMPTS, 16)
    try:
        publish(store, draft, 1, serving=True)
        wait_for("both replicas to serve version 1", lambda: load.phase(16) or _serving(load.answers[-16:]) == {1})
        load.phase(96)  # each replica's window of version 1 fills
        before = len(load.answers)
        load.phase(200, lambda: publish(store, random_copy(draft, seed=4), 4, serving=True))
        gate = ray.get(store.status.remote())._asdict()
        during = load.answers[before:]
        # A rollback that comes only from the store (another replica's verdict): both replicas leave version 5.
        publish(store, draft, 5, serving=True)
        wait_for("both replicas to serve version 5", lambda: load.phase(16) or _serving(load.answers[-16:]) == {5})
        ray.get(store.roll_back.remote(5, "rollback: injected by the test"))
        left = time.monotonic()
        wait_for(
            "both replicas to leave version 5",
            lambda: load.phase(32) or _serving(load.answers[-32:]) == {1},
            30,
            lambda: Counter((a["replica"][-6:], a["version"], a["end"]) for a in load.answers[-32:]),
        )
        left = time.monotonic() - left
        followed = load.answers[-32:]
    finally:
        ray.kill(store)
    assert {a["replica"] for a in followed} == {a["replica"] for a in during} and _serving(followed) == {1}, Counter(
        (a["replica"], a["version"], a["end"]) for a in followed
    )
    assert not load.errors, load.errors[:3]
    assert all(a["text"] == expected[a["prompt"]] for a in load.answers)
    replicas = {a["replica"] for a in during}
    assert len(replicas) == 2 and gate["serving"] == 1 and gate["rolled_back"] == [4], gate
    assert {a["replica"] for a in during if a["version"] == 4} == replicas  # both took version 4 ...
    tail = during[-40:]
    assert {a["replica"] for a in tail} == replicas and _serving(tail) == {1}  # ... and both left it
    started_4 = sum(a["version"] == 4 for a in during)
    assert started_4 <= 2 * (WINDOW + CONCURRENCY), started_4
    print(
        f"two replicas: {started_4} requests started on the collapsing version, of {len(during)}; both left a version "
        f"rolled back in the store within {left:.1f} s"
    )


def _serving(answers: list[dict]) -> set[int]:
    return {v for a in answers for v in (a["version"], a["end"])}
