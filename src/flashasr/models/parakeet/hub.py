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


def _cache_dir() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def resolve_hub_id(repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                   local_files_only: bool | None = None) -> Path:
    """Local path of the ``.nemo`` file of Hugging Face repo ``repo_id``.

    Args:
        repo_id: ``owner/name``. revision: branch/tag/commit (default main).
        cache_dir: hub cache (default: ``HF_HUB_CACHE``, ``HF_HOME``/hub, or huggingface_hub's).
        local_files_only: no network (default: true when ``HF_HUB_OFFLINE`` is set).
    Raises:
        ModelLoadError (code ``model_not_found``): not in the cache / not downloadable / no
        ``.nemo`` file in the repo.
    """
    try:
        from huggingface_hub import hf_hub_download, snapshot_download
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise ModelLoadError("huggingface_hub is needed to resolve hub ids") from e
    if repo_id.count("/") != 1:
        raise ModelLoadError(f"hub id {repo_id!r} must look like owner/name", code="model_not_found")
    offline = _truthy(os.environ.get("HF_HUB_OFFLINE")) if local_files_only is None else bool(local_files_only)
    cache = str(cache_dir) if cache_dir is not None else _cache_dir()
    name = repo_id.split("/", 1)[1]
    errors = []
    try:
        return Path(hf_hub_download(repo_id, f"{name}.nemo", revision=revision, cache_dir=cache,
                                    local_files_only=offline))
    except Exception as e:  # huggingface_hub raises many types (offline, 404, auth, network)
        errors.append(f"{type(e).__name__}: {e}")
    try:
        root = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=["*.nemo"],
                                      local_files_only=offline))
        found = sorted(root.rglob("*.nemo"))
        if found:
            return found[0]
        errors.append(f"no .nemo file in {root}")
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
    where = "the local Hugging Face cache" + (f" ({cache})" if cache else "") if offline else "Hugging Face"
    raise ModelLoadError(f"model {repo_id!r}: no .nemo file found in {where}: {errors[-1][:300]}",
                         code="model_not_found")


__all__ = ["resolve_hub_id"]
