"""The prompt log of online distillation: the Serve endpoint adds the prompts it serves, rollout actors sample
training prompts from the most recent ones (online speculative decoding: the draft learns the live traffic). With
``serve.record_samples`` the endpoint also adds its completions with the target's scores, and rollout actors take
them as batches of the target's samples (``rollout.online_samples``)."""

from __future__ import annotations

import random
import threading
from collections import deque

import ray

from actors.dashboard import count
from distillspec.training.batches import ServedSample


@ray.remote(num_cpus=0, max_concurrency=8)
class PromptLog:
    def __init__(self, run: str, window: int, seed: int = 0) -> None:
        self.run, self.recent, self.rng, self.received = run, deque(maxlen=window), random.Random(seed), 0
        self.samples: deque[ServedSample] = deque(maxlen=window)  #: served completions not trained on yet
        self.samples_received = self.samples_taken = 0
        self.lock = threading.Lock()  #: the actor serves calls on several threads: two takes never share a sample

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

    def add_samples(self, samples: list[ServedSample]) -> None:
        """Served completions with the target's scores (the oldest fall out past the window)."""
        with self.lock:
            self.samples.extend(s for s in samples if isinstance(s, ServedSample) and s.tokens)
            self.samples_received += len(samples)
        count("distillspec_online_samples", len(samples), run=self.run)

    def take_samples(self, n: int, temperature: float) -> list[ServedSample]:
        """The ``n`` newest served samples drawn at ``temperature``, removed from the log (each trains once); none
        while it holds fewer."""
        with self.lock:
            matching = [i for i, s in enumerate(self.samples) if s.temperature == temperature]
            if len(matching) < n:
                return []
            taken = set(matching[-n:])
            out = [s for i, s in enumerate(self.samples) if i in taken]
            kept = (s for i, s in enumerate(self.samples) if i not in taken)
            self.samples = deque(kept, maxlen=self.samples.maxlen)
            self.samples_taken += len(out)
            return out

    def stats(self) -> dict:
        return {
            "received": self.received,
            "held": len(self.recent),
            "samples_received": self.samples_received,
            "samples_held": len(self.samples),
            "samples_taken": self.samples_taken,
        }
