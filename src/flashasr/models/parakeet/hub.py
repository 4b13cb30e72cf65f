"""Resolve a Hugging Face repo id (``nvidia/parakeet-tdt-0.6b-v3``) to a local ``.nemo`` file.

Uses ``huggingface_hub``: first ``hf_hub_download(repo_id, "<name>.nemo")`` (NVIDIA's Parakeet
repos hold one ``<repo name>.nemo``), then any ``*.nemo`` of a ``snapshot_download``. Honours
``HF_HUB_OFFLINE`` / ``HF_HUB_CACHE`` / ``HF_HOME`` read at call time (so a pre-filled cache
works without network).
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import ModelLoadError


def _truthy(v: str | None) -> bool:
    return str(v or "").strip().lower() in ("1", "true", "yes", "on")


def _cache_dir() -> str:
    from ..catalog import hub_cache_dir

    return str(hub_cache_dir())


def _find(repo_id: str, name: str, revision, cache: str, offline: bool) -> Path:
    """The ``.nemo`` of ``repo_id`` (``<name>.nemo`` if the repo has it, else its first ``*.nemo``;
    raises what huggingface_hub raises; ``offline``: the cache only). One ``snapshot_download``
    of the ``.nemo`` files: it fails at once without a network (``hf_hub_download`` retries for
    ~25 s)."""
    from huggingface_hub import snapshot_download

    root = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=["*.nemo"],
                                  local_files_only=offline))
    found = sorted(root.rglob("*.nemo"), key=lambda p: (p.name != f"{name}.nemo", str(p)))
    if not found:
        raise FileNotFoundError(f"no .nemo file in {root}")
    return found[0]


def resolve_hub_id(repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                   local_files_only: bool | None = None) -> Path:
    """Local path of the ``.nemo`` file of Hugging Face repo ``repo_id``.

    The local cache is looked at first (no network); only an id it does not hold is downloaded,
    in one attempt (a machine without a network answers in seconds, not after every retry).

    Args:
        repo_id: ``owner/name``. revision: branch/tag/commit (default main).
        cache_dir: hub cache (default: ``HF_HUB_CACHE``, ``HF_HOME``/hub, or ``~/.cache/huggingface/hub``).
        local_files_only: no network (default: true when ``HF_HUB_OFFLINE`` is set).
    Raises:
        ModelLoadError (code ``model_not_found``): not in the cache and not downloadable, or no
        ``.nemo`` file in the repo; the message names the cache and how to fill it.
    """
    try:
        import huggingface_hub  # noqa: F401
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ModelLoadError("huggingface_hub is needed to resolve hub ids") from e
    if repo_id.count("/") != 1:
        raise ModelLoadError(f"hub id {repo_id!r} must look like owner/name", code="model_not_found")
    offline = _truthy(os.environ.get("HF_HUB_OFFLINE")) if local_files_only is None else bool(local_files_only)
    cache = str(cache_dir) if cache_dir is not None else _cache_dir()
    name = repo_id.split("/", 1)[1]
    try:
        return _find(repo_id, name, revision, cache, offline=True)
    except Exception as e:  # noqa: BLE001 - not cached (huggingface_hub raises many types)
        err = e
    if not offline:
        try:
            return _find(repo_id, name, revision, cache, offline=False)
        except Exception as e:  # noqa: BLE001 - offline, 404, auth, network
            err = e
    how = "" if offline else " and not downloadable here"
    raise ModelLoadError(f"model {repo_id!r}: no .nemo file in the Hugging Face cache ({cache}){how} "
                         f"({type(err).__name__}); fill the cache where the hub is reachable "
                         f"(huggingface-cli download {repo_id}) or pass the file: --model /path/to/{name}.nemo",
                         code="model_not_found") from None


__all__ = ["resolve_hub_id"]
