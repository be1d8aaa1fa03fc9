"""The two named actors that hold object references between the pipeline's workers, never the bytes behind them.

- :class:`BufferActor`, the sample buffer: rollout actors put :class:`~distillspec.rollout.RolloutBatch` objects
  into it and the learner takes them. The buffer keeps its own copy of each batch it accepts (it owns it, so a
  batch outlives a producer that dies). ``put`` waits
  while the buffer is full, ``take`` while it is empty. Its bookkeeping (capacity, staleness, ledger) is
  :class:`distillspec.rollout.SampleBuffer`.
- :class:`WeightStore`, the one holder of the draft's versions: the *latest* (the learner publishes each new
  version; rollout actors and the evaluator take it) and the *serving* one (a version the evaluator's canary
  passed; Serve replicas take only it). Every version carries a checksum per tensor, checked where it is loaded.
  A replica that sees a serving version collapse on live traffic rolls it back here, so the whole deployment returns
  to the serving version before it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import ray
import torch

from actors.common import log, setup_worker
from actors.metrics import count, gauge
from distillspec.integrity import TransferRefused, check, checksums
from distillspec.models import load_arrays, state_arrays
from distillspec.rollout import RolloutBatch, SampleBuffer

#: a version held by the store: its number, ``[a reference to its arrays]`` and their checksums
Held = tuple[int, list[ray.ObjectRef], dict[str, str] | None]
KEEP_EARLIER = 3  #: earlier serving versions the store keeps for rollbacks


@ray.remote(num_cpus=0, max_concurrency=8)
class WeightStore:
    """Holds references to the latest version, the serving one and the serving ones before it (replacing one
    releases what nothing holds any more)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.current: Held | None = None
        self.serving: Held | None = None
        self.earlier: list[Held] = []  #: earlier serving versions, newest last: where a rollback returns
        self.published = 0
        self.record: dict | None = None
        self.refused: list[dict] = []  #: versions the serving gate refused or serving rolled back, with the reason
        self.rolled_back: set[int] = set()

    def publish(
        self, version: int, refs: list[ray.ObjectRef], record: dict | None = None, sums: dict[str, str] | None = None
    ) -> None:
        """Make ``refs[0]`` version ``version``; ``sums``: its per-tensor checksums, which consumers check."""
        self.current = (version, refs, sums)
        self.published += 1
        self.record = record or self.record
        gauge("distillspec_weight_version", version, run=self.run)

    def run_name(self) -> str:
        return self.run

    def promote(self, version: int, refs: list[ray.ObjectRef], sums: dict[str, str] | None = None) -> None:
        """Make version ``version`` (weights ``refs[0]``) the serving version: it passed the gate."""
        if self.serving is not None:
            self.earlier = [*self.earlier, self.serving][-KEEP_EARLIER:]
        self.serving = (version, refs, sums)
        gauge("distillspec_serving_version", version, run=self.run)

    def refuse(self, version: int, reason: str) -> None:
        """The gate refused version ``version`` for serving (the canary), or a consumer refused to load it (integrity):
        it is never served (when it is the serving version, serving returns to the one before). Only the first
        refusal of a version counts."""
        if all(r["version"] != version for r in self.refused):
            self.refused.append({"version": version, "reason": reason})
            count("distillspec_versions_refused", run=self.run, reason=reason.split(":", 1)[0])
        self._step_back()

    def roll_back(self, version: int, reason: str) -> int:
        """A Serve replica saw ``version`` collapse on live traffic: serving returns to the version before it, and
        ``version`` is never served again. Reports of a version already rolled back change nothing. Returns the
        serving version (-1: none, the replicas' start draft)."""
        if version not in self.rolled_back:
            self.rolled_back.add(version)
            self.refused = [r for r in self.refused if r["version"] != version] + [
                {"version": version, "reason": reason}
            ]
            count("distillspec_rollbacks", run=self.run)
            log.error("ALARM: serving rolled back from draft version %d: %s", version, reason)
        self._step_back()
        return self.version("serving")

    def _step_back(self) -> None:
        """While the serving version was refused or rolled back, serve the one before it."""
        refused = {r["version"] for r in self.refused}
        while self.serving is not None and self.serving[0] in refused:
            self.serving = self.earlier.pop() if self.earlier else None
            gauge("distillspec_serving_version", self.version("serving"), run=self.run)

    def follow(self, which: str = "serving") -> tuple[int, list[int]]:
        """What a Serve replica checks: the latest (or serving) version, and the versions rolled back."""
        return self.version(which), sorted(self.rolled_back)

    def gate(self) -> dict:
        return {
            "latest": self.version(),
            "serving": self.version("serving"),
            "refused": self.refused,
            "rolled_back": sorted(self.rolled_back),
        }

    def version(self, which: str = "latest") -> int:
        """The latest (or serving) version, or -1 before there is one."""
        held = self.current if which == "latest" else self.serving
        return -1 if held is None else held[0]

    def status(self) -> tuple[int, dict | None]:
        """The latest version and the learner's record of the step that made it."""
        return self.version(), self.record

    def latest(self, which: str = "latest") -> Held | None:
        return self.current if which == "latest" else self.serving


def publish(
    store: ray.actor.ActorHandle,
    model: torch.nn.Module,
    version: int,
    record: dict | None = None,
    *,
    serving: bool = False,
) -> None:
    """Put the weights into the object store and make them the latest version (with ``serving``, the serving one
    too, bypassing the gate: for a draft chosen by hand); ``record`` is the learner's log record of the step that
    made it (the driver's console shows it).

    The publisher owns the object; if it dies, pullers keep their weights until its successor publishes again.
    """
    arrays = state_arrays(model)
    refs, sums = [ray.put(arrays)], checksums(arrays)
    ray.get(store.publish.remote(version, refs, record, sums))
    if serving:
        ray.get(store.promote.remote(version, refs, sums))


def fetch(
    store: ray.actor.ActorHandle, version: int, which: str = "latest"
) -> tuple[int, dict[str, np.ndarray] | None]:
    """The store's latest (or serving) version and its weights when it differs from ``version`` (the one held),
    else ``(version, None)``. Weights that fail their integrity check raise
    :class:`~distillspec.integrity.TransferRefused` (logged and counted here): the caller keeps what it holds."""
    held = ray.get(store.latest.remote(which))  # one call: the version and, with it, the reference
    if held is None or held[0] == version:
        return version, None
    latest, refs, sums = held
    try:
        arrays = ray.get(refs[0])
    except ray.exceptions.ObjectLostError:
        return version, None  # the publisher died; its successor publishes again
    try:
        if sums is not None:
            check(arrays, sums, f"draft version {latest}")
    except TransferRefused as exc:  # mangled between the publisher and here
        log.warning("refused %s", exc)
        count("distillspec_weights_refused", run=ray.get(store.run_name.remote()), reason="integrity")
        raise
    return latest, arrays


def pull(store: ray.actor.ActorHandle, model: torch.nn.Module, version: int, which: str = "latest") -> int:
    """Load the store's latest (or serving) weights into ``model`` when they differ from ``version``; returns the
    version held (``version`` itself when the new weights were refused)."""
    try:
        latest, arrays = fetch(store, version, which)
    except TransferRefused:
        return version
    if arrays is not None:
        load_arrays(model, arrays)
    return latest


@ray.remote(num_cpus=0, max_concurrency=16)
class BufferActor:
    """The sample buffer of one run (see the module docstring). Staleness is measured against the weight store's
    current version at ``put`` and against the learner's version at ``take``."""

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

    def reserve(self, producer: int, timeout_s: float) -> bool:
        """Wait until there is a slot for ``producer``'s next batch and hold it (a producer samples only when its
        batch has a place, so what it samples is fresh). False once the buffer is closed."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or self._room(producer) > 0, timeout=timeout_s)
            if self._room(producer) > 0 and not self.closed:
                self.reserved.add(producer)
            return not self.closed

    def examples(self) -> list[ray.ObjectRef]:
        return self.examples_ref

    def _room(self, producer: int) -> int:
        return self.buffer.capacity - len(self.buffer) - len(self.reserved - {producer})

    def put(self, refs: list[ray.ObjectRef], producer: int = -1, timeout_s: float = 600.0) -> str:
        """Offer the batch ``refs[0]`` (a :class:`RolloutBatch`), waiting while the buffer is full: ``ok``,
        ``refused: why``, ``closed``, or ``full`` when no room came within ``timeout_s``."""
        # The content check reads the batch in place (zero-copy from the local object store).
        batch = ray.get(refs[0])
        if isinstance(batch, RolloutBatch):
            owned = ray.put(batch)
            version, problem = (
                batch.version,
                batch.problem(max_tokens=self.max_batch_tokens, vocab_size=self.vocab_size),
            )
        else:
            version, problem = -1, f"a batch must be a RolloutBatch, got {type(batch).__name__}"
            owned = None
        del batch
        current = ray.get(self.store.version.remote())
        with self.changed:
            self.reserved.discard(producer)
            self.changed.wait_for(lambda: self.closed or self._room(producer) > 0, timeout=timeout_s)
            if self.closed:
                return "closed"
            status = self.buffer.put(owned, version=version, current_version=current, problem=problem)
            self.changed.notify_all()
        if status.startswith("refused"):
            log.warning("buffer %s: refused a batch of version %d: %s", self.run, version, status[9:])
            count("distillspec_samples", run=self.run, column="refused")
        if status != "full":
            count("distillspec_samples", run=self.run, column="produced")
        gauge("distillspec_buffer_size", len(self.buffer), run=self.run)
        return status

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
