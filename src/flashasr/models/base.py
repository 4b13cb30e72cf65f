"""The interface every model family implements (Whisper, Parakeet-TDT).

Data flow: waveform (float32, 16 kHz mono, shape [N]) -> features -> encoder ->
decoder -> :class:`~flashasr.types.Transcript` with global timestamps in seconds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ABSURD_SAMPLE, AudioError
from ..options import ModelCapabilities, TranscribeOptions
from ..types import Transcript

SAMPLE_RATE = 16_000
_GENERIC_STEMS = frozenset({"model", "weights", "checkpoint", "ckpt"})


def model_name_from_path(path) -> str:
    """The name a model loaded from a file is shown under (CLI warnings, ``/v1/models`` ids).

    The file's stem (``parakeet-tdt-0.6b-v3.nemo`` -> ``"parakeet-tdt-0.6b-v3"``), except when the
    stem says nothing (``model``, ``weights``, ``checkpoint``, ``ckpt``): then the folder's name
    (``fixtures/tiny-tdt/model.nemo`` -> ``"tiny-tdt"``), so a message reads "model tiny-tdt does
    not use --prompt" rather than "model model ...". Falls back to the stem when there is no folder.
    """
    p = Path(str(path))
    if p.stem.lower() in _GENERIC_STEMS:
        parent = p.expanduser().resolve().parent.name
        if parent:
            return parent
    return p.stem


def not_samples(w) -> str | None:
    """Why ``w`` is no kind of sample container (a string, bytes, a mapping, a set, None, a bare
    number, a generator), or None for arrays, tensors, sequences and float memoryviews (their
    contents are checked by :func:`as_waveform`). numpy would turn most of these into a 0-d array and
    the error would name a shape ``()``; ``""`` or ``{}`` would even pass for empty audio where only
    the length is asked."""
    if isinstance(w, (bytes, bytearray)) or (isinstance(w, memoryview) and w.format.lstrip("@=<>!") not in ("f", "d", "e")):
        return (f"expected float samples, got {type(w).__name__}: decode raw PCM first (int16: "
                f"np.frombuffer(data, '<i2') / 32768), or pass encoded audio (a file's bytes) to "
                f"flashasr.transcribe or flashasr.audio.load_audio")
    if w is None or isinstance(w, (str, Mapping, AbstractSet)):
        return (f"expected float samples (a numpy array, torch tensor or list of shape [N]), got "
                f"{type(w).__name__}")
    if not hasattr(w, "__len__"):
        try:
            scalar = np.ndim(w) == 0
        except Exception:  # noqa: BLE001 - an object numpy cannot look at: as_waveform names why
            return None
        if scalar:
            return (f"expected float samples (a numpy array, torch tensor or list of shape [N]), got "
                    f"{type(w).__name__}")
    return None


def as_waveform(w, label: str = "waveform") -> np.ndarray:
    """The one check every model and engine applies to an in-memory waveform.

    Args:
        w: float samples in [-1, 1], shape ``[N]`` (``[1, N]`` / ``[N, 1]`` are flattened);
            numpy array, torch CPU tensor or sequence.
        label: how error messages name the input (e.g. ``"input 3"``).
    Returns:
        contiguous float32 ``[N]`` (the same array when it already is one).
    Raises:
        AudioError (``invalid_audio``): not mono, not a float dtype (int16 PCM must be scaled
            by the caller), NaN / infinite samples, or samples beyond
            :data:`flashasr.errors.ABSURD_SAMPLE` (1e4, 80 dB over full scale, the decoders'
            limit: unscaled integer PCM, or garbage; finite samples of 1e30 made infinite
            log-mel features and a meaningless transcript).
    """
    if type(w) is np.ndarray and w.dtype == np.float32 and w.ndim == 1 and w.flags.c_contiguous:
        a = src = w  # what decoders and the server hand over: no conversion (the streamer's rows)
    else:
        wrong = not_samples(w)
        if wrong:
            raise AudioError(f"{label}: {wrong}", code="invalid_audio")
        if hasattr(w, "detach") and hasattr(w, "numpy"):  # a torch tensor: no autograd; bf16 widened
            w = w.detach()                                  # (numpy has no bfloat16)
            if str(w.dtype) == "torch.bfloat16":
                w = w.float()
        try:
            a = np.asarray(w)
        except Exception as e:  # noqa: BLE001 - a ragged list, say, or an object whose __array__ fails
            raise AudioError(f"{label}: not an array of samples ({type(e).__name__}: {e})",
                             code="invalid_audio") from None
        if a.ndim == 2 and 1 in a.shape:
            a = a.reshape(-1)
        if a.ndim != 1:
            raise AudioError(f"{label}: expected mono samples of shape [N], got shape {a.shape}",
                             code="invalid_audio")
        if not np.issubdtype(a.dtype, np.floating):
            raise AudioError(f"{label}: expected float samples in [-1, 1], got dtype {a.dtype}", code="invalid_audio")
        src = a
        with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf here: named below
            a = np.ascontiguousarray(a, dtype=np.float32)
    if not a.size:
        return a
    with np.errstate(over="ignore", invalid="ignore"):  # one BLAS pass; |x| > 1e19 squares overflow:
        energy = float(np.dot(a, a))                    # then the exact checks
    if energy <= ABSURD_SAMPLE ** 2:  # then no sample is beyond the limit either: done
        return a
    if not np.isfinite(a).all():
        if src is a or not np.isfinite(src).all():
            raise AudioError(f"{label}: contains NaN or infinite samples", code="invalid_audio")
        a = src  # finite samples beyond float32's range (float64): their peak is named below
    peak = max(-float(a.min()), float(a.max()))
    if peak > ABSURD_SAMPLE:
        shown = f"{peak:.8g}" if peak < 1e7 else f"{peak:.4g}"  # (10000.001 is not "1e+04")
        raise AudioError(f"{label}: samples reach {shown}, far outside float audio's [-1, 1] (more than "
                         f"{ABSURD_SAMPLE:g}); integer PCM must be scaled first (int16: divide by 32768); "
                         f"a file's decoder clips such samples instead", code="invalid_audio")
    return a


class ASRModel(ABC):
    """A loaded speech-to-text model: it transcribes exactly the waveforms it is given.

    A model never cuts audio, never picks an engine and never validates a door's form: the
    pipeline (:mod:`flashasr.pipeline`) cuts long recordings into pieces no longer than
    ``max_segment_seconds`` and merges the pieces' transcripts; the doors build one
    :class:`~flashasr.options.TranscribeOptions`, checked against :attr:`capabilities`.

    Attributes:
        name: human-readable model name (e.g. ``whisper-tiny.en``, ``parakeet-tdt``).
        family: ``"whisper"`` or ``"parakeet"``.
        sample_rate: input sample rate in Hz (16000 for both families).
        max_segment_seconds: the longest audio the model takes in one encoder pass (its window;
            30.0 for Whisper); the pipeline's pieces are at most this long.
        long_form: the model has its own procedure for longer audio (Whisper's seek loop).
        multilingual: whether ``language=None`` triggers language detection.
        translates: ``task="translate"`` supported (multilingual Whisper).
        device: torch device string the weights live on.
        stage_cpu_s: None, or cumulative host CPU seconds of this model's own stages since it was
            built (Parakeet: ``features_upload``, ``detokenize``), read by the job report.
    """

    name: str = "model"
    family: str = "unknown"
    sample_rate: int = SAMPLE_RATE
    max_segment_seconds: float = 30.0
    long_form: bool = False
    multilingual: bool = False
    translates: bool = False
    prompts: bool = False  # the prompt option conditions the decoding
    uses_temperature: bool = False  # the temperature option is used
    uses_speech: bool = False  # transcribe_batch's speech spans steer the decoding (Whisper)
    speech_gate: bool = True  # pieces that fit one window still need the VAD to find speech first
    stage_cpu_s: dict | None = None
    device: str = "cpu"

    def languages(self) -> frozenset | None:
        """Codes the ``language`` option may take; None: the hint does not steer this model (any
        valid code is accepted and echoed). Default: None."""
        return None

    @property
    def capabilities(self) -> ModelCapabilities:
        """What this model can do (:class:`~flashasr.options.ModelCapabilities`), asked by the
        doors and the pipeline instead of copying the model's rules."""
        return ModelCapabilities(name=str(self.name), family=str(self.family), sample_rate=int(self.sample_rate),
                                 window_s=float(self.max_segment_seconds), long_form=bool(self.long_form),
                                 languages=self.languages(), multilingual=bool(self.multilingual),
                                 translates=bool(self.translates), prompts=bool(self.prompts),
                                 temperature=bool(self.uses_temperature), speech_gate=bool(self.speech_gate))

    def transcribe_batch(self, waveforms: Sequence[np.ndarray], options: TranscribeOptions | None = None, *,
                         speech: Sequence | None = None, checked: bool = False, **changes) -> list[Transcript]:
        """Transcribe several waveforms; result ``i`` equals :meth:`transcribe_waveform` on input ``i``
        alone (same text, timestamps within one frame), however the model batches them.

        Args:
            waveforms: float32 arrays ``[N_i]`` at ``sample_rate`` Hz, values in [-1, 1], any length
                (a model without ``long_form`` encodes an input longer than its window in one pass).
            options: :class:`~flashasr.options.TranscribeOptions` (language, task, word_timestamps;
                the segmentation fields are the pipeline's and are ignored here).
            speech: per input, the VAD's speech spans in it (``[(a, b), ...]`` sample ranges, as
                :class:`~flashasr.pipeline.plan.Piece` carries them) or None (unknown); None: all
                unknown. A model with ``uses_speech`` (Whisper) decodes only where there is speech
                and goes on where its decoder stopped early while speech remains; others ignore it.
            checked: every waveform already passed :func:`as_waveform` (contiguous float32 ``[N]``,
                finite; the model process checks a batch while the previous one runs): not
                checked again.
            **changes: keyword shortcuts applied to ``options`` (``language="de"``, ``task=...``,
                ``word_timestamps=True``).
        Returns:
            one :class:`~flashasr.types.Transcript` per input, ``duration = N_i / sample_rate``,
            every time within ``[0, duration]``.
        Raises:
            AudioError (``invalid_audio``): an input that is not mono float samples or not finite.
            UnsupportedLanguageError / UnsupportedTaskError: options this model cannot honour.
            ValueError: ``speech`` of another length than ``waveforms``, or a span outside its input.
        """
        opts = TranscribeOptions.build(options, **changes).resolve(self.capabilities)
        waves = list(waveforms) if checked else [as_waveform(w, f"waveform {i}") for i, w in enumerate(waveforms)]
        if self.uses_speech:
            return self._transcribe(waves, opts, speech=check_speech(speech, waves))
        return self._transcribe(waves, opts)

    def start_batch(self, waveforms: Sequence[np.ndarray], options: TranscribeOptions | None = None, *,
                    speech: Sequence | None = None) -> "BatchRun":
        """:meth:`transcribe_batch` as a :class:`BatchRun` whose work runs in steps (a scheduler can
        put other work between two steps; Whisper: one step is one round of windows). Default: one
        step, the whole :meth:`transcribe_batch`. Arguments and errors as :meth:`transcribe_batch`
        (raised by the first :meth:`BatchRun.step` here, at once by models with their own runs)."""
        return BatchRun(lambda: self.transcribe_batch(waveforms, options, speech=speech))

    def transcribe_waveform(self, waveform: np.ndarray, options: TranscribeOptions | None = None,
                            **changes) -> Transcript:
        """Transcribe one waveform (see :meth:`transcribe_batch`)."""
        return self.transcribe_batch([waveform], options, **changes)[0]

    @abstractmethod
    def _transcribe(self, waveforms: list[np.ndarray], options: TranscribeOptions) -> list[Transcript]:
        """The family's computation: checked float32 ``[N_i]`` waveforms and resolved options in,
        one transcript per waveform out (with ``uses_speech``: also ``speech=``, checked spans)."""


class BatchRun:
    """A batch transcription in steps: call :meth:`step` until it returns True (done), then
    :meth:`results`. Each step is one bounded piece of model work, run on the model's thread like
    any model call. This default runs everything in its first step (``fn`` returns the transcripts).
    Attributes: ``done``; ``audio_s``: audio seconds the last step covered (for fair queuing)."""

    def __init__(self, fn):
        self._fn = fn
        self._out: list[Transcript] | None = None
        self.done = False
        self.audio_s = 0.0

    def step(self) -> bool:
        """Run the next step; True when the batch is done. Raises what the model raises."""
        if not self.done:
            self._out = list(self._fn())
            self.audio_s = sum(t.duration for t in self._out)
            self.done = True
        return True

    def results(self) -> list[Transcript]:
        """One transcript per input (after the last step)."""
        if not self.done:
            raise RuntimeError("BatchRun.results() before its last step")
        return list(self._out or [])


def check_speech(speech: Sequence | None, waves: Sequence[np.ndarray]) -> list:
    """``speech`` for :meth:`ASRModel.transcribe_batch` checked against ``waves``: a list with one
    entry per waveform, each None or a sorted list of ``(a, b)`` int sample ranges within it.

    Raises:
        ValueError: another length than ``waves``, or a span that is empty, reversed or outside
            its waveform.
    """
    if speech is None:
        return [None] * len(waves)
    speech = list(speech)
    if len(speech) != len(waves):
        raise ValueError(f"speech holds {len(speech)} entries for {len(waves)} waveforms")
    out = []
    for i, (spans, w) in enumerate(zip(speech, waves)):
        if spans is None:
            out.append(None)
            continue
        got = sorted((int(a), int(b)) for a, b in spans)
        if any(not 0 <= a < b <= w.shape[0] for a, b in got):
            raise ValueError(f"speech of waveform {i}: a span outside its {w.shape[0]} samples")
        out.append(got)
    return out
