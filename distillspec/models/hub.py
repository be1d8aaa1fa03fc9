"""Whether the Hugging Face Hub can be reached, checked once and fast, so that a hub id or a ``datasets`` name fails
at once with one line when it cannot (instead of the libraries' retries)."""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import try_to_load_from_cache

from distillspec.errors import DistillSpecError

TRUE = ("1", "true", "yes", "on")


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


@lru_cache
def reachable(timeout_s: float = 3.0) -> bool:
    """False in offline mode (``HF_HUB_OFFLINE``) or when a TCP connection to the hub's endpoint fails."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in TRUE:
        return False
    url = urlparse(endpoint())
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s):
            return True
    except OSError:
        return False


def cached_model(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id``'s config (then it loads without the hub)."""
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # not a valid repo id
        return False


def cached_dataset(name: str) -> bool:
    """Whether the ``datasets`` cache holds anything built from ``name``."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    root = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets"))
    return root.is_dir() and any(root.glob(f"*{name.replace('/', '___')}*"))


def require(name: str, kind: str) -> None:
    """Raise one line when the hub ``kind`` (``model`` or ``dataset``) ``name`` can come neither from the local cache
    nor from a reachable hub."""
    cached = cached_model(name) if kind == "model" else cached_dataset(name)
    if cached or reachable():
        return
    raise DistillSpecError(
        f"{kind} {name!r} is not a local path, not in the local Hugging Face cache, and the hub ({endpoint()}) "
        f"cannot be reached{' (HF_HUB_OFFLINE is set)' if os.environ.get('HF_HUB_OFFLINE', '').lower() in TRUE else ''}"
        f": give a local {'folder made by save_pretrained' if kind == 'model' else 'data path'}"
        + ("" if kind == "model" else ", or the embedded default 'arith'")
    )
