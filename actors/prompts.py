"""The prompt log of online distillation: the Serve endpoint adds the prompts it serves, rollout actors sample
training prompts from the most recent ones (online speculative decoding: the draft learns the live traffic)."""

from __future__ import annotations

import random
from collections import deque

import ray

from actors.dashboard import count


@ray.remote(num_cpus=0, max_concurrency=8)
class PromptLog:
    def __init__(self, run: str, window: int, seed: int = 0) -> None:
        self.run, self.recent, self.rng, self.received = run, deque(maxlen=window), random.Random(seed), 0

    def add(self, prompts: list[str]) -> None:
        self.recent.extend(p for p in prompts if isinstance(p, str) and p)
        self.received += len(prompts)
        count("distillspec_online_prompts", len(prompts), run=self.run)

    def sample(self, n: int, at_least: int = 0) -> list[str]:
        """Up to ``n`` distinct recent prompts (fewer while the log holds fewer; none while it holds under
        ``at_least``)."""
        if len(self.recent) < at_least:
            return []
        return self.rng.sample(list(self.recent), min(n, len(self.recent)))

    def stats(self) -> dict:
        return {"received": self.received, "held": len(self.recent)}
