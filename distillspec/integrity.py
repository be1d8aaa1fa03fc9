"""Integrity of a weight transfer: a checksum per tensor, computed by the publisher and checked by each consumer
where it loads the weights, so that weights mangled between the two (a scrambled or mismatched transfer) are
refused instead of served. Speculative decoding stays exact with a broken draft, so nothing else would fail loudly:
the service would only get slower."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from distillspec.errors import DistillSpecError

PARALLEL_BYTES = 64 * 2**20  #: weights larger than this are checksummed by several threads
MAX_THREADS = 8


class TransferRefused(DistillSpecError):
    """Weights that failed their integrity check where they were to be loaded; nothing was loaded."""


def checksum(array: np.ndarray) -> str:
    """One tensor's CRC-32 over its dtype, shape and bytes."""
    a = np.ascontiguousarray(array)
    crc = zlib.crc32(a.view(np.uint8).reshape(-1), zlib.crc32(f"{a.dtype.str}{a.shape}".encode()))
    return f"{crc:08x}"


def checksums(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """Each tensor's :func:`checksum`, several tensors at a time (zlib releases the GIL) when there is much to read.

    The threat is accidental (a transfer that mangled or mismatched tensors), not an adversary, so a fast checksum
    suffices: zlib's CRC-32 reads several GB/s per core, about five times a cryptographic hash, and every swap of
    every consumer pays it."""
    names = list(arrays)
    if sum(arrays[n].nbytes for n in names) < PARALLEL_BYTES:
        return {name: checksum(arrays[name]) for name in names}
    with ThreadPoolExecutor(min(MAX_THREADS, len(os.sched_getaffinity(0)))) as pool:
        return dict(zip(names, pool.map(checksum, (arrays[n] for n in names)), strict=True))


def mismatches(arrays: dict[str, np.ndarray], expected: dict[str, str]) -> list[str]:
    """The tensors whose checksum differs from ``expected`` (missing or extra ones included), sorted."""
    got = checksums(arrays)
    return sorted(name for name in set(got) | set(expected) if got.get(name) != expected.get(name))


def check(arrays: dict[str, np.ndarray], expected: dict[str, str], what: str = "draft weights") -> None:
    """Raise :class:`TransferRefused` naming the first mismatching tensor when ``arrays`` fail their checksums."""
    bad = mismatches(arrays, expected)
    if bad:
        raise TransferRefused(f"integrity: {what}: checksum mismatch in {len(bad)} tensors ({bad[0]})")
