"""Render a :class:`~flashasr.types.Transcript` as text, json, srt, vtt or verbose_json.

The shapes follow OpenAI's ``/v1/audio/transcriptions`` response formats.
"""

from __future__ import annotations

import json

from .errors import FlashASRError
from .types import Transcript

FORMATS = ("text", "json", "srt", "vtt", "verbose_json")
EXTENSIONS = {"text": "txt", "json": "json", "srt": "srt", "vtt": "vtt", "verbose_json": "verbose.json"}


def _ts(seconds: float, sep: str) -> str:
    ms = int(round(max(seconds, 0.0) * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(t: Transcript) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``."""
    out = []
    for i, seg in enumerate((s for s in t.segments if s.text.strip()), start=1):
        out.append(f"{i}\n{_ts(seg.start, ',')} --> {_ts(seg.end, ',')}\n{seg.text.strip()}\n")
    return "\n".join(out)


def to_vtt(t: Transcript) -> str:
    """WebVTT: ``WEBVTT`` header, ``HH:MM:SS.mmm --> HH:MM:SS.mmm`` cues."""
    out = ["WEBVTT\n"]
    for seg in t.segments:
        if seg.text.strip():
            out.append(f"{_ts(seg.start, '.')} --> {_ts(seg.end, '.')}\n{seg.text.strip()}\n")
    return "\n".join(out)


def render(t: Transcript, fmt: str, *, words: bool | None = None) -> str:
    """Render ``t`` in ``fmt`` (one of :data:`FORMATS`). Raises FlashASRError(code=unsupported_response_format)."""
    if fmt == "text":
        return t.text.strip() + "\n"
    if fmt == "json":
        return json.dumps({"text": t.text.strip()}, ensure_ascii=False)
    if fmt == "verbose_json":
        return json.dumps(t.to_dict(words=words), ensure_ascii=False)
    if fmt == "srt":
        return to_srt(t)
    if fmt == "vtt":
        return to_vtt(t)
    err = FlashASRError(f"unsupported response format {fmt!r}; choose one of {', '.join(FORMATS)}",
                        code="unsupported_response_format")
    err.status = 400
    raise err
