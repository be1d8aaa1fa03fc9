"""The target's weights shared through the object store (actors/target.py) on a real Ray cluster."""

from __future__ import annotations

import time

import ray
import torch

from actors.common import weights_name
from actors.target import share_target, shared_target
from actors.weights import WeightStore
from distillspec.config import Models
from distillspec.models.loading import load_model


@ray.remote(num_cpus=0)
class Holder:
    """An actor that holds the target as the pipeline's actors do."""

    def __init__(self, run: str, models: Models) -> None:
        torch.set_num_threads(1)
        self.shared = shared_target(run)
        self.model = load_model(models.target, dtype=models.dtype, shared=self.shared)[0]

    def built_over_shared(self) -> bool:
        if self.shared is None:
            return False
        addresses = {a.__array_interface__["data"][0] for a in self.shared.arrays.values()}
        return all(p.data_ptr() in addresses for p in self.model.parameters())

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits


@ray.remote(num_cpus=0)
class Owner:
    """A run's driver, in an actor: it owns the shared weights and the weight store."""

    def start(self, run: str, models: Models) -> None:
        self.store = WeightStore.options(name=weights_name(run)).remote(run, share_target(models))
        ray.get(self.store.status.remote())


def test_actors_build_one_shared_target_that_outlives_its_owner(ray_cluster, tiny_garden):
    models = Models(str(tiny_garden.target), str(tiny_garden.draft), dtype="float32", prepack=False)
    own, tokenizer = load_model(models.target)
    ids = tokenizer("12+34=")["input_ids"]
    owner = Owner.remote()
    ray.get(owner.start.remote("shared-run", models))
    holders = [Holder.remote("shared-run", models) for _ in range(2)]
    assert ray.get([h.built_over_shared.remote() for h in holders]) == [True, True]
    with torch.no_grad():
        expected = own(torch.tensor([ids])).logits  # in this process's threads: equal up to the order of sums
    before = ray.get(holders[0].logits.remote(ids))
    torch.testing.assert_close(before, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ray.get(holders[1].logits.remote(ids)), before)
    # The run's driver (the owner) dies: what was built over its object goes on computing the same; a new holder
    # finds no run and loads the target from disk.
    ray.kill(owner)
    time.sleep(1)
    assert torch.equal(ray.get(holders[0].logits.remote(ids)), before)
    late = Holder.remote("shared-run", models)
    assert not ray.get(late.built_over_shared.remote())
    assert torch.equal(ray.get(late.logits.remote(ids)), before)


def test_nothing_is_shared_where_each_process_packs_its_own(tiny_garden):
    models = Models(str(tiny_garden.target), str(tiny_garden.draft), prepack=True)
    assert share_target(models) is None
    assert share_target(Models(str(tiny_garden.target), str(tiny_garden.draft), device="cuda")) is None
