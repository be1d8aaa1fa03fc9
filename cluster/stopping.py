"""Stopping an endpoint when told: the signal its job sets once, on which every replica waits to end its streams
(:meth:`cluster.serve.Completions.stop`), and the error those streams end with."""

import asyncio

import ray

from actors.common import NAMESPACE
from distillspec.errors import DistillSpecError


@ray.remote(num_cpus=0)
class StopSignal:
    """Set once, when the job that serves an application stops (``jobs/serve.py``): each replica of the application
    waits on it, then ends its streams (:meth:`Completions.stop`)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()

    def set(self) -> None:
        self.event.set()


def stop_signal(app: str) -> ray.actor.ActorHandle:
    """The :class:`StopSignal` of Serve application ``app`` (made by whoever asks first)."""
    return StopSignal.options(name=f"stop:{app}", namespace=NAMESPACE, get_if_exists=True).remote()


class ShuttingDown(DistillSpecError):
    def __init__(self) -> None:
        super().__init__("the server is shutting down: the completion is incomplete; retry on another server")
