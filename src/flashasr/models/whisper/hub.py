"""Resolve a Hugging Face repo id of Whisper weights (``openai/whisper-large-v3``,
``Systran/faster-whisper-small``) to a local folder :func:`~.loaders.load_whisper` reads.

Uses ``huggingface_hub.snapshot_download`` with only the files a loader needs (configs, tokenizer,
``*.safetensors`` or CTranslate2's ``model.bin``); honours ``HF_HUB_OFFLINE`` / ``HF_HUB_CACHE`` /
``HF_HOME`` at call time, so a filled cache works without a network.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import ModelLoadError
from ..catalog import hub_cache_dir

_PATTERNS = ["*.json", "*.txt", "*.safetensors", "model.bin", "vocabulary.*"]


def resolve_whisper_repo(repo_id: str) -> Path:
    """Local folder of Whisper repo ``repo_id`` (downloaded unless offline or already cached).

    Raises:
        ModelLoadError (``model_not_found``): not in the cache and not downloadable (the message
            says where the cache is and how to fill it), or ``huggingface_hub`` missing.
    """
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelLoadError(f"model {repo_id!r}: hub ids need huggingface_hub (pip install 'flashasr[hub]'), "
                             "or pass the local folder of the weights", code="model_not_found") from e
    offline = str(os.environ.get("HF_HUB_OFFLINE", "")).strip().lower() in ("1", "true", "yes", "on")
    # huggingface_hub reads its cache path once, at import; pass the one the environment names now
    cache = str(hub_cache_dir())
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_PATTERNS, local_files_only=offline, cache_dir=cache))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types (offline, 404, auth, network)
        if not offline:
            try:  # no network: the cache may still hold it
                return Path(snapshot_download(repo_id, allow_patterns=_PATTERNS, local_files_only=True,
                                              cache_dir=cache))
            except Exception:  # noqa: BLE001
                pass
        raise ModelLoadError(f"model {repo_id!r}: not in the Hugging Face cache ({hub_cache_dir()}) and not "
                             f"downloadable here ({type(e).__name__}); fill the cache where the hub is reachable "
                             f"(huggingface-cli download {repo_id}) or pass the local folder of the weights",
                             code="model_not_found") from None


__all__ = ["resolve_whisper_repo"]
