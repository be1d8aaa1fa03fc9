"""Gamma chosen live (``gamma: "auto"``): for each decoding block, the number of draft tokens that maximises the
expected tokens per second, from the live acceptance rate of the draft version being served and the measured cost of
a draft step and of a verify step at that block's batch size.

With acceptance rate alpha, a block that drafts gamma tokens emits on average (Leviathan et al., 2023, eq. 1)

    E(gamma) = (1 - alpha^(gamma + 1)) / (1 - alpha)

tokens per row if every draft token were accepted with the same probability. It is not: a draft token is judged only
once those before it were accepted, and the blocks that get that far are the easier ones (a draft that follows the
target through a phrase keeps following it), so the i-th draft token's acceptance rate ``a_i`` given the ones before
accepted varies with ``i``. The choice therefore plans on

    E(gamma) = 1 + sum_{k=1..gamma} a_1 * ... * a_k,    a_i = alpha * s_i,

``s_i`` the shape of acceptance by draft position (``a_i`` over the pooled alpha), counted over many blocks of every
draft version with the same decoding settings (each position shrunk toward the pool where it was judged rarely), and
alpha the live level of the version being served. A row with ``r`` tokens left before its budget emits
``E(min(gamma, r - 1))``, the drafts past those adding nothing. A block costs ``gamma * draft(b) + verify(b, gamma)``
seconds for a batch of ``b`` rows, where ``verify(b, gamma)`` is one target forward over ``gamma + 1`` positions per
row. Gamma 0 is plain decoding: one
token per target forward ``verify(b, 0)``. Both costs are measured on the blocks themselves, never configured: the
median of a shape's recent measurements where it was measured often, and a least-squares line in the number of
tokens a forward runs (rows x positions) elsewhere. Alpha is a decaying count of accepted and judged draft tokens
per draft version and decoding settings, started from a prior (the serving gate's canary alpha of that version, when
known; else the alpha of the version before it on the same settings). One block in ``explore_every`` drafts a
neighbour of the best gamma, so the costs and alpha around the choice stay measured, unless that neighbour is
expected to reach less than ``explore_within`` of the best's tokens per second (trying a clear loser costs more than
it teaches; after blocks without drafts, the draft also has to catch up on their tokens). A draft version is drafted
for (gamma at least 1) until ``probe_tokens`` of its draft tokens were judged on a key, whatever the plan says: the
choice never gives up on a version it has not measured, and a replica's rollback rule
(:class:`distillspec.serving.completer.LiveAcceptance`) gets the live draft tokens it judges a new version on.
"""

from __future__ import annotations

import statistics
import threading
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from distillspec.config import START_GAMMA

#: what alpha is kept per: (draft version, temperature, lenience, epsilon); gamma is what is being chosen.
#: An engine whose steps mix requests (vLLM) keeps one alpha per version: temperature None. The shape of acceptance
#: by draft position is kept per the same key without the version.
AlphaKey = tuple[int, float | None, str | None, float]
MAX_KEYS = 256  #: alpha keys kept at once
#: draft tokens of a version (per key) judged before the choice may stop drafting for it: against a previous version at
#: alpha 0.3, enough to tell a collapse to 0 from sampling noise (binomial standard error 0.04)
PROBE_TOKENS = 128


def expected_tokens(alpha: float | Sequence[float], gamma: int) -> float:
    """Expected tokens per row of a block drafting ``gamma`` tokens, the bonus or corrected token included:
    ``E(0) = 1``, at most ``gamma + 1``. ``alpha``: one acceptance rate for every draft token (i.i.d. acceptance), or
    the rate of each draft position given the ones before it accepted (at least ``gamma`` of them)."""
    if not isinstance(alpha, int | float):
        tokens, reach = 1.0, 1.0
        for rate in alpha[:gamma]:
            reach *= rate
            tokens += reach
        return tokens
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def acceptance_by_position(drafted: Sequence[int], accepted: Sequence[int]) -> tuple[list[int], list[int]]:
    """Draft tokens accepted and judged at each draft position (first, second, ...) of a block whose rows drafted
    ``drafted[r]`` tokens and had ``accepted[r]`` of them accepted: a row's drafts are judged up to its first rejected
    one."""
    width = max(drafted, default=0)
    acc, judged = [0] * width, [0] * width
    for g, n in zip(drafted, accepted, strict=True):
        for i in range(min(n + 1, g)):
            judged[i] += 1
            acc[i] += i < n
    return acc, judged


@dataclass
class ShapeCost:
    """One shape's recent measurements (seconds), their median, how many there were and the index of the last."""

    recent: deque[float]
    median: float = 0.0
    count: int = 0
    last: int = 0


class StepCosts:
    """Seconds of one model forward by its shape (rows, positions per row), learned from measurements.

    A shape measured at least ``trust`` times, the last of them within the last ``stale_after`` measurements, is
    predicted by the median of its last ``window`` measurements: on a machine shared with other work one slow step
    (another process holding the cores, a shape's first run) moves it by nothing, where it would hold a moving average
    up for dozens of steps and turn the choice; a change of the machine's speed shows within half a window. Any other
    shape is predicted by a least-squares line in tokens (rows x positions) through all measurements, older ones
    weighted down by ``forget`` per measurement, slope and intercept kept non-negative (one size measured only: its
    cost, flat). A shape not measured for ``stale_after`` measurements starts afresh: the machine's speed drifts, and
    a cost measured under other conditions must not keep a gamma from being tried again. Both update and predict in
    constant time: the choice runs before every decoding block."""

    def __init__(self, window: int = 7, trust: int = 3, forget: float = 0.995, stale_after: int = 200) -> None:
        self.window, self.trust, self.forget, self.stale_after = window, trust, forget, stale_after
        self.cells: dict[tuple[int, int], ShapeCost] = {}  #: (rows, positions) -> its measurements
        self.sums = [0.0] * 5  #: decayed sums of 1, x, y, x^2, x*y over measurements (x tokens, y seconds)
        self.measured = 0  #: measurements so far, all shapes

    def observe(self, rows: int, positions: int, seconds: float) -> None:
        self.measured += 1
        cell = self.cells.get((rows, positions))
        if cell is None or self.measured - cell.last > self.stale_after:
            cell = self.cells[(rows, positions)] = ShapeCost(deque(maxlen=self.window))
        cell.recent.append(seconds)
        cell.median = statistics.median(cell.recent)
        cell.count += 1
        cell.last = self.measured
        x = rows * positions
        for k, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            self.sums[k] = self.forget * self.sums[k] + v

    def table(self) -> dict[str, float]:
        """Milliseconds of each shape measured ``trust`` times or more, by ``"{rows}x{positions}"``."""
        cells = sorted(self.cells.items())
        return {f"{r}x{p}": round(c.median * 1e3, 3) for (r, p), c in cells if c.count >= self.trust}

    def predict(self, rows: int, positions: int) -> float | None:
        """Predicted seconds, or None before any measurement."""
        cell = self.cells.get((rows, positions))
        if cell is not None and cell.count >= self.trust and self.measured - cell.last <= self.stale_after:
            return cell.median
        n, sx, sy, sxx, sxy = self.sums
        if not n:
            return None
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        slope = max(0.0, (sxy / n - mx * my) / var) if var > 1e-9 * max(1.0, mx * mx) else 0.0
        intercept = max(0.0, my - slope * mx)
        return max(intercept + slope * rows * positions, 1e-9)


@dataclass
class GammaPlan:
    """The choice for one block: gamma, and the expected tokens per second of each gamma considered."""

    gamma: int
    tokens_per_s: dict[int, float] = field(default_factory=dict)


class AutoGamma:
    """Chooses gamma per block for every call a server makes, and learns costs and alpha from the blocks.

    Thread-safe: a replica decodes batches and streams in several threads at once, all feeding one instance."""

    def __init__(
        self,
        max_gamma: int,
        *,
        prior_alpha: float = 0.5,
        prior_weight: float = 16.0,
        memory: int = 64,
        shape_memory: int = 1024,
        shape_weight: float = 32.0,
        explore_every: int = 10,
        explore_within: float = 0.8,
        start_gamma: int | None = None,
        whole_blocks: bool = False,
        probe_tokens: int = PROBE_TOKENS,
    ) -> None:
        self.max_gamma, self.prior_alpha, self.prior_weight = max_gamma, prior_alpha, prior_weight
        #: a block's cost is measured whole (:meth:`observe_block`), not as its draft and verify steps apart
        self.whole_blocks = whole_blocks
        self.keep = 1.0 - 1.0 / memory  #: weight of the past in alpha's counts, per block
        #: the same for the counts by draft position (the shape changes slowly; it needs many blocks to be measured),
        #: and the judged tokens at which a position's own rate weighs as much as the pool's
        self.shape_keep, self.shape_weight = 1.0 - 1.0 / shape_memory, shape_weight
        self.explore_every, self.explore_within, self.probe_tokens = explore_every, explore_within, probe_tokens
        self.start_gamma = min(max_gamma, START_GAMMA) if start_gamma is None else start_gamma
        self.draft_costs, self.verify_costs = StepCosts(), StepCosts()  #: whole blocks: in verify_costs
        #: alpha key -> [accepted, judged] (decayed), draft tokens judged (not decayed)
        self.counts: dict[Hashable, list[float]] = {}
        #: alpha key without its version -> [accepted, judged] by draft position, decayed
        self.positions: dict[Hashable, list[list[float]]] = {}
        self.priors: dict[int, float] = {}  #: draft version -> its canary alpha
        self.lock = threading.Lock()
        self.blocks = 0
        self.histogram: Counter[int] = Counter()  #: every gamma chosen
        self.expected_tps: float | None = None  #: moving averages over blocks: predicted tokens/s of the choice
        self.measured_tps: float | None = None  #: and the tokens/s the block reached

    # -- alpha -------------------------------------------------------------------------------------------------
    def start_version(self, version: int, alpha: float | None) -> None:
        """A new draft version starts from ``alpha`` (its canary's); without one, from the alpha of the version
        last seen with the same settings (or ``prior_alpha``)."""
        with self.lock:
            if alpha is not None and 0.0 <= alpha <= 1.0:
                self.priors = {**dict(list(self.priors.items())[-8:]), version: alpha}  # the latest versions

    def alpha(self, key: AlphaKey) -> float:
        with self.lock:
            accepted, judged, _ = self._counts(key)
            return accepted / judged

    def rates(self, key: AlphaKey) -> list[float]:
        """The acceptance rate of each draft position given the ones before it accepted: the live alpha of ``key``
        times the shape of acceptance by position on its decoding settings (all 1 before any block)."""
        with self.lock:
            return self._rates(key)

    def _rates(self, key: AlphaKey) -> list[float]:
        accepted, judged, _ = self._counts(key)
        alpha = accepted / judged
        counts = self.positions.get(key[1:])
        if counts is None or not sum(counts[1]) or not sum(counts[0]):
            return [alpha] * self.max_gamma
        pooled = sum(counts[0]) / sum(counts[1])
        w = self.shape_weight
        return [min(1.0, alpha * (a + w * pooled) / (j + w) / pooled) for a, j in zip(*counts, strict=True)]

    def _counts(self, key: AlphaKey) -> list[float]:
        if key not in self.counts:
            if len(self.counts) >= MAX_KEYS:  # the oldest goes: clients' settings never grow it unbounded
                del self.counts[next(iter(self.counts))]
            same = [c for k, c in self.counts.items() if k[1:] == key[1:]]  # other versions, these settings
            prior = self.priors.get(key[0], same[-1][0] / same[-1][1] if same else self.prior_alpha)
            self.counts[key] = [prior * self.prior_weight, self.prior_weight, 0.0]
        return self.counts[key]

    def forget(self, keep: set[int]) -> None:
        """Drop alpha of versions other than ``keep``."""
        with self.lock:
            for key in [k for k in self.counts if k[0] not in keep]:
                del self.counts[key]

    # -- the choice ---------------------------------------------------------------------------------------------
    def plan(self, key: AlphaKey, batch: int, left: Sequence[int] | None = None) -> GammaPlan:
        """The gamma with the most expected tokens per second for a block of ``batch`` rows (ties: the smaller),
        and each gamma's expected tokens per second; before any cost is measured, ``start_gamma``. ``left``: the
        tokens each row may still emit (None: more than any block emits)."""
        with self.lock:
            return self._plan(self._rates(key), batch, left)

    def _plan(self, rates: list[float], batch: int, left: Sequence[int] | None) -> GammaPlan:
        # A row with r tokens left emits at most r: drafts past its (r - 1)th cost and add nothing.
        budgets = Counter(min(r, self.max_gamma + 1) for r in left) if left else {self.max_gamma + 1: batch}
        emits = [expected_tokens(rates, g) for g in range(self.max_gamma + 1)]
        speeds = {}
        for g in range(self.max_gamma + 1):
            seconds = self._block_seconds(batch, g)
            if seconds is None:
                return GammaPlan(self.start_gamma)
            speeds[g] = sum(n * emits[min(g, r - 1)] for r, n in budgets.items()) / seconds
        return GammaPlan(max(speeds, key=lambda g: (speeds[g], -g)), speeds)

    def _block_seconds(self, batch: int, gamma: int) -> float | None:
        verify = self.verify_costs.predict(batch, gamma + 1)
        draft = self.draft_costs.predict(batch, 1) if gamma and not self.whole_blocks else 0.0
        return None if verify is None or draft is None else gamma * draft + verify

    def choose(self, key: AlphaKey, batch: int, explore: bool = True, left: Sequence[int] | None = None) -> int:
        """Gamma for the next block of ``batch`` rows (``left``: as in :meth:`plan`): the plan's, or one block in
        ``explore_every`` a neighbour (``explore`` False: not this block, e.g. when the draft has yet to read the
        call's prompt, a cost that trying a neighbour would add and the measurement would not show)."""
        with self.lock:
            plan = self._plan(self._rates(key), batch, left)
            self.blocks += 1
            gamma = plan.gamma
            if explore and plan.tokens_per_s and self.blocks % self.explore_every == 0:
                up = gamma == 0 or (gamma < self.max_gamma and (self.blocks // self.explore_every) % 2 == 1)
                neighbour = gamma + 1 if up else gamma - 1
                if plan.tokens_per_s[neighbour] >= self.explore_within * plan.tokens_per_s[gamma]:
                    gamma = neighbour  # a clear loser is not tried (a new draft version's alpha reopens it)
            if explore and not gamma and self.max_gamma and self._counts(key)[2] < self.probe_tokens:
                gamma = 1  # a version is measured before the choice gives up on it
            self.histogram[gamma] += 1
            if plan.tokens_per_s:
                self.expected_tps = _average(self.expected_tps, plan.tokens_per_s[gamma])
            return gamma

    def observe(
        self,
        key: AlphaKey,
        batch: int,
        gamma: int,
        draft_s: float | None,
        verify_s: float | None,
        accepted: Sequence[float],
        judged: Sequence[float],
        tokens: int,
        chosen: bool = True,
    ) -> None:
        """What a block of ``batch`` rows drafting ``gamma`` tokens took: seconds drafting and verifying (None: not
        its shape's cost), draft tokens accepted and judged by draft position (all rows; see
        :func:`acceptance_by_position`), tokens emitted (all rows); ``chosen``: gamma
        was this instance's choice (the tokens/s it reached count against what it expected), not a request's fixed
        gamma."""
        with self.lock:
            self._count(key, accepted, judged)
            if draft_s is None or verify_s is None:
                return
            if gamma:
                self.draft_costs.observe(batch, 1, draft_s / gamma)
            self.verify_costs.observe(batch, gamma + 1, verify_s)
            if chosen:
                self.measured_tps = _average(self.measured_tps, tokens / max(draft_s + verify_s, 1e-9))

    def observe_block(self, batch: int, gamma: int, seconds: float | None, tokens: int) -> None:
        """``whole_blocks``: a block of ``batch`` rows drafting ``gamma`` tokens took ``seconds`` in all (None: not
        measured) and emitted ``tokens``; its shape's cost, predicted as one (the line in rows x (gamma + 1) tokens
        elsewhere, the drafts' cost folded into its slope)."""
        with self.lock:
            if seconds is not None:
                self.verify_costs.observe(batch, gamma + 1, seconds)
                self.measured_tps = _average(self.measured_tps, tokens / max(seconds, 1e-9))

    def count(self, key: AlphaKey, accepted: Sequence[float], judged: Sequence[float]) -> None:
        """Draft tokens accepted of those judged, by draft position, for the alpha of ``key`` and the shape of
        acceptance on its decoding settings."""
        with self.lock:
            self._count(key, accepted, judged)

    def _count(self, key: AlphaKey, accepted: Sequence[float], judged: Sequence[float]) -> None:
        if not sum(judged):
            return
        counts = self._counts(key)
        counts[0] = self.keep * counts[0] + sum(accepted)
        counts[1] = self.keep * counts[1] + sum(judged)
        counts[2] += sum(judged)
        shape = self.positions.get(key[1:])
        if shape is None:
            if len(self.positions) >= MAX_KEYS:
                del self.positions[next(iter(self.positions))]
            shape = self.positions[key[1:]] = [[0.0] * self.max_gamma, [0.0] * self.max_gamma]
        for i in range(self.max_gamma):
            shape[0][i] = self.shape_keep * shape[0][i] + (accepted[i] if i < len(accepted) else 0.0)
            shape[1][i] = self.shape_keep * shape[1][i] + (judged[i] if i < len(judged) else 0.0)

    def for_call(self, key: AlphaKey, fixed: int | None = None) -> BoundGamma:
        """The schedule one decoding call follows (see :class:`distillspec.decoding.speculative.GammaSchedule`): gamma
        chosen per block, or ``fixed`` (a request that names its gamma), whose blocks are measured all the same."""
        return BoundGamma(self, key, fixed)

    # -- reporting ----------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        with self.lock:
            return {
                "max_gamma": self.max_gamma,
                "chosen": {str(g): n for g, n in sorted(self.histogram.items())},
                "expected_tokens_per_s": self.expected_tps,
                "measured_tokens_per_s": self.measured_tps,
                "alpha": {_key_name(k): c[0] / c[1] for k, c in self.counts.items()},
                #: by decoding settings, each draft position's acceptance rate given the ones before it accepted
                "alpha_by_position": {
                    _settings_name(k): [round(a / j, 4) if j else None for a, j in zip(*c, strict=True)]
                    for k, c in self.positions.items()
                },
                #: the costs behind the choice: a verify step (whole blocks: a block) and a draft step, by shape
                "step_ms": {"verify": self.verify_costs.table(), "draft": self.draft_costs.table()},
            }


def _settings_name(settings: tuple) -> str:
    """An alpha key's decoding settings by name ("all": an engine that keeps one alpha over every request's)."""
    temperature, lenience, epsilon, *how = settings  # how: ("coupled",) for seeded rows (SeededNoise)
    if temperature is None:
        return "all"
    return f"T={temperature:g}" + (f" {lenience} eps={epsilon:g}" if lenience else "") + "".join(f" {h}" for h in how)


def _key_name(key: AlphaKey) -> str:
    version, *settings = key
    return f"v{version}" if key[1] is None else f"v{version} {_settings_name(tuple(settings))}"


def _average(old: float | None, new: float, keep: float = 0.95) -> float:
    return new if old is None else keep * old + (1 - keep) * new


@dataclass
class BoundGamma:
    """:class:`AutoGamma` for one call: its draft version and decoding settings fixed (and its gamma, if fixed)."""

    auto: AutoGamma
    key: AlphaKey
    fixed: int | None = None

    def choose(self, batch: int, explore: bool = True, left: Sequence[int] | None = None) -> int:
        return self.auto.choose(self.key, batch, explore, left) if self.fixed is None else self.fixed

    def observe(
        self,
        batch: int,
        gamma: int,
        draft_s: float | None,
        verify_s: float | None,
        accepted: Sequence[float],
        judged: Sequence[float],
        tokens: int,
    ) -> None:
        self.auto.observe(self.key, batch, gamma, draft_s, verify_s, accepted, judged, tokens, self.fixed is None)


class StepGamma:
    """Gamma per step of an engine that batches continuously (vLLM), in the form of vLLM's batch-size schedule:
    ``schedule[b]`` is the number of draft tokens for a step that runs ``b`` requests, chosen live by
    :class:`AutoGamma` from the alpha of the draft version being served and the measured cost of whole steps.

    A vLLM step verifies the drafts the step before it proposed and proposes the next ones, so its cost is that of
    gamma only when its predecessor drafted the same number: a choice holds for ``hold`` steps of one batch size, and
    :meth:`step_done` measures a step only when it and its predecessor ran the same rows and gamma, all decoding."""

    def __init__(self, max_gamma: int, *, hold: int = 2, **kwargs) -> None:
        self.auto = AutoGamma(max_gamma, whole_blocks=True, **kwargs)
        self.hold, self.version = hold, -1
        self.held: list[int] = [0, 0, 0]  #: [batch, gamma, steps it still holds for]
        self.last: tuple[float, int, int] | None = None  #: (when the last step ended, its rows, its gamma drafted)

    @property
    def key(self) -> AlphaKey:
        return (self.version, None, None, 1.0)

    def __getitem__(self, batch: int) -> int:
        """The gamma of the next step of ``batch`` requests (how vLLM's scheduler reads its schedule)."""
        held_batch, gamma, left = self.held
        if held_batch == batch and left > 0:
            self.held[2] -= 1
            return gamma
        gamma = self.auto.choose(self.key, batch)
        self.held = [batch, gamma, self.hold - 1]
        return gamma

    def __len__(self) -> int:
        return 1 << 30  # every batch size has an entry

    def new_version(self, version: int, alpha: float | None) -> None:
        """Steps from now on run draft ``version``; its alpha starts from ``alpha`` (its canary's) when given. The
        step running across the swap is not measured (the swap's seconds are not a step's)."""
        self.auto.start_version(version, alpha)
        self.version, self.last = version, None

    def step_done(
        self,
        end: float,
        rows: int,
        verified: list[int],
        drafted: int,
        accepted: list[int],
        tokens: int,
        decoding: bool,
    ) -> None:
        """A step of ``rows`` requests ended at ``end`` (seconds, a monotonic clock): it verified ``verified[i]``
        draft tokens of row i and accepted ``accepted[i]`` of them, emitted ``tokens``, drafted ``drafted`` per row
        for the next step; ``decoding``: no row was prefilling."""
        self.auto.count(self.key, *acceptance_by_position(verified, accepted))
        last, self.last = self.last, (end, rows, drafted)
        same = last is not None and last[1] == rows and last[2] == drafted and all(v == drafted for v in verified)
        if same and decoding:
            self.auto.observe_block(rows, drafted, end - last[0], tokens)
