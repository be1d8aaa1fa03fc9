"""The sample buffer as a named actor: object references to rollout batches, never the batches' bytes.

Rollout actors return each batch to the driver, which owns it (so it outlives a producer that dies) and offers
its reference here; the learner takes references and reads the batches from the object store.
Bookkeeping (capacity, staleness, ledger) is :class:`distillspec.buffer.SampleBuffer`.
"""

from __future__ import annotations

import ray

from actors.common import log, setup_worker
from actors.metrics import count, gauge
from distillspec.buffer import SampleBuffer, check_batch


@ray.remote(num_cpus=0, max_concurrency=8)
class BufferActor:
    def __init__(self, *, capacity: int, max_policy_lag: int, max_batch_tokens: int, vocab_size: int, run: str) -> None:
        setup_worker()
        self.buffer = SampleBuffer(capacity, max_policy_lag)
        self.max_batch_tokens, self.vocab_size, self.run = max_batch_tokens, vocab_size, run
        self.version = 0  #: the learner's version, raised by each take()
        self.closed = False

    def free_slots(self) -> int:
        """Room left (0 = full: wait), or -1 once closed (producers stop)."""
        return -1 if self.closed else self.buffer.capacity - len(self.buffer)

    def put(self, refs: list[ray.ObjectRef], version: int, source: str) -> str:
        """Offer ``refs[0]`` (a batch made by draft ``version``): ``ok``, ``full``, ``closed`` or ``refused: why``."""
        if self.closed:
            return "closed"
        if len(self.buffer) >= self.buffer.capacity:
            return "full"
        # The content check reads the batch in place (zero-copy from the local object store).
        problem = check_batch(ray.get(refs[0]), max_tokens=self.max_batch_tokens, vocab_size=self.vocab_size)
        status = self.buffer.put((source, refs[0]), version=version, current_version=self.version, problem=problem)
        if status.startswith("refused"):
            log.warning("buffer %s: refused a batch of version %d: %s", self.run, version, status[9:])
            count("distillspec_samples", run=self.run, column="refused")
        count("distillspec_samples", run=self.run, column="produced")
        gauge("distillspec_buffer_size", len(self.buffer), run=self.run)
        return status

    def take(self, n: int, current_version: int) -> list[tuple[int, str, list[ray.ObjectRef]]] | None:
        """Up to ``n`` fresh batches as ``(version, source, [ref])``; stale ones are dropped first.
        None once the buffer is closed."""
        if self.closed:
            return None
        self.version = max(self.version, current_version)
        before = self.buffer.ledger.dropped
        items = self.buffer.take(n, current_version=current_version)
        count("distillspec_samples", self.buffer.ledger.dropped - before, run=self.run, column="dropped")
        count("distillspec_samples", len(items), run=self.run, column="consumed")
        gauge("distillspec_buffer_size", len(self.buffer), run=self.run)
        for version, _ in items:
            gauge("distillspec_policy_lag", current_version - version, run=self.run)
        return [(version, source, [ref]) for version, (source, ref) in items]

    def close(self) -> dict:
        """Stop taking batches; what is still held is released and counted as dropped."""
        self.closed = True
        self.buffer.ledger.dropped += len(self.buffer)
        self.buffer.items.clear()
        return self.ledger()

    def ledger(self) -> dict:
        held = len(self.buffer)
        return {
            **self.buffer.ledger.to_dict(),
            "held": held,
            "balanced": self.buffer.ledger.balanced(held),
            "refusals": list(self.buffer.refusals),
        }
