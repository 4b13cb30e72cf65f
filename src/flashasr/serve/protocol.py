"""Client requests into objects, and the reply shapes that are not a Transcript rendering.

Nothing here does I/O or touches a model: every function maps what a client sent to a value
(or raises a :class:`~flashasr.errors.FlashASRError` subclass with ``code`` and ``param``, which
:mod:`.errors` turns into OpenAI's error JSON or a WebSocket ``error`` event).

==========================================  ==================================================
input                                       object
==========================================  ==================================================
multipart form of ``/v1/audio/*``           :class:`UploadRequest` (:func:`parse_upload`)
``session.update`` /                        :class:`SessionUpdate` (:func:`parse_session_update`)
``transcription_session.update`` body
``/v1/stream`` query string                 :class:`StreamQuery` (:func:`parse_stream_query`)
==========================================  ==================================================

Every door builds one :class:`~flashasr.options.TranscribeOptions`: its ``language`` follows
the options' one rule (ISO 639-1, case-insensitive, region dropped, English names accepted) and
is checked against the model (:meth:`~flashasr.options.TranscribeOptions.resolve`) before any
work starts: a door gets the model's capabilities first (:meth:`.context.ServeContext.capabilities`:
it waits for the engine; while they are not known, an upload gets a 503 and a WebSocket is
refused), so the functions here take them, never None. Replies: :func:`session_view` (the ``session`` object of
``*.created`` / ``*.updated``) and :func:`sse_events` (``stream=true`` of an upload).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..formats import FORMATS
from ..options import ModelCapabilities, TranscribeOptions
from ..types import Transcript
from .errors import APIError
from .stream import SR, check_rate

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off", "")


def _flag(value, param: str) -> bool:
    """A boolean form or query field: ``true/1/yes/on`` or ``false/0/no/off`` (any case; absent or
    empty: false). Raises APIError (``invalid_request``, ``param``) for anything else
    (``stream=maybe`` was read as false)."""
    v = str(value if value is not None else "").strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise APIError(f"{param} must be true or false; got {_short(value)}", param=param)
UNCHANGED = object()  # a SessionUpdate field the update did not name


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _number(value, param: str, lo: float | None = None, hi: float | None = None) -> float:
    """A finite number (a JSON number or its text) within ``[lo, hi]``; else APIError naming ``param``."""
    try:
        if isinstance(value, bool):
            raise ValueError
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise APIError(f"{param} must be a number; got {_short(value)}", param=param) from None
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else ""
        raise APIError(f"{param} must be a finite number{rng}; got {_short(value)}", param=param)
    return v


# ----------------------------------------------------------------------------- uploads
@dataclass(frozen=True)
class UploadRequest:
    """The form of ``POST /v1/audio/transcriptions`` / ``translations`` (all but the file).

    Attributes:
        options: the request's options (not yet resolved against the model).
        response_format: one of :data:`flashasr.formats.FORMATS`.
        words: ``timestamp_granularities[]`` holds ``word``.
        stream: ``stream=true`` (Server-Sent Events).
    """

    options: TranscribeOptions
    response_format: str = "json"
    words: bool = False
    stream: bool = False


def parse_upload(form, task: str) -> UploadRequest:
    """Read the form fields of an upload (``form.get(name)`` / ``form.getlist(name)``).

    Fields: ``response_format``, ``timestamp_granularities[]`` (verbose_json only, as OpenAI),
    ``language``, ``temperature`` (in [0, 1]) and ``prompt`` (used by Whisper; a model that cannot use
    them says so in the ``X-Flashasr-Ignored`` response header), ``model`` (accepted, ignored),
    ``stream``; extensions ``segmentation`` (``vad`` | ``fixed`` | ``none``) and ``max_segment_s``.
    ``task`` comes from the route.

    Raises:
        APIError (``unsupported_response_format``, ``invalid_request``), InvalidRequestError
        (``invalid_request``, param ``language`` / ``segmentation`` / ``max_segment_s``).
    """
    fmt = form.get("response_format") or "json"
    if fmt not in FORMATS:
        raise APIError(f"response_format must be one of {', '.join(FORMATS)}; got {fmt!r}",
                       param="response_format", code="unsupported_response_format")
    gran = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
    bad = [g for g in gran if g not in ("word", "segment")]
    if bad:
        raise APIError(f"timestamp_granularities must be 'segment' and/or 'word'; got {_short(bad[0])}",
                       param="timestamp_granularities[]")
    if gran and fmt != "verbose_json":  # OpenAI's rule: only verbose_json carries them
        raise APIError(f"timestamp_granularities needs response_format verbose_json; got {fmt!r}",
                       param="timestamp_granularities[]")
    temp = (form.get("temperature") or "").strip()
    max_s = (form.get("max_segment_s") or "").strip()
    options = TranscribeOptions(language=form.get("language"), task=task, word_timestamps="word" in gran,
                                segmentation=(form.get("segmentation") or "").strip() or "vad",
                                max_segment_s=_number(max_s, "max_segment_s") if max_s else None,
                                prompt=form.get("prompt") or None,
                                temperature=_number(temp, "temperature", 0.0, 1.0) if temp else None)
    return UploadRequest(options, fmt, "word" in gran, _flag(form.get("stream"), "stream"))


def sse_pieces(transcript: Transcript) -> list[str]:
    """One delta per segment, cut out of the final text itself, so the deltas concatenate to
    exactly the ``done`` text (segment texts carry their own leading spaces, or none)."""
    done = transcript.text.strip()
    pieces, pos = [], 0
    for seg in transcript.segments:
        t = (seg.text or "").strip()
        i = done.find(t, pos) if t else -1
        if i < 0:
            continue
        pieces.append(done[pos:i + len(t)])
        pos = i + len(t)
    if pos < len(done):
        pieces.append(done[pos:])
    return [p for p in pieces if p]


async def sse_events(transcript: Transcript):
    """``transcript.text.delta`` events (:func:`sse_pieces`), then ``transcript.text.done``."""
    for p in sse_pieces(transcript):
        yield "data: " + json.dumps({"type": "transcript.text.delta", "delta": p}, ensure_ascii=False) + "\n\n"
    yield "data: " + json.dumps({"type": "transcript.text.done", "text": transcript.text.strip()},
                                ensure_ascii=False) + "\n\n"


# ----------------------------------------------------------------------------- streams
def default_turn_detection(cfg) -> dict:
    """Server VAD settings of a new stream (``--vad-*`` options)."""
    return {"type": "server_vad", "threshold": cfg.vad_threshold, "prefix_padding_ms": cfg.vad_prefix_padding_ms,
            "silence_duration_ms": cfg.vad_silence_duration_ms}


def stream_options(language, caps: ModelCapabilities) -> TranscribeOptions:
    """A stream's options, checked against the model: the whole utterance is one model input
    (``segmentation="none"``)."""
    return TranscribeOptions(language=language, segmentation="none").resolve(caps)


def parse_turn_detection(td, cfg) -> dict | None:
    """``null`` or ``{"type": "server_vad", threshold, prefix_padding_ms, silence_duration_ms}``
    (missing values from ``cfg``) -> the turn detection dict, or None (manual commits)."""
    if td is None:
        return None
    if not isinstance(td, dict) or td.get("type", "server_vad") != "server_vad":
        raise APIError("turn_detection must be null or {'type': 'server_vad', ...}", param="turn_detection")
    base = default_turn_detection(cfg)
    msg = ("turn_detection: threshold must be in (0, 1), prefix_padding_ms in [0, 5000], "
           "silence_duration_ms in (0, 10000]")
    try:
        out = {"type": "server_vad",
               "threshold": _number(td.get("threshold", base["threshold"]), "turn_detection.threshold", 0.0, 1.0),
               "prefix_padding_ms": int(_number(td.get("prefix_padding_ms", base["prefix_padding_ms"]),
                                                "turn_detection.prefix_padding_ms", 0, 5000)),
               "silence_duration_ms": int(_number(td.get("silence_duration_ms", base["silence_duration_ms"]),
                                                  "turn_detection.silence_duration_ms", 0, 10000))}
    except APIError:
        out = None
    if out is None or not 0.0 < out["threshold"] < 1.0 or out["silence_duration_ms"] <= 0:
        raise APIError(msg, param="turn_detection")
    return out


def _object(value, param: str) -> dict:
    """An optional JSON object: None -> {}; anything but an object -> APIError naming ``param``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise APIError(f"{param} must be an object; got {_short(value)}", param=param)
    return value


MAX_PARTIAL_INTERVAL_MS = 60000.0  # partials at most a minute apart (0: none)


@dataclass(frozen=True)
class SessionUpdate:
    """What a Realtime session update changes; a field the update did not name is :data:`UNCHANGED`.

    Attributes:
        options: the session's new :class:`~flashasr.options.TranscribeOptions` (resolved).
        rate: input sample rate in Hz.
        partial_interval: new audio between two partials, in 16 kHz samples.
        turn_detection: a turn detection dict or None (manual commits).
    """

    options: object = UNCHANGED
    rate: object = UNCHANGED
    partial_interval: object = UNCHANGED
    turn_detection: object = UNCHANGED


def parse_session_update(sess, options: TranscribeOptions, caps: ModelCapabilities, cfg) -> SessionUpdate:
    """A ``transcription_session.update`` (beta shape) or ``session.update`` (GA shape:
    ``session.audio.input.{format, transcription, turn_detection}``) body -> :class:`SessionUpdate`.

    The language follows the options' rule and is checked against the model here, so a language
    the model cannot take is refused at the update (the session keeps its options). Nothing is
    applied when any field is refused.

    Raises:
        APIError (``invalid_request``, ``unsupported_format``, ``invalid_sample_rate``),
        InvalidRequestError (``invalid_request``, param ``language``), UnsupportedLanguageError.
    """
    if not isinstance(sess, dict):
        raise APIError("'session' must be an object", param="session")
    audio = _object(sess.get("audio"), "session.audio")
    audio_in = _object(audio.get("input"), "session.audio.input")
    fmt, rate, f2 = sess.get("input_audio_format"), sess.get("input_audio_sample_rate"), audio_in.get("format")
    if fmt is not None and fmt != "pcm16":
        raise APIError(f"input_audio_format {fmt!r} is not supported; use 'pcm16'", param="input_audio_format",
                       code="unsupported_format")
    if isinstance(f2, dict):
        if f2.get("type", "audio/pcm") != "audio/pcm":
            raise APIError(f"audio format {f2.get('type')!r} is not supported; use 'audio/pcm'",
                           param="audio.input.format", code="unsupported_format")
        rate = f2.get("rate", rate)
    tr = _object(sess.get("input_audio_transcription") or audio_in.get("transcription"),
                 "input_audio_transcription")
    upd: dict = {}
    changes = {k: tr.get(k) or None for k in ("language", "prompt") if k in tr}
    if changes:
        upd["options"] = TranscribeOptions.build(options, **changes).resolve(caps)
    if rate is not None:
        upd["rate"] = check_rate(rate)
    pi = sess.get("partial_interval_ms", tr.get("partial_interval_ms"))
    if pi is not None:
        upd["partial_interval"] = int(_number(pi, "partial_interval_ms", 0, MAX_PARTIAL_INTERVAL_MS) * SR / 1000)
    if "turn_detection" in sess or "turn_detection" in audio_in:
        td = sess["turn_detection"] if "turn_detection" in sess else audio_in["turn_detection"]
        upd["turn_detection"] = parse_turn_detection(td, cfg)
    return SessionUpdate(**upd)


@dataclass(frozen=True)
class StreamQuery:
    """The query string of ``/v1/stream``: ``sample_rate`` (default 16000), ``language``,
    ``vad`` (default false), ``partial_interval_ms``, ``partials`` (``delta`` | ``full``)."""

    rate: int
    options: TranscribeOptions
    turn_detection: dict | None
    partial_interval_ms: float
    full_partials: bool


def parse_stream_query(q, caps: ModelCapabilities, cfg) -> StreamQuery:
    """Raises APIError (``invalid_sample_rate``, ``invalid_request``), InvalidRequestError,
    UnsupportedLanguageError."""
    rate = check_rate(q.get("sample_rate", "16000"))
    options = stream_options(q.get("language"), caps)
    use_vad = _flag(q.get("vad"), "vad")
    pi = _number(q.get("partial_interval_ms", cfg.partial_interval_ms), "partial_interval_ms", 0,
                 MAX_PARTIAL_INTERVAL_MS)
    partials = str(q.get("partials") or "delta").strip().lower()
    if partials not in ("delta", "full"):
        raise APIError(f"partials must be delta or full; got {_short(q.get('partials'))}", param="partials")
    return StreamQuery(rate, options, default_turn_detection(cfg) if use_vad else None, pi, partials == "full")


def session_view(s, turn_detection: dict | None, caps: ModelCapabilities) -> dict:
    """The ``session`` object of ``*.created`` / ``*.updated`` events for session ``s`` on the model
    of ``caps``: ``input_audio_transcription`` carries the model's name, the session's ``prompt``
    and (extension) ``ignored``, the options the model accepts without using them (``["prompt"]``
    on Parakeet-TDT), as the HTTP door's ``X-Flashasr-Ignored`` header says."""
    tr = {"model": caps.name, "language": s.language, "prompt": s.options.prompt}
    ignored = caps.ignored(s.options)
    if ignored:
        tr["ignored"] = ignored
    return {"id": s.id, "object": "realtime.transcription_session", "input_audio_format": "pcm16",
            "input_audio_sample_rate": s.resampler.rate, "input_audio_transcription": tr,
            "turn_detection": turn_detection, "partial_interval_ms": s.partial_interval * 1000 // SR}


__all__ = ["UploadRequest", "parse_upload", "sse_pieces", "sse_events", "SessionUpdate", "parse_session_update",
           "StreamQuery", "parse_stream_query", "parse_turn_detection", "default_turn_detection",
           "stream_options", "session_view", "UNCHANGED", "TRUE"]
