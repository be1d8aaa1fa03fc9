"""A draft version as the weight store holds it, and how versions are numbered. Free of Ray: the store keeps a
reference to the weights in ``weights``, a test or a single process may keep the arrays themselves."""

from __future__ import annotations

from typing import Any, NamedTuple


class DraftVersion(NamedTuple):
    """One published draft."""

    number: int  #: the version's number: increasing and never reused in a run (:class:`VersionNumbers`)
    step: int  #: the learner step that made it
    weights: Any  #: its arrays, or where they are (in the weight store: ``[an object reference to them]``)
    sums: dict[str, str] | None  #: a checksum per tensor (:mod:`distillspec.integrity`), checked where it is loaded


class VersionNumbers:
    """Numbers a run's versions: the version made at learner step ``s`` is number ``s + shift``. The shift is 0 until
    a learner restarted from a checkpoint publishes a step it published before; it then grows just enough that the
    number is a new one, and stays until the next restart. A number never names two drafts (a refusal, a rollback
    or a consumer's "is it new?" check would hit the wrong one), and the numbers of one learner's life differ from
    its steps by a constant, which the learner learns from its first publication."""

    def __init__(self) -> None:
        self.last, self.shift = -1, 0

    def number(self, step: int) -> int:
        if step + self.shift <= self.last:
            self.shift = self.last + 1 - step
        self.last = step + self.shift
        return self.last
