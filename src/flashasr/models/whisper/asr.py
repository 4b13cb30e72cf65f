"""``WhisperASR``: the :class:`~flashasr.models.base.ASRModel` for Whisper checkpoints.

Data flow for a batch of waveforms (float32 ``[N_i]`` at 16 kHz), each with the VAD's speech spans
when the pipeline knows them (``speech=``):

1. log-mel of each input with 30 s of zeros appended: ``[n_mels, N_i // 160 + 3000]``
   (the max-8 clamp is over the whole input, as in the reference -- with speech spans, over each
   speech run alone, below; long inputs in chunks);
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

With speech spans (our additions; the reference has no VAD), in mel frames:

* *speech runs* are the spans joined across gaps shorter than :data:`SPEECH_GAP_S` (and to the
  input's start or end when it is that close); a window starts at the start of a run (never inside
  a longer stretch without speech) and its content ends at the end of that run (zero-padded beyond,
  as the last window of an input is), so long leading silence, music between speakers or a silent
  input are never decoded (nothing to invent there) and the language is detected on speech; an
  input without such stretches is decoded as without spans;
* *a run is decoded as if alone*: its log-mel's max-8 clamp takes the maximum over the run only
  (:func:`.features.normalise_log_mel`), and two spans whose levels (RMS, dB) differ by more than
  :data:`LEVEL_JUMP_DB`, or whose gap is that much louder than the quieter of them, are never in
  one run (nor is a lead-in or ending that much louder than its run joined to it). Otherwise loud
  audio next to quiet speech -- music the VAD left out, or marked for a second, 43-54 dB above
  -63 dBFS FLEURS sentences in issue #17's recordings -- pushes the speech's frames to the clamp's
  floor and Whisper drops the sentence or loops ("1, 2, 4, 5, 4, 5"); an input of one run is
  decoded exactly as before;
* *no lost speech*: when a window ends on a single timestamp or without one (the decoder's
  "nothing more here", which moves the seek to the window's end) although the VAD has speech after
  the last timestamp -- at least :data:`REST_MIN_S` in spans after the one that timestamp fell in
  (a next utterance, after a pause), or :data:`REST_SAME_SPAN_S` left in that span (more than the
  tail of a last word, whose end stamp is often early), both counted from :data:`REST_AFTER_S`
  after it -- the seek moves to that timestamp instead (at least :data:`MIN_PROGRESS_S` on) and
  decoding goes on there: the model's early end-of-text after a first utterance no longer drops
  the second.

The repetition guard (:mod:`flashasr.repetition`): inside each segment, a run of tokens repeated
more than three times in a row (at least 8 tokens) is cut to its first copy, and the transcript's
``warnings`` say so (``repetition_removed``).

:meth:`WhisperASR.start_batch` runs the same procedure in steps of one round (a scheduler puts
streaming finals between them); :meth:`transcribe_batch` runs all the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import UnsupportedLanguageError
from ...options import TranscribeOptions
from ...repetition import cut_loops
from ...types import Segment, Transcript, Word, warning
from ..base import SAMPLE_RATE, ASRModel, BatchRun, as_waveform, check_speech
from .alignment import align_words, default_alignment_heads
from .decoding import DecodingResult, decode_with_fallback, detect_language, is_no_speech
from .features import HOP_LENGTH, N_FRAMES, N_SAMPLES, log_mel_spectrogram, normalise_log_mel, pad_or_trim
from .model import CrossKV, WhisperModel
from .tokenizer import WhisperTokenizer

__all__ = ["WhisperASR", "UnsupportedLanguageError"]

INPUT_STRIDE = 2  # mel frames per encoder frame / timestamp step (20 ms)
FRAMES_PER_S = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames per second

# Speech spans (see the module docstring). Measured on bench/bench_faithful.py's generated
# speech/music/silence recording and the 2-utterance pieces of tests/test_faithful.py.
SPEECH_GAP_S = 3.0  # a stretch without speech this long or longer is never inside a window
REST_MIN_S = 0.5  # speech in later VAD spans (after a pause) that makes decoding go on ...
REST_SAME_SPAN_S = 2.0  # ... or left in the span the last timestamp fell in (more than a word's tail)
REST_AFTER_S = 0.3  # both counted from this far after the last timestamp (end stamps are often early)
MIN_PROGRESS_S = 1.0  # going on needs the window to have moved at least this far
# Spans this much apart in level (or a gap this much louder than the quieter span) are never in one
# run; issue #17's recordings: quiet FLEURS sentences 43-54 dB below the music or speech beside them
LEVEL_JUMP_DB = 30.0
LOOP_MIN_TOKENS = 8  # a token loop inside a segment covers at least this many tokens


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
    runs: list[tuple[int, int]] | None = None  # speech runs in mel frames (None: no spans known)
    speech: list[tuple[int, int]] | None = None  # the VAD's speech spans in mel frames
    seek: int = 0
    limit: int = 0  # where the current window's content ends (mel frames)
    windows: int = 0
    continued: int = 0  # windows that went on after an early end (speech left)
    segments: list[Segment] = field(default_factory=list)
    language_probs: dict | None = None
    warnings: list[dict] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.seek >= self.content_frames

    def place(self) -> None:
        """Before a round: the window starts at the next speech run (or the input is done) and its
        content ends with that run; without spans, at the end of the input."""
        if self.done:
            return
        if self.runs is None:
            self.limit = self.content_frames
            return
        for a, b in self.runs:
            if b > self.seek:
                self.seek, self.limit = max(self.seek, a), b
                return
        self.seek = self.content_frames

    def speech_in(self, a: int, b: int) -> int:
        """Mel frames of VAD speech within ``[a, b)``."""
        return sum(max(0, min(e, b) - max(s, a)) for s, e in self.speech or ())


def _level_db(x: np.ndarray, a: int, b: int) -> float:
    """RMS level of mel frames ``[a, b)`` of waveform ``x`` in dBFS (-200 for digital silence)."""
    seg = np.asarray(x[a * HOP_LENGTH:b * HOP_LENGTH], np.float64)
    return 10.0 * float(np.log10(np.mean(seg * seg) + 1e-20)) if seg.size else -200.0


def _speech_runs(x: np.ndarray, speech: list[tuple[int, int]], content: int) -> list[tuple[int, int]]:
    """The speech runs (module docstring) of waveform ``x`` (float32 ``[N]``) from its VAD spans in
    mel frames (sorted, within ``[0, content)``): spans joined across gaps shorter than
    :data:`SPEECH_GAP_S` unless their levels, or the gap's and the quieter span's, differ by more than
    :data:`LEVEL_JUMP_DB`; the first run starts at 0 and the last ends at ``content`` when that
    close and the lead-in / ending is not that much louder. -> ``[(a, b)]`` mel frames."""
    gap = int(SPEECH_GAP_S * FRAMES_PER_S)
    runs: list[tuple[int, int]] = []
    prev_db = None
    for s, e in speech:
        db = _level_db(x, s, e)
        if runs and s - runs[-1][1] < gap and abs(db - prev_db) <= LEVEL_JUMP_DB \
                and _level_db(x, runs[-1][1], s) - min(db, prev_db) <= LEVEL_JUMP_DB:
            runs[-1] = (runs[-1][0], e)
        else:
            runs.append((s, e))
        prev_db = db
    if runs and runs[0][0] < gap and _level_db(x, 0, runs[0][0]) - _level_db(x, *runs[0]) <= LEVEL_JUMP_DB:
        runs[0] = (0, runs[0][1])  # a short lead-in or ending stays, as in any window
    if runs and content - runs[-1][1] < gap and _level_db(x, runs[-1][1], content) - _level_db(x, *runs[-1]) <= LEVEL_JUMP_DB:
        runs[-1] = (runs[-1][0], content)
    return runs


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
    uses_speech = True  # decodes where the VAD's spans show speech (module docstring)

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
    def _transcribe(self, waveforms: list[np.ndarray], options: TranscribeOptions,
                    speech: list | None = None) -> list[Transcript]:
        """Transcribe (``task="translate"``: English text from speech in any language; ``language``
        is then the SOURCE language, detected when None, and the result's language is ``"en"``)
        the waveforms, batching their windows through the encoder and the decoder; each result
        equals the same input alone. Any length: longer than 30 s runs the reference's seek loop.
        ``speech``: per waveform its checked speech spans or None (see the module docstring)."""
        run = _WhisperRun(self, waveforms, options, speech)
        while not run.step():
            pass
        return run.results()

    def start_batch(self, waveforms, options: TranscribeOptions | None = None, *, speech=None) -> "BatchRun":
        """The batch as a :class:`_WhisperRun`: each :meth:`~_WhisperRun.step` is one round (one
        encoder + decoder pass over up to ``max_batch`` windows). Waveforms, options and spans are
        checked here (as :meth:`transcribe_batch`)."""
        opts = TranscribeOptions.build(options).resolve(self.capabilities)
        waves = [as_waveform(w, f"waveform {i}") for i, w in enumerate(waveforms)]
        return _WhisperRun(self, waves, opts, check_speech(speech, waves))

    def _result(self, j: _Job, options: TranscribeOptions) -> Transcript:
        """A finished job's transcript (segments clamped and numbered; words when asked)."""
        segs = self._finish_segments(j)
        words = [w for s in segs for w in s.words] if options.word_timestamps else None
        if not options.word_timestamps:
            for s in segs:
                s.words = []
        text = "".join(s.text for s in segs).strip()
        lang = j.language or ("en" if not self.multilingual else None)
        prob, top = None, None
        if j.language_probs is not None:  # detected
            prob = float(j.language_probs.get(j.language, 0.0))
            top = dict(sorted(j.language_probs.items(), key=lambda kv: -kv[1])[:5])
        elif lang is not None and (options.language is not None or not self.multilingual):
            prob = 1.0  # given, or the model's only language
        return Transcript(text=text, language="en" if options.task == "translate" else lang, task=options.task,
                          duration=j.duration, segments=segs, words=words, model=self.name,
                          language_probability=prob, language_probs=top, warnings=list(j.warnings))

    # ---- internals -----------------------------------------------------------------------
    def _make_job(self, i: int, w, language: str | None, speech=None) -> _Job:
        a = w
        content = a.size // HOP_LENGTH
        if speech is None:
            mel = log_mel_spectrogram(a, self.model.dims.n_mels, padding=N_SAMPLES, device=self.device)
            return _Job(index=i, mel=mel, content_frames=content, duration=a.size / SAMPLE_RATE, language=language)
        log = log_mel_spectrogram(a, self.model.dims.n_mels, padding=N_SAMPLES, device=self.device, normalise=False)
        job = _Job(index=i, mel=log, content_frames=content, duration=a.size / SAMPLE_RATE, language=language)
        spans = [(s // HOP_LENGTH, min(content, -(-e // HOP_LENGTH))) for s, e in speech]
        job.speech = [(s, e) for s, e in spans if e > s]
        job.runs = _speech_runs(a, job.speech, content)
        # each run clamped alone; one reaching the end takes the padded tail too (as the whole input did)
        job.mel = normalise_log_mel(log, [(s, e if e < content else log.shape[1]) for s, e in job.runs])
        return job

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
        sizes = [min(N_FRAMES, j.limit - j.seek) for j in jobs]
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
        """Turn one window's tokens into segments and move ``job.seek`` (reference procedure, then
        the speech rule of the module docstring); with ``window`` (the window's encoder output
        ``[1, 1500, D]`` and its cross-attention K/V or None) also align words."""
        tok = self.tokenizer
        job.windows += 1
        window_seek = job.seek
        if is_no_speech(r):
            job.seek += size  # silence: skip the whole window
            return
        offset = job.seek * HOP_LENGTH / SAMPLE_RATE
        toks, lps = self._cut_loops(job, r.tokens, r.token_logprobs, offset)
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
        self._go_on_if_speech_left(job, window_seek, size, toks)
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

    def _go_on_if_speech_left(self, job: _Job, window_seek: int, size: int, toks: list[int]) -> None:
        """The no-lost-speech rule (module docstring): the seek went to the window's end, yet the VAD
        has speech after the window's last timestamp -> the seek goes back to that timestamp."""
        if job.speech is None or job.seek < window_seek + size:
            return
        tb = self.tokenizer.timestamp_begin
        stamps = [t for t in toks if t >= tb]
        if not stamps:
            return
        last = (stamps[-1] - tb) * INPUT_STRIDE  # mel frames from the window's start
        if last < MIN_PROGRESS_S * FRAMES_PER_S:
            return
        pos, end = window_seek + last, window_seek + size
        span_end = max((e for s, e in job.speech or () if s <= pos < e), default=pos)
        later = job.speech_in(max(span_end, pos + int(REST_AFTER_S * FRAMES_PER_S)), end)  # spans after a pause
        same = job.speech_in(pos + int(REST_AFTER_S * FRAMES_PER_S), min(span_end, end))  # the span it stopped in
        if later >= REST_MIN_S * FRAMES_PER_S or same >= REST_SAME_SPAN_S * FRAMES_PER_S:
            job.seek = pos
            job.continued += 1

    def _cut_loops(self, job: _Job, toks: list[int], lps: list[float], offset: float) -> tuple[list, list]:
        """The repetition guard: inside each run of text tokens (a segment's text), a token loop is
        cut to its first copy (:func:`flashasr.repetition.cut_loops`); each cut is a warning."""
        tb = self.tokenizer.timestamp_begin
        keep: list[int] = []
        i, n = 0, len(toks)
        while i < n:
            if toks[i] >= tb:
                keep.append(i)
                i += 1
                continue
            j = i
            while j < n and toks[j] < tb:
                j += 1
            kept, loops = cut_loops(toks[i:j], min_items=LOOP_MIN_TOKENS)
            keep.extend(i + k for k in kept)
            stamp = next((toks[k] for k in range(i - 1, -1, -1) if toks[k] >= tb), tb)
            t0 = offset + self.tokenizer.timestamp_seconds(stamp)
            for start, period, copies in loops:
                unit = self.tokenizer.decode(toks[i + start: i + start + period]).strip()
                job.warnings.append(warning(
                    "repetition_removed", f"a repetition loop was cut: {unit!r} {copies} times in a row, kept once",
                    start=round(t0, 2), end=round(offset + (job.limit - job.seek) / FRAMES_PER_S, 2), text=unit,
                    copies=copies))
            i = j
        if len(keep) == n:
            return toks, lps
        return [toks[k] for k in keep], [lps[k] for k in keep]

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


class _WhisperRun(BatchRun):
    """One batch of :class:`WhisperASR` in steps: a step places every unfinished input's next window
    (:meth:`_Job.place`) and runs one round for up to ``max_batch`` of them. The log-mels are made
    at the first step (on the thread that runs the steps). ``audio_s``: the window seconds of the
    last step."""

    def __init__(self, asr: "WhisperASR", waves: list[np.ndarray], options: TranscribeOptions, speech: list | None):
        super().__init__(None)
        self.asr, self.waves, self.options = asr, waves, options
        self.speech = speech or [None] * len(waves)
        self.jobs: list[_Job] | None = None
        self.settings = asr._settings(options)

    def step(self) -> bool:
        if self.done:
            return True
        asr = self.asr
        with torch.inference_mode():
            if self.jobs is None:
                lang = self.options.language if self.options.language is not None else \
                    (None if asr.multilingual else "en")
                self.jobs = [asr._make_job(i, w, lang, sp) for i, (w, sp) in enumerate(zip(self.waves, self.speech))]
                self.waves = []
            for j in self.jobs:
                j.place()
            active = [j for j in self.jobs if not j.done][: asr.max_batch]
            self.audio_s = sum(min(N_FRAMES, j.limit - j.seek) for j in active) / FRAMES_PER_S
            if active:
                asr._run_round(active, self.settings)
            for j in self.jobs:
                j.place()
        self.done = all(j.done for j in self.jobs)
        return self.done

    def results(self) -> list[Transcript]:
        if not self.done:
            raise RuntimeError("results() before the last step")
        return [self.asr._result(j, self.options) for j in self.jobs or []]


def _rows(cross: CrossKV | None, idx: torch.Tensor, n: int) -> CrossKV | None:
    """``cross`` restricted to batch rows ``idx`` (itself when they are all ``n`` rows, or None)."""
    if cross is None or len(idx) == n:
        return cross
    return cross.rows(idx)
