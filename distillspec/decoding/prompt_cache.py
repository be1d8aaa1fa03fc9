"""The keys and values of prompts a model has read, for later prompts that start the same way: :class:`PromptCache`.

A served model reads many prompts that share their first tokens: a chat template's system prompt, a few-shot
preamble, the earlier turns of a conversation. Reading a prompt is most of a short request's cost on a CPU (the 1.5B
Qwen target reads 128 tokens in about 2.8 s on 2 cores of an AMD EPYC, where a decoding step takes 60 ms), and a
speculative decoder reads it twice, once a model. As vLLM's automatic prefix caching does, a prompt's tokens are cut
into blocks of :data:`BLOCK`; a block is named by its tokens and every token before it (a chain of hashes), and the
keys and values a model computed for it are kept, least recently used first out, up to a number of bytes. A later
prompt whose first blocks are held copies their keys and values into its cache and reads only the rest
(:class:`~distillspec.decoding.kvcache.CachedLM`).

The keys and values of a block depend on the model's weights: the blocks are held per model object, and a model
whose weights change in place must not share a cache (a server's new draft version is a new model object, a copy).
A prompt read after reused blocks is not read bit for bit as a whole read would: its rest is read as a step over the
blocks (its attention's sums in another order), and the blocks were computed in a read of other length. In float32
products that is float rounding; where the rows are rounded to 8 bits before their products (the few-row kernel's
4-bit and 6-bit weights, fbgemm's int8 prompts), a difference of a rounding can move a row's 8-bit rounding and grow
from layer to layer: on one GSM8K prompt with 240 of its 348 tokens reused, the 1.5B Qwen target's next-token
distribution moved by a TVD of 0.004 and the 0.5B draft's by 0.010, the argmax the same (reading a prompt's first 280
tokens or its first 240 moves their keys as much). Speculative decoding stays exact for the target as it runs.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from distillspec.errors import DistillSpecError

#: Tokens a block: the unit a prompt's keys and values are kept and found in (vLLM's default block size).
BLOCK = 16


def block_names(tokens: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """The name of each whole block of ``tokens``: a hash of the block's tokens and of the name of the block before
    it, so that a name stands for every token up to the block's end."""
    ids = np.asarray(tokens, dtype=np.int64)
    names, previous = [], b""
    for start in range(0, len(ids) - block + 1, block):
        previous = hashlib.blake2b(previous + ids[start : start + block].tobytes(), digest_size=16).digest()
        names.append(previous)
    return names


class PromptCache:
    """Blocks of prompts' keys and values, per model, up to ``max_bytes`` in all (the least recently used go first).
    A block is a pair of tensors [layers, kv_heads, block, head_dim] (keys, values), as a model's cache holds them.
    ``hits`` and ``asked`` count the prompt tokens found here and those looked up. Calls in several threads at once
    (a server's streams) take turns."""

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        if max_bytes < 0 or block < 1:
            raise DistillSpecError(
                f"a prompt cache of {max_bytes} bytes in blocks of {block} tokens: bytes >= 0, block >= 1"
            )
        self.max_bytes, self.block = max_bytes, block
        self.bytes = 0
        self.hits = self.asked = 0
        self._blocks: OrderedDict[tuple[int, bytes], tuple[Tensor, Tensor]] = OrderedDict()
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its number here
        self._numbers = 0
        self._lock = threading.RLock()  # (re-entrant: a model collected inside a call forgets its blocks in it)

    def _number(self, model: torch.nn.Module) -> int:
        """The number that stands for ``model`` in the blocks' keys; a model that is gone takes its blocks along."""
        if model not in self._models:
            self._numbers += 1
            self._models[model] = self._numbers
            weakref.finalize(model, self._forget, self._numbers)
        return self._models[model]

    def _forget(self, number: int) -> None:
        with self._lock:
            for key in [key for key in self._blocks if key[0] == number]:
                self._drop(key)

    def _drop(self, key: tuple[int, bytes]) -> None:
        keys, values = self._blocks.pop(key)
        self.bytes -= keys.nbytes + values.nbytes

    def find(self, model: torch.nn.Module, tokens: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
        """The blocks held of ``tokens``' first ones, in order (at most all but its last token: a read needs one new
        token for its logits)."""
        names = block_names(tokens[:-1], self.block)
        with self._lock:
            number, found = self._number(model), []
            for name in names:
                key = (number, name)
                if key not in self._blocks:
                    break
                self._blocks.move_to_end(key)
                found.append(self._blocks[key])
            self.asked += len(tokens)
            self.hits += len(found) * self.block
        return found

    def add(self, model: torch.nn.Module, tokens: Sequence[int], keys: Tensor, values: Tensor, held: int = 0) -> None:
        """Keep the whole blocks of ``tokens`` after the first ``held`` (found here already), whose keys and values
        are ``keys`` and ``values`` [layers, kv_heads, len(tokens), head_dim] (copied)."""
        with self._lock:
            block, number = self.block, self._number(model)
        for j, name in enumerate(block_names(tokens, block)):
            if j < held or (number, name) in self._blocks:
                continue
            kept = (keys[:, :, j * block : (j + 1) * block].clone(), values[:, :, j * block : (j + 1) * block].clone())
            size = kept[0].nbytes + kept[1].nbytes
            if size > self.max_bytes:
                return
            with self._lock:
                key = (number, name)
                if key in self._blocks:
                    continue
                while self.bytes + size > self.max_bytes:
                    self._drop(next(iter(self._blocks)))
                self._blocks[key] = kept
                self.bytes += size

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict[str, int]:
        """Blocks and bytes held, and prompt tokens looked up and found."""
        return {"blocks": len(self), "bytes": self.bytes, "tokens_looked_up": self.asked, "tokens_reused": self.hits}
