"""Runs inside vLLM's engine-core process (``scheduler_cls``): gamma chosen live for every engine step
(``serve.gamma=auto`` with ``serve.backend=vllm``).

vLLM's dynamic speculative decoding reads the number of draft tokens of each step from a batch-size schedule,
``scheduler.dynamic_sd_lookup[batch size]``, fixed when the engine starts. These schedulers put a
:class:`distillspec.decoding.auto_gamma.StepGamma` in its place, so the same lookup answers from the live alpha of the
draft version being served and the measured seconds of the engine's own steps, and feed it what each step did.

The engine's owner and the scheduler talk through a folder (:class:`GammaMailbox`; vLLM's ``additional_config``
names it): the owner writes the draft version it loaded and that version's canary alpha, the scheduler reads it at
the next step and writes what it chose, about once a second. A folder works whatever process the scheduler runs in.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from distillspec.decoding.auto_gamma import StepGamma
from distillspec.files import read_json, write_json

MAILBOX = "distillspec_gamma_mailbox"  #: the ``additional_config`` key that names the folder


class GammaMailbox:
    """The folder between an engine's owner and its live gamma choice: ``version.json`` (the draft version loaded
    and its canary alpha; the owner writes it) and ``gamma.json`` (the choice's summary; the scheduler writes it)."""

    def __init__(self, folder: str | Path, report_every_s: float = 1.0) -> None:
        self.folder, self.report_every_s = Path(folder), report_every_s
        self.seen: int | None = None  #: modification time (ns) of the version file read last
        self.reported = 0.0

    # -- the owner's side ---------------------------------------------------------------------------------------
    def send_version(self, version: int, alpha: float | None) -> None:
        write_json(self.folder / "version.json", {"version": version, "alpha": alpha})

    def summary(self) -> dict | None:
        """What the choice reported last (:meth:`distillspec.decoding.auto_gamma.AutoGamma.summary`), or None before
        that."""
        return read_json(self.folder / "gamma.json")

    # -- the scheduler's side -----------------------------------------------------------------------------------
    def exchange(self, live: StepGamma, idle: bool) -> None:
        """Take a new draft version into ``live`` if one was sent; report ``live`` if the last report is old or the
        engine goes ``idle`` (its last request done)."""
        path = self.folder / "version.json"
        try:
            changed = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            changed = None
        if changed is not None and changed != self.seen and (sent := read_json(path)) is not None:
            self.seen = changed
            live.new_version(int(sent["version"]), sent["alpha"])
        if (now := time.monotonic()) - self.reported >= self.report_every_s or idle:
            self.reported = now
            write_json(self.folder / "gamma.json", live.auto.summary())


class _LiveGamma:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live: StepGamma | None = None
        folder = self.vllm_config.additional_config.get(MAILBOX)
        if self.dynamic_sd_lookup is not None and folder:  # the engine was started with a schedule: gamma=auto
            self.live = self.dynamic_sd_lookup = StepGamma(self.num_spec_tokens)
            self.mailbox = GammaMailbox(folder)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self.live is not None and scheduler_output.num_scheduled_tokens:
            _step_done(self.live, scheduler_output, model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.live is not None:
            self.mailbox.exchange(self.live, idle=not self.get_num_unfinished_requests())
        return outputs


def _step_done(live: StepGamma, scheduled: Any, output: Any) -> None:
    spec = scheduled.scheduled_spec_decode_tokens
    rows = scheduled.num_scheduled_tokens
    verified = [len(spec.get(r, ())) for r in rows]
    index, sampled = output.req_id_to_index, output.sampled_token_ids
    emitted = [len(sampled[index[r]]) if r in index and index[r] < len(sampled) else 0 for r in rows]
    accepted = [max(0, e - 1) if v else 0 for e, v in zip(emitted, verified, strict=True)]
    decoding = not scheduled.scheduled_new_reqs and all(n == 1 + v for n, v in zip(rows.values(), verified))
    drafted = scheduled.num_spec_tokens_to_schedule
    live.step_done(time.perf_counter(), len(rows), verified, drafted, accepted, sum(emitted), decoding)


class LiveGammaScheduler(_LiveGamma, Scheduler):
    """vLLM's scheduler with gamma chosen live (engines that schedule synchronously: vLLM's CPU platform)."""


class LiveGammaAsyncScheduler(_LiveGamma, AsyncScheduler):
    """vLLM's asynchronous scheduler (its default on GPUs) with gamma chosen live."""
