"""``WhisperASR``: the :class:`~flashasr.models.base.ASRModel` for Whisper checkpoints.

Data flow for a batch of waveforms (float32 ``[N_i]`` at 16 kHz):

1. log-mel of each input with 30 s of zeros appended: ``[n_mels, N_i // 160 + 3000]``
   (the max-8 clamp is over the whole input, as in the reference);
2. rounds of windows: each unfinished input contributes its window
   ``mel[:, seek : seek + min(3000, content_frames - seek)]`` zero-padded to 3000 frames;
   windows of all inputs are stacked ``[B, n_mels, 3000]`` and encoded together ``[B, 1500, D]``;
3. multilingual models with ``language=None`` detect each input's language on its first window;
4. batched decoding with temperature fallback (:func:`.decoding.decode_with_fallback`);
5. a window is skipped as silence when ``no_speech_prob > 0.6`` and ``avg_logprob < -1``;
6. the timestamp tokens split the window into segments; the next window starts at the last
   complete timestamp (or 30 s later when the window ended on a single timestamp / had none):
   the reference's long-form "seek" procedure, without conditioning on previous text;
7. every time is clamped to ``[0, duration]`` and made monotonic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import UnsupportedLanguageError
from ...options import TranscribeOptions
from ...types import Segment, Transcript, Word
from ..base import SAMPLE_RATE, ASRModel
from .alignment import align_words, default_alignment_heads
from .decoding import DecodingResult, decode_with_fallback, detect_language, is_no_speech
from .features import HOP_LENGTH, N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim
from .model import CrossKV, WhisperModel
from .tokenizer import WhisperTokenizer

__all__ = ["WhisperASR", "UnsupportedLanguageError"]

INPUT_STRIDE = 2  # mel frames per encoder frame / timestamp step (20 ms)


@dataclass(frozen=True)
class _Settings:
    """How one call decodes: the task, word times, the prompt prefix (tokens before the first window
    of an input; empty: none) and the fallback temperatures."""

    task: str
    word_timestamps: bool
    prefix: tuple[int, ...]
    temperatures: tuple[float, ...]


@dataclass
class _Job:
    index: int
    mel: torch.Tensor  # [n_mels, content_frames + 3000]
    content_frames: int
    duration: float
    language: str | None
    seek: int = 0
    windows: int = 0
    segments: list[Segment] = field(default_factory=list)
    language_probs: dict | None = None

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames


class WhisperASR(ASRModel):
    """A loaded Whisper model (any size) with the reference's transcription procedure.

    Attributes: ``name`` (e.g. ``whisper-tiny.en``), ``family = "whisper"``, ``multilingual``,
    ``max_segment_seconds = 30.0``, ``device``, ``model`` (:class:`WhisperModel`),
    ``tokenizer`` (:class:`WhisperTokenizer`), ``alignment_heads`` (``[[layer, head], ...]``
    from the checkpoint config, or None), ``max_batch`` (windows per encoder/decoder batch).
    """

    family = "whisper"
    max_segment_seconds = 30.0
    long_form = True  # the reference's seek loop over 30 s windows
    prompts = True  # initial prompt (<|startofprev|> + its tokens) before the first window of an input
    uses_temperature = True

    def __init__(self, model: WhisperModel, tokenizer: WhisperTokenizer, *, name: str = "whisper",
                 device: str = "cpu", alignment_heads=None, max_batch: int = 16):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = str(device)
        self.multilingual = tokenizer.multilingual
        self.translates = self.multilingual
        self.alignment_heads = [tuple(map(int, h)) for h in alignment_heads] if alignment_heads else None
        self.max_batch = max_batch
        self.dtype = next(model.parameters()).dtype
        self._languages: frozenset | None = None

    def __repr__(self) -> str:
        return f"WhisperASR(name={self.name!r}, device={self.device!r}, dtype={self.dtype}, dims={self.model.dims})"

    def languages(self) -> frozenset:
        """The language codes of the vocabulary (``{"en"}`` for English-only models)."""
        if self._languages is None:
            self._languages = frozenset(self.tokenizer.language_tokens) if self.multilingual else frozenset({"en"})
        return self._languages

    # ---- the computation -----------------------------------------------------------------
    def _transcribe(self, waveforms: list[np.ndarray], options: TranscribeOptions) -> list[Transcript]:
        """Transcribe (``task="translate"``: English text from speech in any language; ``language``
        is then the SOURCE language, detected when None, and the result's language is ``"en"``)
        the waveforms, batching their windows through the encoder and the decoder; each result
        equals the same input alone. Any length: longer than 30 s runs the reference's seek loop."""
        task, word_timestamps = options.task, options.word_timestamps
        lang = options.language if options.language is not None else (None if self.multilingual else "en")
        jobs = [self._make_job(i, w, lang) for i, w in enumerate(waveforms)]
        settings = self._settings(options)
        with torch.inference_mode():
            while True:
                active = [j for j in jobs if not j.done]
                if not active:
                    break
                for k in range(0, len(active), self.max_batch):
                    self._run_round(active[k: k + self.max_batch], settings)
        out = []
        for j in jobs:
            segs = self._finish_segments(j)
            words = None
            if word_timestamps:
                words = [w for s in segs for w in s.words]
            text = "".join(s.text for s in segs).strip()
            out_lang = "en" if task == "translate" else j.language or ("en" if not self.multilingual else None)
            out.append(Transcript(text=text, language=out_lang, task=task,
                                  duration=j.duration, segments=segs, words=words, model=self.name))
            if not word_timestamps:
                for s in segs:
                    s.words = []
        return out

    # ---- internals -----------------------------------------------------------------------
    def _make_job(self, i: int, w, language: str | None) -> _Job:
        a = w
        mel = log_mel_spectrogram(a, self.model.dims.n_mels, padding=N_SAMPLES, device=self.device)
        return _Job(index=i, mel=mel, content_frames=a.size // HOP_LENGTH, duration=a.size / SAMPLE_RATE,
                    language=language)

    def _settings(self, options: TranscribeOptions) -> "_Settings":
        """The decoding settings of one call: the initial prompt as ``<|startofprev|>`` + its last 223
        tokens (the reference's ``initial_prompt``), and the temperatures from ``options.temperature``
        up in steps of 0.2 (the reference's schedule; 0: greedy first, as by default)."""
        prefix: tuple[int, ...] = ()
        if options.prompt:
            ids = self.tokenizer.encode(" " + options.prompt.strip())
            prefix = (self.tokenizer.sot_prev, *ids[-(self.model.dims.n_text_ctx // 2 - 1):])
        t0 = float(options.temperature or 0.0)
        temps = tuple(float(round(t, 4)) for t in np.arange(t0, 1.0 + 1e-6, 0.2)) or (t0,)
        return _Settings(options.task, options.word_timestamps, prefix, temps)

    def _run_round(self, jobs: list[_Job], settings: "_Settings") -> None:
        """One window of each job: encoded together, languages detected, decoded (the windows that
        begin an input with the prompt before them, the others without), segments and seek moved."""
        sizes = [min(N_FRAMES, j.content_frames - j.seek) for j in jobs]
        mels = torch.stack([pad_or_trim(j.mel[:, j.seek: j.seek + n], N_FRAMES) for j, n in zip(jobs, sizes)])
        feats = self._encode(mels)
        cross = self._cross_kv(feats, settings)
        need = [k for k, j in enumerate(jobs) if j.language is None]
        if need:
            idx = torch.tensor(need, device=feats.device)
            codes, probs = detect_language(self.model, self.tokenizer, feats.index_select(0, idx),
                                           cross=_rows(cross, idx, len(jobs)))
            for k, c, p in zip(need, codes, probs):
                jobs[k].language, jobs[k].language_probs = c, p
        results: list = [None] * len(jobs)
        first = [k for k, j in enumerate(jobs) if settings.prefix and j.seek == 0]
        rest = [k for k in range(len(jobs)) if k not in set(first)]
        for rows, prefix in ((first, settings.prefix), (rest, ())):
            if not rows:
                continue
            idx = torch.tensor(rows, device=feats.device)
            sub = feats if len(rows) == len(jobs) else feats.index_select(0, idx)
            # per-window seed (its seek): independent of batch composition
            got = self._decode(sub, [jobs[k].language for k in rows], [jobs[k].seek for k in rows], prefix, settings,
                               cross=_rows(cross, idx, len(jobs)))
            for k, r in zip(rows, got):
                results[k] = r
        for k, (j, n, r) in enumerate(zip(jobs, sizes, results)):
            window = None
            if settings.word_timestamps:
                window = (feats[k: k + 1], _rows(cross, torch.tensor([k], device=feats.device), len(jobs)))
            self._advance(j, n, r, window, settings.task)

    def _cross_kv(self, feats: torch.Tensor, settings: "_Settings") -> CrossKV | None:
        """The round's cross-attention K/V, computed once and shared by language detection, every
        decoding try and word alignment (None: each computes its own)."""
        return self.model.cross_kv(feats)

    def _encode(self, mels: torch.Tensor) -> torch.Tensor:
        """log-mel windows ``[B, n_mels, 3000]`` -> encoder output ``[B, 1500, D]``."""
        return self.model.encode(mels.to(self.device))

    def _decode(self, feats: torch.Tensor, languages: list, seeds: list[int], prefix: tuple[int, ...],
                settings: "_Settings", cross: CrossKV | None = None) -> list[DecodingResult]:
        """Windows' encoder output -> one :class:`DecodingResult` each (the reference decoding with
        its temperature fallback); ``cross``: their cross-attention K/V, when computed."""
        return decode_with_fallback(self.model, self.tokenizer, feats, languages, seeds=seeds, task=settings.task,
                                    temperatures=settings.temperatures, prefix=prefix, cross=cross)

    def _advance(self, job: _Job, size: int, r: DecodingResult, window: tuple | None = None,
                 task: str = "transcribe") -> None:
        """Turn one window's tokens into segments and move ``job.seek`` (reference procedure);
        with ``window`` (the window's encoder output ``[1, 1500, D]`` and its cross-attention K/V or
        None) also align words."""
        tok = self.tokenizer
        job.windows += 1
        window_seek = job.seek
        if is_no_speech(r):
            job.seek += size  # silence: skip the whole window
            return
        offset = job.seek * HOP_LENGTH / SAMPLE_RATE
        toks = r.tokens
        lps = r.token_logprobs
        is_ts = [t >= tok.timestamp_begin for t in toks]
        single_end = len(toks) >= 2 and not is_ts[-2] and is_ts[-1]
        if len(toks) == 1:
            single_end = is_ts[0]
        cuts = [i + 1 for i in range(len(toks) - 1) if is_ts[i] and is_ts[i + 1]]
        pieces: list[tuple[float, float, int, int]] = []  # (start s, end s, from, to)
        if cuts:
            if single_end:
                cuts.append(len(toks))
            prev = 0
            for c in cuts:
                sl = toks[prev:c]
                start = tok.timestamp_seconds(sl[0]) if sl[0] >= tok.timestamp_begin else 0.0
                end = tok.timestamp_seconds(sl[-1]) if sl[-1] >= tok.timestamp_begin else start
                pieces.append((offset + start, offset + end, prev, c))
                prev = c
            if single_end:
                job.seek += size
            else:
                last_pos = toks[prev - 1] - tok.timestamp_begin
                job.seek += max(1, last_pos * INPUT_STRIDE)
        else:
            dur = size * HOP_LENGTH / SAMPLE_RATE
            ts = [t for t in toks if t >= tok.timestamp_begin]
            if ts and ts[-1] != tok.timestamp_begin:
                dur = tok.timestamp_seconds(ts[-1])
            pieces.append((offset, offset + dur, 0, len(toks)))
            job.seek += size
        aligned = []
        if window is not None:
            heads = self.alignment_heads or default_alignment_heads(self.model)
            aligned = align_words(self.model, tok, window[0], tok.sot_sequence(job.language, task), toks, size, heads,
                                  language=job.language, cross=window[1])
        probs = [float(np.exp(lp)) for t, lp in zip(toks, lps) if t < tok.eot]
        n_text_before = 0
        word_i = 0
        for start, end, a, b in pieces:
            seg_toks = toks[a:b]
            text_ids = [t for t in seg_toks if t < tok.eot]
            text = tok.decode(text_ids)
            lo, hi = n_text_before, n_text_before + len(text_ids)
            n_text_before = hi
            words = []
            tok_pos = lo
            while word_i < len(aligned) and tok_pos < hi:
                w, g, ws, we = aligned[word_i]
                p = probs[tok_pos: tok_pos + len(g)]
                words.append(Word(word=w, start=offset + ws, end=offset + we,
                                  probability=float(np.mean(p)) if p else None))
                tok_pos += len(g)
                word_i += 1
            if not any(ch.isalnum() for ch in text):
                continue  # empty or punctuation-only ("." on music): no words to report
            job.segments.append(Segment(id=0, start=start, end=end, text=text, tokens=list(seg_toks),
                                        avg_logprob=r.avg_logprob, no_speech_prob=r.no_speech_prob,
                                        compression_ratio=r.compression_ratio, temperature=r.temperature,
                                        seek=window_seek, words=words))

    def _finish_segments(self, job: _Job) -> list[Segment]:
        """Clamp times into [0, duration], make them monotonic and number the segments."""
        dur = job.duration
        prev_end = 0.0
        out = []
        for s in job.segments:
            start = min(max(s.start, prev_end, 0.0), dur)
            end = min(max(s.end, start), dur)
            for w in s.words:
                w.start = min(max(w.start, start), end)
                w.end = min(max(w.end, w.start), end)
            s.start, s.end = start, end
            s.id = len(out)
            prev_end = end
            out.append(s)
        return out


def _rows(cross: CrossKV | None, idx: torch.Tensor, n: int) -> CrossKV | None:
    """``cross`` restricted to batch rows ``idx`` (itself when they are all ``n`` rows, or None)."""
    if cross is None or len(idx) == n:
        return cross
    return cross.rows(idx)
