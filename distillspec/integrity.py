"""Integrity of a weight transfer: a checksum per tensor, computed by the publisher and checked by each consumer
where it loads the weights, so that weights mangled between the two (a scrambled or mismatched transfer) are
refused instead of served. Speculative decoding stays exact with a broken draft, so nothing else would fail loudly:
the service would only get slower."""

from __future__ import annotations

import hashlib

import numpy as np


def checksums(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    """Each tensor's BLAKE2b digest (over its dtype, shape and bytes)."""
    out = {}
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        digest = hashlib.blake2b(f"{a.dtype.str}{a.shape}".encode(), digest_size=16)
        digest.update(a.view(np.uint8).reshape(-1))
        out[name] = digest.hexdigest()
    return out


def mismatches(arrays: dict[str, np.ndarray], expected: dict[str, str]) -> list[str]:
    """The tensors whose checksum differs from ``expected`` (missing or extra ones included), sorted."""
    got = checksums(arrays)
    return sorted(name for name in set(got) | set(expected) if got.get(name) != expected.get(name))
