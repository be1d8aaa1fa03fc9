"""A Serve replica's draft follows the run's weight store: it swaps in each version the serving gate passed, judges
it on live traffic against the version before, and rolls it back (here and, through the store, on every replica)
when its live alpha collapses."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from actors.common import NAMESPACE, weights_name
from actors.weights import Follow, take
from distillspec.config import FollowConfig
from distillspec.integrity import TransferRefused
from distillspec.serving.completer import Completion, DraftServer, LiveAcceptance

log = logging.getLogger("distillspec.serve")


class DraftFollower:
    """The draft of ``server`` following the weight store of ``run`` as ``follow`` (``serve.follow``) says: call
    :meth:`start` once, :meth:`judge` with each batch of finished completions. ``version_gauge`` shows the draft
    version held; ``rollbacks`` counts rollbacks (Ray Serve metrics, or any objects with ``set`` and ``inc``)."""

    def __init__(
        self,
        server: DraftServer,
        run: str,
        follow: FollowConfig,
        *,
        version_gauge: Any,
        rollbacks: Any,
    ) -> None:
        self.server, self.run, self.follow_version, self.sync_every_s = server, run, follow.version, follow.sync_every_s
        self.version_gauge, self.rollback_count = version_gauge, rollbacks
        self.version_gauge.set(server.version)
        self.store, self.warned = None, False
        self.lock = threading.Lock()  #: one change of the draft at a time (the sync thread, a rollback)
        self.live = LiveAcceptance(follow.rollback_window, follow.rollback_margin)
        self.swaps: list[dict] = []
        self.rolled_back: set[int] = set()  #: versions the deployment rolled back: never served again
        self.refused: dict[int, str] = {}  #: versions this replica refused to load, with the reason
        self.rollbacks: list[dict] = []
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the run's current version now (a replica that starts late serves it from its first request), then
        check every ``sync_every_s`` in a daemon thread (never when it is 0)."""
        if not self.sync_every_s:
            return
        self.sync()
        self.thread = threading.Thread(target=self._follow, name="draft-sync", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        """False once the thread that follows the store stopped."""
        return self.thread is None or self.thread.is_alive()

    def stats(self) -> dict:
        """What ``/v1/stats`` reports of the following: swaps, refusals, rollbacks and each version's live alpha."""
        return {
            "swaps": self.swaps,
            "run": self.run,
            "refused": [{"version": v, "reason": r} for v, r in self.refused.items()],
            "rollbacks": self.rollbacks,
            "live_alpha": {str(v): self.live.alpha(v) for v in self.live.versions()},
        }

    def _follow(self) -> None:
        """Swap in each new draft version (the daemon thread). An unexpected error in one check is logged and the
        next check goes on: the thread outlives it."""
        while True:
            time.sleep(self.sync_every_s)
            try:
                self.sync()
            except Exception:
                log.exception("draft sync failed; retrying in %g s", self.sync_every_s)

    def sync(self) -> None:
        """Follow the run's weight store: leave a version the deployment rolled back, and take the serving (or
        latest) version when it is another one that was neither rolled back nor refused here."""
        if self.store is None:
            try:
                self.store = ray.get_actor(weights_name(self.run), namespace=NAMESPACE)
            except ValueError:
                return  # no such run (yet): keep serving the draft we have
        try:
            follow = ray.get(self.store.follow.remote(self.follow_version), timeout=10)  # one call per check
            wanted = follow.version
            with self.lock:
                self.rolled_back.update(follow.rolled_back)
                if self.server.version in self.rolled_back:
                    self._roll_back_held("another replica saw it collapse")
                current = self.server.version
                if wanted >= 0 and wanted != current and wanted not in self.rolled_back and wanted not in self.refused:
                    self._swap(current, follow)
        except TransferRefused as exc:  # logged and counted by take; served requests never see these weights
            self.refused[wanted] = str(exc)
            self.store.refuse.remote(wanted, str(exc))  # a rollback must not return to it
        except (RuntimeError, ValueError, KeyError, AssertionError) as exc:  # weights of another shape: another draft
            if not self.warned:
                log.warning("run %r publishes weights this draft cannot take: %s", self.run, exc)
                self.warned = True
        except (ray.exceptions.RayError, TimeoutError):
            self.store = None  # the store died with its job; look it up again

    def _swap(self, before: int, follow: Follow) -> None:
        """Load the version the store named (``follow``) into the server's draft (vLLM: in place; the torch decoder:
        into a copy, so calls already running keep theirs). Weights that fail their integrity check raise before
        anything is loaded; a new version's gamma choice starts from its canary alpha."""
        version = take(self.store, before, self._load(follow), answer=follow)[0]
        if version == before:
            return
        self.live.forget({before, version})  # the versions a rollback can compare: the current and the previous
        self.swaps.append({"from": before, "to": version, "time": time.time()})
        self.version_gauge.set(version)
        log.info("draft version %d -> %d", before, version)

    def _load(self, follow: Follow):
        """The server's load of the weights of the version ``follow`` names (with its canary alpha)."""
        return lambda arrays: self.server.load_draft(arrays, follow.version, follow.alpha)

    def judge(self, done: list[Completion]) -> None:
        """Count each completion for the version that made it (one that spanned a swap counts for neither, one of a
        version rolled back for nothing), and roll the current version back when its live alpha collapsed against
        the previous version's (:class:`distillspec.serving.completer.LiveAcceptance`)."""
        for c in done:
            if "draft_version_end" not in c.stats and c.version not in self.rolled_back:
                self.live.record(c.version, c.stats, c.args)
        previous, current = self.server.previous, self.server.version
        if previous is not None and (reason := self.live.verdict(current, previous[1])):
            threading.Thread(target=self._roll_back, args=(current, reason), name="rollback", daemon=True).start()

    def _roll_back(self, version: int, reason: str) -> None:
        """Return to the previous version here, then tell the run's weight store, so the deployment follows."""
        with self.lock:
            if self.server.version != version:
                return
            self._roll_back_held(reason)
        try:
            ray.get(self.store.roll_back.remote(version, reason), timeout=10)
        except (AttributeError, ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("could not tell the weight store of the rollback of version %d: %s", version, exc)

    def _roll_back_held(self, reason: str) -> None:
        bad = self.server.version
        self.rolled_back.add(bad)
        now = self.server.roll_back()
        if now == bad:
            log.error("ALARM: draft version %d must be rolled back (%s), but this replica holds no other", bad, reason)
            return
        self.rollbacks.append({"from": bad, "to": now, "reason": reason, "time": time.time()})
        self.live.forget({now})
        self.rollback_count.inc()
        self.version_gauge.set(now)
        log.error("ALARM: draft version %d rolled back to %d: %s", bad, now, reason)
