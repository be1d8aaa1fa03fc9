"""The weight store: the one holder of the draft's versions, and how a version is published to it and taken from it.

:class:`WeightStore` holds object *references* to the versions it keeps and owns their bytes (it puts each
published version into the object store again, so a version outlives its publisher): the *latest* version (the
learner publishes each new one; rollout actors and the evaluator take it) and the *serving* one (a version the
evaluator's canary passed; Serve replicas take only it). Every version carries a checksum per tensor, checked where
it is loaded. A replica that sees a serving version collapse on live traffic rolls it back here, so the whole
deployment returns to the serving version before it. The store numbers the versions
(:class:`~distillspec.versions.VersionNumbers`): the learner's steps, shifted after a restarted learner publishes a
step again, so a number never names two drafts.

A consumer (a rollout actor, the evaluator, a Serve replica) takes a version one way, :func:`take`; the store answers
two reads of the versions, :meth:`WeightStore.follow` (the version to hold, with its weights) and
:meth:`WeightStore.status` (the numbers, for the driver, the buffer and the gate). It also hands out the target's
weights the run shares (:meth:`WeightStore.shared_target`, :mod:`actors.target`).

The store's process imports neither torch nor transformers (it starts in a fraction of a second beside the actors
that do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import ray

from actors.common import log
from actors.dashboard import count, gauge
from distillspec.integrity import TransferRefused, check, checksums
from distillspec.versions import DraftVersion, VersionNumbers, state_arrays

if TYPE_CHECKING:
    import torch


class Follow(NamedTuple):
    """:meth:`WeightStore.follow`'s answer."""

    held: DraftVersion | None  #: the version to serve (its weights: ``[a reference]``; None: none published)
    alpha: float | None  #: its canary alpha
    rolled_back: list[int]

    @property
    def version(self) -> int:
        return -1 if self.held is None else self.held.number


class StoreStatus(NamedTuple):
    """:meth:`WeightStore.status`'s answer."""

    latest: int  #: the latest version (-1: none published)
    serving: int  #: the serving version (-1: none: the replicas' start draft)
    step: int  #: the learner step of the latest version (-1: none)
    record: dict | None  #: the learner's log record of the latest step it published
    refused: list[dict]  #: versions the gate refused or serving rolled back, with the reason
    rolled_back: list[int]
    run: str


KEEP_EARLIER = 3  #: earlier serving versions the store keeps for rollbacks
#: How long a consumer waits for a version's bytes before it keeps what it holds and tries again at its next check
#: (Ray stops restoring spilled objects once the disk is 95% full: a consumer would otherwise wait for ever).
TAKE_TIMEOUT_S = 300.0


@ray.remote(num_cpus=0, max_concurrency=8)
class WeightStore:
    """Holds the latest version, the serving one and the serving ones before it (replacing one releases what
    nothing holds any more); it owns their bytes (:meth:`publish`)."""

    def __init__(self, run: str, target: list[ray.ObjectRef] | None = None) -> None:
        self.run = run
        self.target = target  #: [a reference] to the target's weights the run shares (:mod:`actors.target`)
        self.current: DraftVersion | None = None
        self.serving: DraftVersion | None = None
        self.earlier: list[DraftVersion] = []  #: earlier serving versions, newest last: where a rollback returns
        self.numbers = VersionNumbers()
        self.record: dict | None = None
        self.refused: list[dict] = []  #: versions the serving gate refused or serving rolled back, with the reason
        self.rolled_back: set[int] = set()
        self.canary: dict[int, float] = {}  #: the canary's alpha of each serving version kept

    def _kept(self) -> set[int]:
        return {held.number for held in (self.current, self.serving, *self.earlier) if held is not None}

    def publish(
        self,
        step: int,
        refs: list[ray.ObjectRef],
        record: dict | None = None,
        sums: dict[str, str] | None = None,
        *,
        serving: bool = False,
    ) -> int:
        """Make ``refs[0]``, the draft of learner step ``step``, the latest version, and return its number
        (:class:`~distillspec.versions.VersionNumbers`: the step, shifted once a restarted learner publishes a step
        again);
        ``sums``: its per-tensor checksums, which consumers check; ``serving``: make it the serving version too,
        bypassing the gate. The store puts the weights again itself, so that it owns them (Ray frees an object with
        its owner): one copy in the object store per version, whatever becomes of the publisher; the publisher's
        copy goes with its reference."""
        owned = [ray.put(ray.get(refs[0]))]  # read in place (zero-copy), written once more, owned here
        self.current = DraftVersion(self.numbers.number(step), step, owned, sums)
        self.record = record or self.record
        gauge("distillspec_weight_version", self.current.number, run=self.run)
        if serving:
            self.promote(self.current)
        return self.current.number

    def promote(self, version: DraftVersion, alpha: float | None = None) -> None:
        """Make ``version`` (an entry this store gave out: :meth:`follow`) the serving version: it passed the gate,
        whose canary measured ``alpha``. The entry names the store's own copy of the weights; nothing is copied."""
        if self.serving is not None:
            self.earlier = [*self.earlier, self.serving][-KEEP_EARLIER:]
        self.serving = version
        if alpha is not None:
            self.canary = {v: a for v, a in self.canary.items() if v in self._kept()} | {version.number: alpha}
        gauge("distillspec_serving_version", version.number, run=self.run)

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
        return self._number(self.serving)

    def _step_back(self) -> None:
        """While the serving version was refused or rolled back, serve the one before it."""
        refused = {r["version"] for r in self.refused}
        while self.serving is not None and self.serving.number in refused:
            self.serving = self.earlier.pop() if self.earlier else None
            gauge("distillspec_serving_version", self._number(self.serving), run=self.run)

    def follow(self, which: str = "serving") -> Follow:
        """The read of a consumer (:func:`take`), in one call: the latest (or serving) version with its weights'
        reference and checksums, the alpha the serving gate's canary measured for it (None: not measured), and the
        versions rolled back."""
        held = self.current if which == "latest" else self.serving
        alpha = None if held is None else self.canary.get(held.number)
        return Follow(held, alpha, sorted(self.rolled_back))

    def status(self) -> StoreStatus:
        """The read of the driver, the buffer and the gate: the versions' numbers, refusals and rollbacks."""
        step = -1 if self.current is None else self.current.step
        return StoreStatus(
            self._number(self.current), self._number(self.serving), step, self.record, self.refused,
            sorted(self.rolled_back), self.run,
        )  # fmt: skip

    def shared_target(self) -> list[ray.ObjectRef] | None:
        """The read of an actor that holds the target: ``[a reference]`` to the weights the run shares (never
        resolved here), or None."""
        return self.target

    @staticmethod
    def _number(held: DraftVersion | None) -> int:
        return -1 if held is None else held.number


def publish(
    store: ray.actor.ActorHandle,
    model: torch.nn.Module,
    step: int,
    record: dict | None = None,
    *,
    serving: bool = False,
    dtype: str = "float32",
) -> int:
    """Put the weights of learner step ``step`` into the object store, in ``dtype`` (``learner.version_dtype``), and
    make them the latest version (with ``serving``, the serving one too, bypassing the gate: for a draft chosen by
    hand); ``record`` is the learner's log record of the step that made it (the driver's console shows it). Returns
    the version's number (the store's: :meth:`WeightStore.publish`).

    The store takes the bytes over (:meth:`WeightStore.publish`): a version outlives the learner that made it, so a
    consumer started after the learner died (a restarted rollout actor, a new replica) still loads it. Promotion and
    rollback move the store's reference, never the bytes.
    """
    arrays = state_arrays(model, dtype)
    return ray.get(store.publish.remote(step, [ray.put(arrays)], record, checksums(arrays), serving=serving))


def take(
    store: ray.actor.ActorHandle,
    version: int,
    load: Callable[[dict[str, np.ndarray]], Any],
    which: str = "latest",
    answer: Follow | None = None,
    timeout_s: float = TAKE_TIMEOUT_S,
) -> tuple[int, Follow]:
    """The one way a consumer takes a draft version: the version it should hold (the store's latest or serving one,
    or the store's ``answer`` to a :meth:`WeightStore.follow` already made) and, when that is not ``version`` (the
    one held), its weights, checked against their checksums and handed to ``load``. Returns the version held now and
    the store's answer (whose ``held`` is the store's entry of that version once loaded). Weights that fail their
    check raise :class:`~distillspec.integrity.TransferRefused` (logged and counted here) before ``load`` sees them:
    the caller keeps what it holds, as it does when the weights cannot be read within ``timeout_s``."""
    answer = answer or ray.get(store.follow.remote(which))
    held = answer.held
    if held is None or held.number == version:
        return version, answer
    try:
        arrays = ray.get(held.weights[0], timeout=timeout_s)
    except ray.exceptions.ObjectLostError:
        return version, answer  # its owner, the store, died with its job
    except ray.exceptions.GetTimeoutError:
        log.warning(
            "draft version %d not readable in %.0f s (a full disk stops Ray restoring spilled objects): keeping %d",
            held.number, timeout_s, version,
        )  # fmt: skip
        return version, answer
    if held.sums is not None:
        try:
            check(arrays, held.sums, f"draft version {held.number}")
        except TransferRefused as exc:  # mangled between the publisher and here
            log.warning("refused %s", exc)
            count("distillspec_weights_refused", run=ray.get(store.status.remote()).run, reason="integrity")
            raise
    load(arrays)
    return held.number, answer
