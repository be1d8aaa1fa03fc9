"""A draft version as the weight store holds it, the form its weights travel in, and how versions are numbered.
Free of Ray and of torch (the weight store's process imports neither): the store keeps a reference to the weights in
``weights``, a test or a single process may keep the arrays themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import numpy as np
    import torch


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


def state_arrays(model: torch.nn.Module, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The model's weights as numpy arrays, its floating-point tensors in ``dtype`` (float32 or float16; others as
    they are): the form a draft version travels in (read zero-copy by every puller on a node) and is checksummed in
    (:func:`distillspec.models.loading.load_arrays` reads them back into a model's own dtypes)."""
    model = getattr(model, "module", model)  # DDP
    cast = {"float32": "float", "float16": "half"}[dtype]
    return {
        k: (getattr(v.detach(), cast)() if v.is_floating_point() else v.detach()).cpu().numpy()
        for k, v in model.state_dict().items()
    }
