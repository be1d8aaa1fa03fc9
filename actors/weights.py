"""The weight store: the one holder of the draft's versions, and how a version is published to it and taken from it.

:class:`WeightStore` holds object *references* to the versions it keeps and owns their bytes (it puts each
published version into the object store again, so a version outlives its publisher): the *latest* version (the
learner publishes each new one; rollout actors and the evaluator take it) and the *serving* one (a version the
evaluator's canary passed; Serve replicas take only it). Every version carries a checksum per tensor, checked where
it is loaded. A replica that sees a serving version collapse on live traffic rolls it back here, so the whole
deployment returns to the serving version before it. The store numbers the versions
(:class:`~distillspec.versions.VersionNumbers`): the learner's steps, shifted after a restarted learner publishes a
step again, so a number never names two drafts.

The store's process imports neither torch nor transformers (it starts in a fraction of a second beside the actors
that do); :func:`publish` and :func:`pull` import them where they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import ray

from actors.common import log
from actors.dashboard import count, gauge
from distillspec.integrity import TransferRefused, check, checksums
from distillspec.versions import DraftVersion, VersionNumbers

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


KEEP_EARLIER = 3  #: earlier serving versions the store keeps for rollbacks


@ray.remote(num_cpus=0, max_concurrency=8)
class WeightStore:
    """Holds the latest version, the serving one and the serving ones before it (replacing one releases what
    nothing holds any more); it owns their bytes (:meth:`publish`)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.current: DraftVersion | None = None
        self.serving: DraftVersion | None = None
        self.earlier: list[DraftVersion] = []  #: earlier serving versions, newest last: where a rollback returns
        self.numbers = VersionNumbers()
        self.record: dict | None = None
        self.refused: list[dict] = []  #: versions the serving gate refused or serving rolled back, with the reason
        self.rolled_back: set[int] = set()
        self.canary: dict[int, float] = {}  #: the canary's alpha of each serving version kept

    def kept(self) -> set[int]:
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

    def run_name(self) -> str:
        return self.run

    def promote(self, version: DraftVersion, alpha: float | None = None) -> None:
        """Make ``version`` (an entry this store gave out: :meth:`latest`) the serving version: it passed the gate,
        whose canary measured ``alpha``. The entry names the store's own copy of the weights; nothing is copied."""
        if self.serving is not None:
            self.earlier = [*self.earlier, self.serving][-KEEP_EARLIER:]
        self.serving = version
        if alpha is not None:
            self.canary = {v: a for v, a in self.canary.items() if v in self.kept()} | {version.number: alpha}
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
        return self.version("serving")

    def _step_back(self) -> None:
        """While the serving version was refused or rolled back, serve the one before it."""
        refused = {r["version"] for r in self.refused}
        while self.serving is not None and self.serving.number in refused:
            self.serving = self.earlier.pop() if self.earlier else None
            gauge("distillspec_serving_version", self.version("serving"), run=self.run)

    def follow(self, which: str = "serving") -> Follow:
        """What a Serve replica checks, in one call: the latest (or serving) version with its weights' reference and
        checksums, the alpha the serving gate's canary measured for it (None: not measured), and the versions rolled
        back."""
        held = self.latest(which)
        alpha = None if held is None else self.canary.get(held.number)
        return Follow(held, alpha, sorted(self.rolled_back))

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
        return -1 if held is None else held.number

    def status(self) -> tuple[int, int, dict | None]:
        """The latest version's number and learner step (-1, -1 before there is one), and the learner's record of
        the latest step it published."""
        return self.version(), -1 if self.current is None else self.current.step, self.record

    def latest(self, which: str = "latest") -> DraftVersion | None:
        return self.current if which == "latest" else self.serving


def publish(
    store: ray.actor.ActorHandle,
    model: torch.nn.Module,
    step: int,
    record: dict | None = None,
    *,
    serving: bool = False,
) -> int:
    """Put the weights of learner step ``step`` into the object store and make them the latest version (with
    ``serving``, the serving one too, bypassing the gate: for a draft chosen by hand); ``record`` is the learner's
    log record of the step that made it (the driver's console shows it). Returns the version's number (the store's:
    :meth:`WeightStore.publish`).

    The store takes the bytes over (:meth:`WeightStore.publish`): a version outlives the learner that made it, so a
    consumer started after the learner died (a restarted rollout actor, a new replica) still loads it. Promotion and
    rollback move the store's reference, never the bytes.
    """
    from distillspec.models import state_arrays

    arrays = state_arrays(model)
    return ray.get(store.publish.remote(step, [ray.put(arrays)], record, checksums(arrays), serving=serving))


def fetch(
    store: ray.actor.ActorHandle, version: int, which: str = "latest"
) -> tuple[int, dict[str, np.ndarray] | None]:
    """The store's latest (or serving) version and its weights when it differs from ``version`` (the one held),
    else ``(version, None)``. Weights that fail their integrity check raise
    :class:`~distillspec.integrity.TransferRefused` (logged and counted here): the caller keeps what it holds."""
    return fetch_held(store, ray.get(store.latest.remote(which)), version)


def fetch_held(
    store: ray.actor.ActorHandle, held: DraftVersion | None, version: int
) -> tuple[int, dict[str, np.ndarray] | None]:
    """:func:`fetch` of what the store answered already (``held``: its entry of the version)."""
    if held is None or held.number == version:
        return version, None
    latest, sums = held.number, held.sums
    try:
        arrays = ray.get(held.weights[0])
    except ray.exceptions.ObjectLostError:
        return version, None  # its owner, the store, died with its job
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
    return pull_held(store, model, version, which)[0]


def pull_held(
    store: ray.actor.ActorHandle, model: torch.nn.Module, version: int, which: str = "latest"
) -> tuple[int, DraftVersion | None]:
    """:func:`pull`, and the store's entry of the version it loaded (None: nothing new loaded), whose reference a
    caller can hand back to the store (the gate promotes by reference)."""
    held = ray.get(store.latest.remote(which))
    try:
        latest, arrays = fetch_held(store, held, version)
    except TransferRefused:
        return version, None
    if arrays is None:
        return latest, None
    from distillspec.models import load_arrays

    load_arrays(model, arrays)
    return latest, held
