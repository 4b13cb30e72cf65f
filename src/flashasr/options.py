"""What a caller asks for, and what a model can do: the two objects every layer shares.

:class:`TranscribeOptions` is built once at each door (CLI flags, HTTP form fields, a Realtime
session, Python keywords), checked for syntax when it is built, checked against the model once
(:meth:`TranscribeOptions.resolve` over the model's :class:`ModelCapabilities`), and then carried
unchanged through the pipeline, the batching scheduler, the engine socket (``to_dict`` /
``from_dict``) and the job runner. Adding an option touches this file and the model that uses
it, nothing in between.

Fields (all immutable, so an options object is hashable and can key a batch):

==================  =====================================================================
``language``        ISO 639-1 code (``"en"``) or None (detect, or the model's own). Accepted
                    case-insensitively, with a region (``"en-US"``) or as an English language
                    name (``"english"``); stored as the bare lower-case code.
``task``            ``"transcribe"`` or ``"translate"`` (English text from speech in another
                    language: Whisper's ``<|translate|>`` token).
``word_timestamps`` fill ``Transcript.words``.
``segmentation``    how long audio is cut into pieces before the model sees it: ``"vad"``
                    (at pauses, Silero VAD; stretches without speech are left out), ``"fixed"``
                    (consecutive windows) or ``"none"`` (the model's own long-form procedure:
                    Whisper's 30 s seek; a model without one is cut at pauses once the audio is
                    longer than its window). See :mod:`flashasr.pipeline.plan`.
``max_segment_s``   longest piece in seconds (>= 1); None: the model's window. Clamped to the window.
``prompt``          text that conditions the decoding (Whisper's initial prompt: spellings,
                    names, style), given to the first window of every piece; None: none.
``temperature``     the first decoding temperature (0..1; Whisper: greedy at 0, sampling above,
                    then the fallback schedule upward in steps of 0.2); None: 0.
==================  =====================================================================

A model that does not use ``prompt`` or ``temperature`` (Parakeet-TDT) accepts them and says so:
:meth:`ModelCapabilities.ignored` (the server answers with an ``X-Flashasr-Ignored`` header).

The model sees ``language``, ``task``, ``word_timestamps``, ``prompt`` and ``temperature``
(:attr:`~TranscribeOptions.decoding`);
``segmentation`` and ``max_segment_s`` are the pipeline's. Pieces whose ``decoding`` is equal may
share one model call.

The shape follows openai/whisper's frozen ``DecodingOptions`` and vLLM's request parameters
object that crosses processes unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields, replace

from .errors import InvalidRequestError, UnsupportedLanguageError, UnsupportedTaskError
from .languages import LANGUAGE_NAMES

TASKS = ("transcribe", "translate")
SEGMENTATIONS = ("vad", "fixed", "none")
MAX_PROMPT_CHARS = 4000
MIN_SEGMENT_S = 1.0  # shorter pieces lose context and multiply model calls (0.001 s: 3,000 per 3 s clip)

_CODE_OF_NAME = {name: code for code, name in LANGUAGE_NAMES.items()}
_TAG = re.compile(r"([a-z]{2,3})(?:[-_][a-z0-9]{2,8})*")


def _short(value) -> str:
    """``repr(value)``, cut to 60 characters (error messages never echo a whole payload)."""
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def normalize_language(value) -> str | None:
    """The one language rule of every door: ``None``/``""`` -> None; else an ISO 639-1 code.

    Case-insensitive; a region subtag is dropped (``"en-US"``, ``"pt_BR"`` -> ``"en"``, ``"pt"``);
    an English language name is accepted (``"German"`` -> ``"de"``). Codes are Whisper's list
    (:data:`flashasr.languages.LANGUAGE_NAMES`), which holds every language either family knows.

    Raises:
        InvalidRequestError (``invalid_request``, param ``language``): anything else, e.g. ``"xx"``
            or ``"english!"`` -- the message names the valid form.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequestError(f"language must be a string such as 'en'; got {_short(value)}", param="language")
    s = value.strip().lower()
    if not s:
        return None
    m = _TAG.fullmatch(s)  # "en", "en-US", "pt_BR", "zh-Hant-TW": the primary subtag
    if m and m.group(1) in LANGUAGE_NAMES:
        return m.group(1)
    if s in _CODE_OF_NAME:
        return _CODE_OF_NAME[s]
    raise InvalidRequestError(f"language {_short(value)} is not a language code; use an ISO 639-1 code such as 'en' "
                              "or 'de' (or an English language name such as 'german')", param="language")


@dataclass(frozen=True)
class ModelCapabilities:
    """What a loaded model can do: what doors and the pipeline ask instead of copying its rules.

    Attributes:
        name: model name (``whisper-tiny.en``, ``parakeet-tdt-0.6b-v3``, ...).
        family: ``"whisper"`` or ``"parakeet"``.
        sample_rate: input rate in Hz (16000 for both families).
        window_s: the longest audio one encoder pass takes (Whisper 30 s; Parakeet 60 s on the CPU,
            the largest encoder profile on the GPU engine): the pipeline's longest piece.
        long_form: the model has its own procedure for audio longer than ``window_s`` (Whisper's
            seek loop); without it, ``segmentation="none"`` still cuts longer audio at pauses.
        languages: codes the ``language`` hint may take, or None when the hint does not steer the
            model (Parakeet-TDT: any code is accepted and echoed in the result).
        multilingual: ``language=None`` detects the language (Whisper) / the vocabulary covers
            several languages (Parakeet v3).
        translates: ``task="translate"`` is possible (multilingual Whisper).
        prompts: the ``prompt`` option conditions the decoding (Whisper).
        temperature: the ``temperature`` option is used (Whisper).
        speech_gate: a recording that fits one window goes to the model only when the VAD finds
            speech in it (Whisper, which invents text on silence and noise); False: it goes in
            whole without the VAD (Parakeet-TDT: its decoder emits blanks on non-speech), the VAD
            runs only where a recording must be cut (:func:`flashasr.pipeline.plan_pieces`).
    """

    name: str = "model"
    family: str = "unknown"
    sample_rate: int = 16000
    window_s: float = 30.0
    long_form: bool = False
    languages: frozenset | None = None
    multilingual: bool = False
    translates: bool = False
    prompts: bool = False
    temperature: bool = False
    speech_gate: bool = True

    def ignored(self, options: "TranscribeOptions") -> list[str]:
        """Options set in ``options`` that this model does not use (accepted, without effect)."""
        out = []
        if options.prompt is not None and not self.prompts:
            out.append("prompt")
        if options.temperature not in (None, 0.0) and not self.temperature:
            out.append("temperature")
        return out

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the engine socket's HELLO carries it)."""
        d = asdict(self)
        d["languages"] = None if self.languages is None else sorted(self.languages)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelCapabilities":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if kw.get("languages") is not None:
            kw["languages"] = frozenset(kw["languages"])
        return cls(**kw)


@dataclass(frozen=True)
class TranscribeOptions:
    """One request's options, immutable and hashable (see the module docstring for the fields).

    Raises (when built):
        InvalidRequestError (``invalid_request``, with ``param``): a bad language code, a
            segmentation that is not one of :data:`SEGMENTATIONS`, a non-positive or non-finite
            ``max_segment_s``, a non-bool ``word_timestamps``.
        UnsupportedTaskError (code ``invalid_request``): a task that is not one of :data:`TASKS`.
    """

    language: str | None = None
    task: str = "transcribe"
    word_timestamps: bool = False
    segmentation: str = "vad"
    max_segment_s: float | None = field(default=None)
    prompt: str | None = None
    temperature: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "language", normalize_language(self.language))
        if self.task not in TASKS:
            err = UnsupportedTaskError(f"task must be one of {', '.join(TASKS)}; got {_short(self.task)}",
                                       code="invalid_request")
            err.param = "task"
            raise err
        if isinstance(self.segmentation, str):  # one rule at every door: any case, spaces around ignored
            object.__setattr__(self, "segmentation", self.segmentation.strip().lower())
        if not isinstance(self.word_timestamps, bool):
            raise InvalidRequestError(f"word_timestamps must be true or false; got {self.word_timestamps!r}",
                                      param="word_timestamps")
        if self.segmentation not in SEGMENTATIONS:
            raise InvalidRequestError(f"segmentation must be one of {', '.join(SEGMENTATIONS)}; "
                                      f"got {_short(self.segmentation)}", param="segmentation")
        if self.max_segment_s is not None:
            try:
                v = float(self.max_segment_s)
            except (TypeError, ValueError):
                v = float("nan")
            if isinstance(self.max_segment_s, bool) or not (math.isfinite(v) and v >= MIN_SEGMENT_S):
                raise InvalidRequestError(f"max_segment_s must be a number of seconds >= {MIN_SEGMENT_S:g}; "
                                          f"got {_short(self.max_segment_s)}", param="max_segment_s")
            object.__setattr__(self, "max_segment_s", v)
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise InvalidRequestError(f"prompt must be text; got {_short(self.prompt)}", param="prompt")
            object.__setattr__(self, "prompt", self.prompt.strip() or None)
            if self.prompt is not None and len(self.prompt) > MAX_PROMPT_CHARS:
                raise InvalidRequestError(f"prompt is {len(self.prompt)} characters; at most {MAX_PROMPT_CHARS} "
                                          "(Whisper keeps its last 223 tokens)", param="prompt")
        if self.temperature is not None:
            try:
                t = float(self.temperature)
            except (TypeError, ValueError, OverflowError):
                t = float("nan")
            if isinstance(self.temperature, bool) or not (0.0 <= t <= 1.0):
                raise InvalidRequestError(f"temperature must be a number in [0, 1]; got {_short(self.temperature)}",
                                          param="temperature")
            object.__setattr__(self, "temperature", t)

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, base: "TranscribeOptions | None" = None, **changes) -> "TranscribeOptions":
        """``base`` (default: all defaults) with ``changes`` applied; the Python API's keywords
        (``language=``, ``task=``, ...) come in here. Unknown names raise ``TypeError``."""
        base = cls() if base is None else base
        if not isinstance(base, cls):
            raise TypeError(f"options must be a TranscribeOptions, got {type(base).__name__}")
        return replace(base, **changes) if changes else base

    def to_dict(self) -> dict:
        """Every field, JSON-able (the engine socket and ``summary.jsonl`` carry it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "TranscribeOptions":
        """Inverse of :meth:`to_dict`; missing fields take their defaults.

        Raises:
            InvalidRequestError: an unknown field (a peer of another version).
        """
        d = dict(d or {})
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidRequestError(f"unknown option(s) {', '.join(sorted(unknown))}")
        return cls(**d)

    # ------------------------------------------------------------------ using
    @property
    def decoding(self) -> tuple:
        """``(language, task, word_timestamps, prompt, temperature)``: what the model sees. Pieces
        with equal values may share a model call whatever their segmentation options."""
        return (self.language, self.task, self.word_timestamps, self.prompt, self.temperature)

    def resolve(self, caps: ModelCapabilities) -> "TranscribeOptions":
        """Check these options against a model and fill in what depends on it.

        Returns:
            options with ``max_segment_s`` set to ``min(max_segment_s, caps.window_s)`` (the
            window when None); the rest unchanged.
        Raises:
            UnsupportedTaskError (``unsupported_task``): ``translate`` on a model that cannot.
            UnsupportedLanguageError (``unsupported_language``): a code outside ``caps.languages``.
        """
        if self.task == "translate" and not caps.translates:
            family = {"parakeet": "parakeet-tdt"}.get(caps.family, caps.family)
            raise UnsupportedTaskError(f"model {caps.name!r} ({family}) cannot translate (translation to "
                                       "English needs a multilingual Whisper model, e.g. --model base)")
        if self.language is not None and caps.languages is not None and self.language not in caps.languages:
            if caps.languages == frozenset({"en"}):
                err = UnsupportedLanguageError(f"model {caps.name} is English-only; language {self.language!r} "
                                               "needs a multilingual model (e.g. --model base)")
            else:
                err = UnsupportedLanguageError(f"language {self.language!r} is not supported by {caps.name}")
            err.param = "language"
            raise err
        window = float(caps.window_s)
        seg = window if self.max_segment_s is None else min(self.max_segment_s, window)
        return self if seg == self.max_segment_s else replace(self, max_segment_s=seg)


DEFAULT_OPTIONS = TranscribeOptions()

__all__ = ["TranscribeOptions", "ModelCapabilities", "DEFAULT_OPTIONS", "TASKS", "SEGMENTATIONS", "MIN_SEGMENT_S",
           "normalize_language"]
