"""The weight store: a named actor keeping the latest published draft version in the object store."""

from __future__ import annotations

import numpy as np
import ray
import torch

from actors.metrics import gauge


def state_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's weights as numpy arrays (read zero-copy by every puller on a node)."""
    model = getattr(model, "module", model)  # DDP
    return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


def load_arrays(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(torch.from_numpy(np.array(arrays[name])))


def publish(store: ray.actor.ActorHandle, model: torch.nn.Module, version: int, record: dict | None = None) -> None:
    """Put the weights into the object store and make them the latest version; ``record`` is the learner's log
    record of the step that made it (the driver's console shows it).

    The publisher owns the object; if it dies, pullers keep their weights until its successor publishes again.
    """
    ref = ray.put(state_arrays(model))
    ray.get(store.publish.remote(version, [ref], record))


@ray.remote(num_cpus=0, max_concurrency=8)
class WeightStore:
    """Holds one reference: the latest version. Replacing it releases the previous version's object."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.current: tuple[int, list[ray.ObjectRef]] | None = None
        self.published = 0
        self.record: dict | None = None

    def publish(self, version: int, refs: list[ray.ObjectRef], record: dict | None = None) -> None:
        self.current = (version, refs)
        self.published += 1
        self.record = record or self.record
        gauge("distillspec_weight_version", version, run=self.run)

    def version(self) -> int:
        """The latest version, or -1 before the first publish."""
        return -1 if self.current is None else self.current[0]

    def status(self) -> tuple[int, dict | None]:
        """The latest version and the learner's record of the step that made it."""
        return self.version(), self.record

    def latest(self) -> tuple[int, list[ray.ObjectRef]] | None:
        return self.current


def fetch(store: ray.actor.ActorHandle, have: int) -> tuple[int, dict[str, np.ndarray] | None]:
    """The store's latest version and its weights when newer than version ``have``, else ``(have, None)``."""
    if ray.get(store.version.remote()) in (have, -1):
        return have, None
    version, refs = ray.get(store.latest.remote())
    try:
        return version, ray.get(refs[0])
    except ray.exceptions.ObjectLostError:
        return have, None  # the publisher died; its successor publishes again


def pull(store: ray.actor.ActorHandle, model: torch.nn.Module, have: int) -> int:
    """Load the store's latest weights into ``model`` when newer than version ``have``; returns the version."""
    version, arrays = fetch(store, have)
    if arrays is not None:
        load_arrays(model, arrays)
    return version
