"""The sample buffer: a named actor between the rollout actors and the learner.

It pulls batches: :meth:`BufferActor.feed` asks a rollout actor for its next
:class:`~distillspec.training.batches.RolloutBatch` once it holds a slot for it and, when scoring actors score, chains
the answer into one of them (``score(sample())``: Ray hands the sampled batch from one actor to the other). The answer
of a call is owned by its caller, so the buffer owns each batch with the one copy its last maker wrote when it returned
it (serialised once, and it outlives a producer that dies); the learner reads that copy. Each maker also returns the
batch's :class:`~distillspec.training.batches.BatchHeader`, checked where the arrays are: the buffer reads that small
header, never the arrays. ``put`` takes a batch from any other producer, checks it and keeps its own copy of it.
``take`` waits while the buffer is empty. Its bookkeeping (capacity, staleness, ledger) is
:class:`distillspec.training.batches.SampleBuffer`.
"""

from __future__ import annotations

import contextlib
import threading
import time

import ray

from actors.common import log, stopped
from actors.dashboard import count, gauge
from actors.worker import setup_worker
from distillspec.training.batches import BatchHeader, RolloutBatch, SampleBuffer


@ray.remote(num_cpus=0, max_concurrency=16)
class BufferActor:
    """The sample buffer of one run (see the module docstring). Staleness is measured against the weight store's
    current version when a batch arrives and against the learner's version at ``take``."""

    def __init__(
        self,
        *,
        capacity: int,
        max_policy_lag: int,
        max_batch_tokens: int,
        vocab_size: int,
        run: str,
        store: ray.actor.ActorHandle,
        examples: list[ray.ObjectRef] | None = None,
    ) -> None:
        """``examples``: ``[a reference to the training examples]`` the rollout actors sample prompts from (a
        restarted rollout actor reads them here again)."""
        setup_worker()
        self.examples_ref = examples or []
        self.buffer = SampleBuffer(capacity, max_policy_lag)
        self.max_batch_tokens, self.vocab_size, self.run, self.store = max_batch_tokens, vocab_size, run, store
        self.changed = threading.Condition()
        self.reserved: set[int] = set()  #: producers that were promised a slot
        self.closed = False

    def examples(self) -> list[ray.ObjectRef]:
        return self.examples_ref

    def _room(self, producer: int) -> int:
        return self.buffer.capacity - len(self.buffer) - len(self.reserved - {producer})

    def feed(
        self,
        producer: ray.actor.ActorHandle,
        rank: int,
        batches: int = 0,
        scorers: list[ray.actor.ActorHandle] | None = None,
    ) -> list[dict]:
        """Pull batches from the rollout actor ``producer`` (``producer.sample()``, each scored by one of ``scorers``
        in turn: ``score(sample())``) until the buffer closes, or ``batches`` of them (0 = no limit). A batch is asked
        for only once there is a slot for it, so what it samples is fresh. Returns the version, source and the
        buffer's answer of each batch; raises the producer's (or the scorer's) error. Ray restarts a rollout actor or
        a scorer that dies and retries the call it was serving."""
        sampled: list[dict] = []
        limits = (self.max_batch_tokens, self.vocab_size)
        while not batches or len(sampled) < batches:
            with self.changed:
                self.changed.wait_for(lambda: self.closed or self._room(rank) > 0)
                if self.closed:
                    break
                self.reserved.add(rank)
            header, ref = producer.sample.remote(*limits)
            made = [header, ref]
            if scorers:
                header, ref = scorers[(rank + len(sampled)) % len(scorers)].score.remote(ref, *limits)
                made += [header, ref]
            try:
                status, version, source = self._hold(header, ref, rank)
            except ray.exceptions.RayTaskError as exc:
                if not (self.closed and stopped(exc)):
                    raise
                for answer in made:  # read, so that Ray does not log them as errors nobody saw
                    with contextlib.suppress(ray.exceptions.RayError):
                        ray.get(answer)
                break  # the producer waited for the endpoint's traffic, and the buffer closed meanwhile
            finally:
                with self.changed:
                    self.reserved.discard(rank)
                    self.changed.notify_all()
            sampled.append({"version": version, "source": source, "status": status})
            if status == "closed":
                break
        return sampled

    def put(self, refs: list[ray.ObjectRef], producer: int = -1, timeout_s: float = 600.0) -> str:
        """Offer the batch ``refs[0]`` (a :class:`RolloutBatch`) from a producer the buffer does not call, waiting
        while the buffer is full: ``ok``, ``refused: why``, ``closed``, or ``full`` when no room came within
        ``timeout_s``. The buffer checks it and keeps its own copy (the producer owns ``refs[0]``)."""
        batch = ray.get(refs[0])
        if isinstance(batch, RolloutBatch):
            header = batch.header(max_tokens=self.max_batch_tokens, vocab_size=self.vocab_size)
            held = ray.put(batch) if header.problem is None else None
            return self._admit(header, held, producer, timeout_s)[0]
        refused = BatchHeader(-1, None, f"a batch must be a RolloutBatch, got {type(batch).__name__}")
        return self._admit(refused, None, producer, timeout_s)[0]

    def _hold(self, header: ray.ObjectRef, ref: ray.ObjectRef, producer: int) -> tuple[str, int, str | None]:
        """Hold the batch at ``ref`` by its maker's header (the producer's or the scorer's error raises here)."""
        answer = ray.get(header)
        if not isinstance(answer, BatchHeader):
            answer = BatchHeader(-1, None, f"a batch's header must be a BatchHeader, got {type(answer).__name__}")
        return self._admit(answer, ref, producer)

    def _admit(
        self, header: BatchHeader, held: ray.ObjectRef | None, producer: int, timeout_s: float = 600.0
    ) -> tuple[str, int, str | None]:
        """Hold a checked batch (refused if its header says why): its status, version and source."""
        version, source, problem = header
        current = ray.get(self.store.status.remote()).latest
        with self.changed:
            self.changed.wait_for(lambda: self.closed or self._room(producer) > 0, timeout=timeout_s)
            if self.closed:
                return "closed", version, source
            status = self.buffer.put(held, version=version, current_version=current, problem=problem)
            self.changed.notify_all()
        if status.startswith("refused"):
            log.warning("buffer %s: refused a batch of version %d: %s", self.run, version, status[9:])
            count("distillspec_samples", run=self.run, column="refused")
        if status != "full":
            count("distillspec_samples", run=self.run, column="produced")
        gauge("distillspec_buffer_size", len(self.buffer), run=self.run)
        return status, version, source

    def take(self, n: int, version: int, timeout_s: float) -> list[ray.ObjectRef] | None:
        """Up to ``n`` fresh batches for the learner at ``version`` (stale ones are dropped first), waiting up to
        ``timeout_s`` while there are none: ``[]`` on time-out, None once the buffer is closed."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                if self.closed:
                    return None
                before = self.buffer.ledger.dropped
                items = self.buffer.take(n, current_version=version)
                count("distillspec_samples", self.buffer.ledger.dropped - before, run=self.run, column="dropped")
                if items or not self.changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                    break
            self.changed.notify_all()
        count("distillspec_samples", len(items), run=self.run, column="consumed")
        gauge("distillspec_buffer_size", len(self.buffer), run=self.run)
        for made_by, _ in items:
            gauge("distillspec_policy_lag", version - made_by, run=self.run)
        return [ref for _, ref in items]

    def close(self) -> dict:
        """Stop taking batches; what is still held is released and counted as dropped."""
        with self.changed:
            self.closed = True
            self.buffer.ledger.dropped += len(self.buffer)
            self.buffer.items.clear()
            self.changed.notify_all()
        return self.ledger()

    def ledger(self) -> dict:
        held = len(self.buffer)
        return {
            **self.buffer.ledger.to_dict(),
            "held": held,
            "balanced": self.buffer.ledger.balanced(held),
            "refusals": list(self.buffer.refusals),
        }
