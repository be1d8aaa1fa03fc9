"""Integrity of a weight transfer: a checksum per tensor, computed by the publisher and checked by each consumer
where it loads the weights, so that weights mangled between the two (a scrambled or mismatched transfer) are
refused instead of served. Speculative decoding stays exact with a broken draft, so nothing else would fail loudly:
the service would only get slower."""

from __future__ import annotations

import zlib

import numpy as np

from distillspec.errors import DistillSpecError


class TransferRefused(DistillSpecError):
    """Weights that failed their integrity check where they were to be loaded; nothing was loaded."""


def checksums(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """Each tensor's CRC-32 over its dtype, shape and bytes. The threat is accidental (a transfer that mangled or
    mismatched tensors), not an adversary, so a fast checksum suffices: zlib's CRC-32 runs at several GB/s per core,
    about five times a cryptographic hash, and every swap of every consumer pays it."""
    out = {}
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        crc = zlib.crc32(a.view(np.uint8).reshape(-1), zlib.crc32(f"{a.dtype.str}{a.shape}".encode()))
        out[name] = f"{crc:08x}"
    return out


def mismatches(arrays: dict[str, np.ndarray], expected: dict[str, str]) -> list[str]:
    """The tensors whose checksum differs from ``expected`` (missing or extra ones included), sorted."""
    got = checksums(arrays)
    return sorted(name for name in set(got) | set(expected) if got.get(name) != expected.get(name))


def check(arrays: dict[str, np.ndarray], expected: dict[str, str], what: str = "draft weights") -> None:
    """Raise :class:`TransferRefused` naming the first mismatching tensor when ``arrays`` fail their checksums."""
    bad = mismatches(arrays, expected)
    if bad:
        raise TransferRefused(f"integrity: {what}: checksum mismatch in {len(bad)} tensors ({bad[0]})")
