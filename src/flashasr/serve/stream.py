"""Streaming transcription sessions (transport-independent core of ``/v1/realtime`` and ``/v1/stream``).

A :class:`StreamSession` takes PCM16 audio at any declared rate, resamples it to 16 kHz
(soxr streaming, HQ), optionally runs server VAD, keeps the current utterance's audio and
emits OpenAI Realtime transcription events through an ``emit`` coroutine:

* ``input_audio_buffer.speech_started`` / ``speech_stopped`` (server VAD),
* ``input_audio_buffer.committed`` (end of speech, manual commit, or the utterance cap),
* ``conversation.item.input_audio_transcription.delta``: partials at a configurable cadence
  of new audio, computed one of two ways (deltas concatenate either way, no word is retracted):

  - *chunked* (Parakeet-TDT, the default where the model has it): only the audio that arrived
    since the last partial is sent; the model's streamer encodes it with the stream's cached
    per-layer state and carries its decoder state (:mod:`flashasr.models.parakeet.streaming`),
    so a partial costs the same whatever the utterance's length. The hypothesis only grows;
    a delta carries the words that became complete (a later word has started),
  - *reencode* (Whisper; ``--stream-partials reencode``): each partial re-transcribes the
    utterance so far; only words on which two consecutive hypotheses agree are emitted
    (local agreement),
* ``conversation.item.input_audio_transcription.completed``: the final. It re-runs the
  model on the *whole* utterance through the pipeline of uploads (``finalize``: the VAD's speech
  spans planned off the event loop, the pieces at the scheduler's ``FINAL`` priority, the merger's
  repetition guard), so it equals the offline transcript of the same audio with the session's
  options (no word lost at packet boundaries, after a pause or at the end; nothing invented on a
  silent utterance),
* ``...failed`` when the final could not be produced (also one the server's stop leaves no time
  for: :meth:`StreamSession.finish`),
* extension (off by default): ``conversation.item.input_audio_transcription.partial`` with every
  partial hypothesis in full (``transcript``, ``audio_end_ms``), for clients that redraw text.

Cost per stream is bounded: the utterance buffer holds at most ``max_utterance_s`` (a longer
utterance is committed early), audio before speech is a ring of ``prefix_padding_ms`` + 1 s,
and everything of an utterance is dropped once its final is queued (its chunked state too).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections import deque

import numpy as np

from ..options import TranscribeOptions
from .errors import APIError, error_body, shutting_down
from .scheduler import FINAL, PARTIAL

log = logging.getLogger("flashasr.serve")

SR = 16000
# Server VAD: received audio waits here while the stream's VAD catches up; beyond this much the
# receive loop waits too (the socket then pushes back on the client), so memory stays bounded.
VAD_BACKLOG_S = 5.0
FEED_PIECE_S = 0.5  # a longer packet is fed as pieces of at most this (StreamSession._feed)
MIN_RATE, MAX_RATE = 8000, 192000


def check_rate(value) -> int:
    """Validate a declared input sample rate (Hz); raises APIError(code=invalid_sample_rate)."""
    try:
        r = int(value)
        if str(value).strip() not in (str(r), f"{r}.0"):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        r = repr(value)
        raise APIError(f"sample rate must be an integer number of Hz, got {r if len(r) <= 60 else r[:57] + '...'}",
                       code="invalid_sample_rate", param="sample_rate") from None
    if not MIN_RATE <= r <= MAX_RATE:
        raise APIError(f"sample rate {r} Hz is outside {MIN_RATE}..{MAX_RATE} Hz", code="invalid_sample_rate",
                       param="sample_rate")
    return r


class Resampler:
    """PCM16 bytes at ``rate`` Hz -> float32 [n] at 16 kHz, across packet boundaries.

    Keeps an odd trailing byte for the next packet (a packet may split a sample).
    soxr's streaming resampler carries its filter state, so packetizing does not change the
    output (up to soxr's own latency, flushed by :meth:`flush`).
    """

    def __init__(self, rate: int):
        self.rate = rate
        self._odd = b""
        self._rs = None
        if rate != SR:
            import soxr

            self._rs = soxr.ResampleStream(rate, SR, 1, dtype="float32", quality="HQ")

    def push(self, data: bytes) -> np.ndarray:
        if self._odd:
            data = self._odd + data
            self._odd = b""
        if len(data) % 2:
            self._odd = data[-1:]
            data = data[:-1]
        x = np.frombuffer(data, dtype="<i2").astype(np.float32) * (1.0 / 32768.0)
        if self._rs is not None and x.size:
            x = self._rs.resample_chunk(x)
        return x

    def flush(self) -> np.ndarray:
        if self._rs is None:
            return np.zeros(0, np.float32)
        return self._rs.resample_chunk(np.zeros(0, np.float32), last=True)

    def reset(self) -> None:
        """Start the resampling over (after :meth:`flush`, at a commit). A half sample already
        received stays: the byte stream goes on, and the next frame completes it (found by a new
        user: dropping it shifted every later sample by one byte, noise at full scale)."""
        if self._rs is not None:
            self._rs.clear()


class VadBatcher:
    """The server VAD of every live stream of one event loop, batched and off the loop.

    A session awaits :meth:`feed` with its stream's :class:`~flashasr.audio.vad.StreamingVAD`
    and a chunk; chunks that arrive while a batch runs wait for the next one, and each batch is
    one :meth:`StreamingVAD.feed_many` call (one ONNX call per frame position for all streams)
    in a worker thread (onnxruntime releases the GIL), so the loop keeps receiving packets and
    sending events. At low load a chunk starts at once (no tick to wait for); at high load the
    batches grow. Events equal per-stream :meth:`~flashasr.audio.vad.StreamingVAD.feed`
    (``feed_many``'s contract), in each stream's order: a session (:meth:`StreamSession._run_vad`)
    awaits one chunk at a time -- all the packets it received while its last chunk ran -- and a
    second chunk of a stream already in the batch goes to the next batch.

    Why: 1,000-2,000 server-VAD streams on the H200 gave finals seconds late while the engine
    was a third busy (``bench/results/stream_scale_h200_scale500.json``): one ONNX call per
    32 ms frame per stream, on the event loop, 6-7 ms of a core per stream-second.
    """

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, VadBatcher]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._pending: list[tuple[object, np.ndarray, asyncio.Future]] = []
        self._running = False
        self._task: asyncio.Future | None = None  # the drain running now (a reference keeps it alive)
        self._executor = None
        self.batches = 0  # VAD batches run (tests, metrics)

    @classmethod
    def for_running_loop(cls) -> "VadBatcher":
        """The batcher of the running event loop (one per loop, created on first use)."""
        loop = asyncio.get_running_loop()
        b = cls._by_loop.get(loop)
        if b is None:
            b = cls._by_loop[loop] = cls()
        return b

    async def feed(self, vad, x: np.ndarray) -> list:
        """``vad.feed(x)``'s events (a list of :class:`~flashasr.audio.vad.VADEvent`), batched."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((vad, x, fut))
        if not self._running:
            self._running = True
            self._task = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from ..audio.vad import StreamingVAD

        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashasr-vad")
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, seen, later = [], set(), []
                for item in self._pending:
                    (later if id(item[0]) in seen else batch).append(item)
                    seen.add(id(item[0]))
                self._pending = later
                self.batches += 1
                try:
                    out = await loop.run_in_executor(
                        self._executor, StreamingVAD.feed_many, [(v, x) for v, x, _ in batch])
                except Exception as e:  # noqa: BLE001 - every waiter of the batch gets the error
                    for _, _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                for (_, _, f), events in zip(batch, out):
                    if not f.done():
                        f.set_result(events)
        finally:
            self._running = False


class VadAdapter:
    """Server VAD on 16 kHz float32 audio: wraps :class:`flashasr.audio.vad.StreamingVAD`.

    ``await process(x, start)`` (``start``: stream sample index of ``x[0]``) returns
    ``[(kind, sample, decided)]`` with kind ``"start"``/``"stop"``, the absolute 16 kHz sample index
    where speech starts (the VAD already moved it ``prefix_padding_ms`` earlier) or where the
    trailing silence began, and the sample index at which the event became decidable (the end of
    the frame that decided it: ``x`` may hold many packets). The Silero ONNX session is shared by all streams, and the frames of
    all streams of the event loop are run together (:class:`VadBatcher`).
    """

    def __init__(self, threshold: float, prefix_padding_ms: int, silence_duration_ms: int):
        from ..audio.vad import StreamingVAD

        self.vad = StreamingVAD(threshold=threshold, prefix_padding_ms=prefix_padding_ms,
                                silence_duration_ms=silence_duration_ms)
        self.offset: int | None = None

    async def process(self, x: np.ndarray, start: int) -> list[tuple[str, int, int]]:
        if self.offset is None:
            self.offset = start  # the VAD's clock starts at the first sample it sees
        events = await VadBatcher.for_running_loop().feed(self.vad, x)
        return [("start" if ev.type == "speech_started" else "stop", self.offset + int(round(ev.time * SR)),
                 self.offset + int(round(ev.emitted_at * SR))) for ev in events]


class LazyVad:
    """A :class:`VadAdapter` created on the first audio (idle connections cost no VAD state).

    Args:
        turn_detection: ``{"threshold", "prefix_padding_ms", "silence_duration_ms", ...}``
            (:func:`flashasr.serve.protocol.parse_turn_detection`).
    """

    def __init__(self, turn_detection: dict):
        self.cfg = turn_detection
        self._vad = None

    async def process(self, x: np.ndarray, start: int) -> list[tuple[str, int, int]]:
        if self._vad is None:
            self._vad = VadAdapter(self.cfg["threshold"], self.cfg["prefix_padding_ms"],
                                   self.cfg["silence_duration_ms"])
        return await self._vad.process(x, start)


async def _ended(task: asyncio.Task) -> None:
    """Wait until ``task`` has ended, however it ends (its error was its own to report); raises
    only when the waiting task itself is cancelled (``await task`` would raise the task's
    cancellation too, and a final cancelled by :meth:`StreamSession.finish` went on)."""
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at exit


def _client_gone(e: BaseException) -> bool:
    """Whether an error is the client's connection going away (closed, reset, a send timing out or
    refused after the close), not a fault of the server."""
    if isinstance(e, (ConnectionError, asyncio.TimeoutError)):
        return True
    if type(e).__name__ in ("WebSocketDisconnect", "ClientDisconnected", "ConnectionClosed", "ConnectionClosedOK",
                            "ConnectionClosedError"):
        return True
    return isinstance(e, RuntimeError) and "websocket" in str(e).lower()


def _words(text: str) -> list[str]:
    return text.split()


def _norm(word: str) -> str:
    """Word identity for local agreement: case and surrounding punctuation do not count."""
    return word.strip(".,!?;:\"'()[]-").lower()


class StreamSession:
    """One live stream. ``emit(event: dict)`` is awaited for every server event.

    Args:
        backend: has ``async transcribe(samples, options, priority=, coalesce_key=)``.
        emit: coroutine sending one event dict to the client.
        input_rate: Hz of the incoming PCM16 (resampled to 16 kHz when different).
        vad: a :class:`VadAdapter` (server VAD) or None (commit manually).
        partial_interval_ms: new audio between two partials (0: no partials).
        max_utterance_s: utterance cap in seconds (longer: committed early).
        options: the session's :class:`~flashasr.options.TranscribeOptions` (its language), already
            checked against the model; a ``session.update`` replaces it whole (:attr:`options`).
        finalize: ``await finalize(audio, options) -> Transcript``: how a final is made (the server
            passes the upload pipeline at ``FINAL`` priority); None: one ``backend.transcribe`` call.
        chunked: partials through ``backend.stream_chunk`` / ``stream_close`` (the model's
            chunked streamer) instead of re-transcribing the utterance so far.
    """

    def __init__(self, backend, emit, *, input_rate: int = 24000, vad=None, options: TranscribeOptions | None = None,
                 partial_interval_ms: float = 500.0, max_utterance_s: float = 30.0,
                 prefix_padding_ms: int = 300, metrics=None, full_partials: bool = False, finalize=None,
                 chunked: bool = False):
        self.id = f"sess_{uuid.uuid4().hex[:16]}"
        self.backend = backend
        self.emit = emit
        self.resampler = Resampler(input_rate)
        self.vad = vad
        self.options = options or TranscribeOptions(segmentation="none")
        self.partial_interval = int(partial_interval_ms * SR / 1000)
        self.max_utt = int(max_utterance_s * SR)
        self.prefix = int(prefix_padding_ms * SR / 1000)
        self.metrics = metrics
        self.full_partials = full_partials  # extension: also send every partial hypothesis in full
        self.finalize = finalize
        self.pos = 0                      # 16 kHz samples received so far (stream clock)
        self._cap_end: int | None = None  # where the last item ended, when the utterance cap cut it
        self._committed_to = 0  # the end of the last committed item (a VAD start's prefix never reaches before it)
        self._pre: deque = deque()        # (start_sample, chunk) before speech (VAD mode)
        self._pre_n = 0
        self._buf: list[np.ndarray] = []  # current utterance
        self._buf_n = 0
        self._buf_start = 0               # stream sample of the utterance's first sample
        self.in_speech = False
        self.item_id: str | None = None
        self.prev_item: str | None = None
        self._last_partial_n = 0
        self._partial_task: asyncio.Task | None = None
        self._prev_hyp: list[str] = []
        self._emitted: list[str] = []
        self._final_chain: asyncio.Task | None = None
        self._transcribing: dict[str, asyncio.Task] = {}  # committed items whose transcript is being made
        self._cut = False  # finish(): the server's stop cuts the finals still being made short
        self._tasks: set[asyncio.Task] = set()
        self.closed = False
        self.chunked = chunked
        self._unsent: list[np.ndarray] = []  # chunked: audio of the utterance not sent to its stream yet
        self._unsent_n = 0
        self._stream_key: str | None = None  # chunked: the utterance's stream (state in the model's streamer)
        self._stream_sent = False            # ... it got its first chunk
        self._stream_dead = False            # ... its partials stopped (no slot, state lost): the final still comes
        self._vad_in: list[tuple[int, np.ndarray]] = []  # server VAD: (stream sample, chunk) not through it yet
        self._vad_in_n = 0
        self._vad_task: asyncio.Task | None = None
        self._vad_error: BaseException | None = None

    @property
    def language(self) -> str | None:
        return self.options.language

    # ---------------------------------------------------------------- helpers
    def _new_item(self) -> str:
        return f"item_{uuid.uuid4().hex[:20]}"

    def _ms(self, sample: int) -> int:
        return int(round(sample * 1000 / SR))

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        """A session task ended: its error is taken here (no "Task exception was never retrieved"
        when a client leaves while its final is sent: found by a new user), logged unless it is
        the client going away."""
        self._tasks.discard(t)
        if t.cancelled():
            return
        e = t.exception()
        if e is not None and not _client_gone(e):
            log.warning("stream %s: %s failed: %s", self.id, t.get_coro().__qualname__, e, exc_info=e)

    def _start_utt(self, start_sample: int) -> None:
        self._buf, self._buf_n = [], 0
        self._buf_start = start_sample
        self._last_partial_n = 0
        self._prev_hyp, self._emitted = [], []
        self.item_id = self._new_item()
        self._end_stream()
        self._stream_key = f"{self.id}/{self.item_id}" if self.chunked else None

    def _append_utt(self, x: np.ndarray) -> None:
        if x.size:
            self._buf.append(x)
            self._buf_n += x.size
            if self._stream_key is not None:
                self._unsent.append(x)
                self._unsent_n += x.size

    def _take_utt(self) -> np.ndarray:
        a = np.concatenate(self._buf) if self._buf else np.zeros(0, np.float32)
        self._buf, self._buf_n = [], 0
        return a

    def _end_stream(self) -> None:
        """The utterance's chunked state is no longer needed (committed, cleared, closed)."""
        if self._stream_key is not None and self._stream_sent:
            try:
                self.backend.stream_close(self._stream_key)
            except Exception as e:  # noqa: BLE001 - the engine drops states of lost connections itself
                log.debug("stream close failed: %s", e)
        self._stream_key, self._stream_sent, self._stream_dead = None, False, False
        self._unsent, self._unsent_n = [], 0

    # ----------------------------------------------------------------- input
    async def append_pcm16(self, data: bytes) -> None:
        """Feed raw little-endian PCM16 mono bytes at the declared rate."""
        x = self.resampler.push(data)
        await self._feed(x)

    async def _feed(self, x: np.ndarray) -> None:
        """One packet of 16 kHz samples; a packet longer than ``FEED_PIECE_S`` goes through as
        pieces of at most that length (and, without VAD, cut exactly at the utterance cap), so one
        huge packet is committed at ``max_utterance_s`` like a run of small ones, never held whole
        in one utterance."""
        self._raise_vad_error()
        while x.size:
            n = int(FEED_PIECE_S * SR)
            if self.vad is None and self.item_id is not None:
                n = min(n, max(1, self.max_utt - self._buf_n))  # cut where the utterance reaches its cap
            await self._feed_one(x[:n])
            x = x[n:]

    async def _feed_one(self, x: np.ndarray) -> None:
        if not x.size:
            return
        start = self.pos
        self.pos += x.size
        if self.vad is None:
            if self.item_id is None:
                self._start_utt(start)
            self._append_utt(x)
            if self._buf_n >= self.max_utt:
                await self.commit(reason="max_utterance")
            else:
                self._maybe_partial()
            return
        self._vad_in.append((start, x))
        self._vad_in_n += x.size
        if self._vad_task is None:
            self._vad_task = self._spawn(self._run_vad())
        if self._vad_in_n > VAD_BACKLOG_S * SR:
            await self.vad_settled()

    async def _run_vad(self) -> None:
        """The server VAD of this stream, off the receive loop: all audio received while the last
        VAD batch ran goes through the next one at once (one chunk of many packets), so a stream
        whose VAD fell behind catches up and the socket keeps being read (pings answered). An
        error is raised to the receive loop by the next packet or control message."""
        try:
            while self._vad_in and not self.closed:
                pending, self._vad_in, self._vad_in_n = self._vad_in, [], 0
                x = pending[0][1] if len(pending) == 1 else np.concatenate([c for _, c in pending])
                events = deque(await self.vad.process(x, pending[0][0]))
                for k, (start, chunk) in enumerate(pending):  # each packet as if it had gone through alone
                    last = k == len(pending) - 1
                    now = []
                    while events and (last or events[0][2] <= start + chunk.size):
                        now.append(events.popleft()[:2])
                    await self._vad_step(chunk, start, now)
        except Exception as e:  # noqa: BLE001 - handed to the receive loop (_raise_vad_error)
            self._vad_error = e
            self._vad_in, self._vad_in_n = [], 0
        finally:
            self._vad_task = None

    def _raise_vad_error(self) -> None:
        if self._vad_error is not None:
            e, self._vad_error = self._vad_error, None
            raise e

    async def vad_settled(self) -> None:
        """Wait until all audio received so far went through the server VAD (and its events were
        handled); raises the error the VAD met, if any. A no-op without server VAD."""
        while self._vad_task is not None:
            await asyncio.shield(self._vad_task)
        self._raise_vad_error()

    async def _vad_step(self, x: np.ndarray, start: int, events: list[tuple[str, int]]) -> None:
        """One packet ``x`` (16 kHz, from stream sample ``start``) and the server VAD's events
        decided by its end: the pre-speech ring, the utterance buffer, speech started / stopped,
        commits and partials."""
        # keep the pre-speech ring (enough for the prefix padding plus the VAD's decision delay)
        self._pre.append((start, x))
        self._pre_n += x.size
        keep = self.prefix + SR
        while self._pre and self._pre_n - self._pre[0][1].size >= keep:
            self._pre_n -= self._pre.popleft()[1].size
        if self.in_speech:
            self._append_utt(x)
        for kind, at in events:
            if kind == "start" and not self.in_speech:
                self.in_speech = True
                # the prefix padding never reaches into the item committed before: a trial found
                # consecutive VAD items sharing ~0.3 s (a commit ends 500 ms of silence after speech,
                # the next start looks 300 ms back)
                at = max(at, self._pre[0][0] if self._pre else at, 0, self._committed_to)
                self._start_utt(at)
                for s0, c in self._pre:  # audio from `at` up to now
                    if s0 + c.size > at:
                        self._append_utt(c[max(0, at - s0):])
                await self.emit({"type": "input_audio_buffer.speech_started", "audio_start_ms": self._ms(at),
                                 "item_id": self.item_id})
            elif kind == "stop" and self.in_speech:
                self.in_speech = False
                await self.emit({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": self._ms(at),
                                 "item_id": self.item_id})
                await self.commit(reason="vad")
        if self.in_speech:
            if self._buf_n >= self.max_utt:
                item_end = self._buf_start + self._buf_n
                await self.commit(reason="max_utterance")
                self._start_utt(item_end)  # speech goes on: a new item continues right after
            else:
                self._maybe_partial()

    # ---------------------------------------------------------------- control
    async def commit(self, reason: str = "client") -> str | None:
        """Close the current utterance: emit ``committed`` and queue its final transcript (None: no
        item). A client's commit of an empty buffer raises ``input_audio_buffer_commit_empty``,
        except right after the utterance cap committed everything received (found by a new user: a
        client that sent exactly the cap's worth of audio and committed got that error)."""
        if reason == "client":
            await self.vad_settled()  # the utterance holds all audio received before the commit
        if reason in ("client", "turn_detection") and self.resampler.rate != SR:
            tail = self.resampler.flush()  # soxr holds back a few ms: the end of speech must not be lost
            self.resampler.reset()
            if tail.size and self.item_id is not None:
                self.pos += tail.size
                self._append_utt(tail)
        if self.item_id is None or self._buf_n == 0:
            if reason == "client" and self._cap_end == self.pos:
                self._cap_end = None  # every sample received went out at the utterance cap just now
                return None
            if reason == "client":
                raise APIError("input audio buffer is empty: nothing to commit", code="input_audio_buffer_commit_empty")
            self.item_id = None
            return None
        item, start = self.item_id, self._buf_start
        audio = self._take_utt()
        emitted = list(self._emitted)
        self.item_id = None
        if self._partial_task is not None:
            self._partial_task.cancel()
            self._partial_task = None
        self._end_stream()
        if self.vad is not None and reason == "client" and self.in_speech:
            self._start_utt(start + audio.size)  # speech goes on: later audio is a new item (VAD still open)
        await self.emit({"type": "input_audio_buffer.committed", "previous_item_id": self.prev_item,
                         "item_id": item, "audio_start_ms": self._ms(start),
                         "audio_end_ms": self._ms(start + audio.size)})
        self.prev_item = item
        self._cap_end = start + audio.size if reason == "max_utterance" else None
        self._committed_to = max(self._committed_to, start + audio.size)
        prev = self._final_chain
        self._final_chain = self._transcribing[item] = self._spawn(self._final(item, audio, emitted, prev))
        return item

    async def set_rate(self, rate: int) -> None:
        """Switch the input sample rate (a session update): what the old resampler still holds is
        fed first (found by a new user: up to 58 ms of the utterance were lost at each change)."""
        if rate == self.resampler.rate:
            return
        tail = self.resampler.flush()
        self.resampler = Resampler(rate)
        await self._feed(tail)

    async def set_vad(self, vad, prefix_padding_ms: float | None = None) -> None:
        """Switch turn detection (a session update): ``vad`` a :class:`LazyVad` (server VAD) or None
        (manual commits). When server VAD comes on, or its settings change, the open utterance is
        committed first (found by a new user: manual mode's buffered audio was lost without an
        event when a fresh VAD began a new utterance; a fresh VAD that never saw an open turn's
        start never ended it); the same server VAD settings again change nothing; server VAD going
        off leaves the utterance open for the client's commit. Audio received before the switch
        goes through the old settings first."""
        await self.vad_settled()
        if vad is not None and self.vad is not None and getattr(vad, "cfg", None) == getattr(self.vad, "cfg", None):
            return  # the same settings again: the running VAD keeps its state (an open turn stays open)
        if vad is not None and self.item_id is not None and self._buf_n:
            await self.commit(reason="turn_detection")  # the open turn ends where its detection changes
            self.in_speech = False
        if vad is None:
            self.vad, self.in_speech = None, False
        else:
            if prefix_padding_ms is not None:
                self.prefix = int(prefix_padding_ms * SR / 1000)
            self.vad = vad

    async def clear(self) -> None:
        """Drop buffered audio (``input_audio_buffer.clear``)."""
        await self.vad_settled()
        self._buf, self._buf_n = [], 0
        self.item_id = None
        self._cap_end = None  # a commit after the clear finds nothing of its own: an empty commit
        self.in_speech = False
        self._pre.clear()
        self._pre_n = 0
        if self._partial_task is not None:
            self._partial_task.cancel()
            self._partial_task = None
        self._end_stream()
        await self.emit({"type": "input_audio_buffer.cleared"})

    @property
    def finals_pending(self) -> bool:
        """A committed utterance's final (``completed`` or ``failed``) has not been emitted yet."""
        return self._final_chain is not None and not self._final_chain.done()

    async def drain(self, timeout: float = 60.0) -> None:
        """Wait until every queued final has been emitted."""
        await self.vad_settled()
        if self._final_chain is not None:
            await asyncio.wait_for(asyncio.shield(self._final_chain), timeout)

    async def finish(self, timeout: float) -> None:
        """The server is stopping: wait up to ``timeout`` s for the finals committed so far (the
        server VAD's pending audio first: a pause it finds there still commits). Then each final
        whose transcript is still being made is cut short: it gets ``...failed`` with 503 'the
        server is shutting down' (:func:`~.errors.shutting_down`), those already made still go out,
        all in commit order. Audio not committed is dropped, as by :meth:`close`."""
        try:
            return await asyncio.wait_for(self.drain(timeout), timeout)
        except Exception as e:  # noqa: BLE001 - the time is up (or the VAD failed): cut what is left
            log.debug("stream finish: %s", type(e).__name__)
        self._cut = True
        for t in list(self._transcribing.values()):
            t.cancel()
        if self._final_chain is not None:
            await _ended(self._final_chain)

    async def close(self) -> None:
        self.closed = True
        for t in list(self._tasks):
            t.cancel()
        self._end_stream()

    # ---------------------------------------------------------------- partials
    def _maybe_partial(self) -> None:
        if (self.partial_interval <= 0 or self._partial_task is not None
                or self._buf_n - self._last_partial_n < self.partial_interval):
            return
        self._last_partial_n = self._buf_n
        if self._stream_key is not None:
            if self._stream_dead:
                return
            audio = np.concatenate(self._unsent) if self._unsent else np.zeros(0, np.float32)
            self._unsent, self._unsent_n = [], 0
            new, self._stream_sent = not self._stream_sent, True
            self._partial_task = self._spawn(self._chunk_partial(self.item_id, self._stream_key, audio, new,
                                                                 self._buf_start + self._buf_n))
            return
        audio = np.concatenate(self._buf)
        self._partial_task = self._spawn(self._partial(self.item_id, audio))

    async def _chunk_partial(self, item: str, key: str, audio: np.ndarray, new: bool, audio_end: int) -> None:
        """A chunked partial: the stream's new audio through the model's streamer; its hypothesis
        only grows, so every word before the last started one is final for the deltas."""
        try:
            t0 = time.perf_counter()
            r = await self.backend.stream_chunk(key, audio, self.options, new=new)
            if self.metrics is not None:
                self.metrics.observe("partial", time.perf_counter() - t0)
            if item != self.item_id or self.closed:
                return
            if self.full_partials:
                await self.emit({"type": "conversation.item.input_audio_transcription.partial", "item_id": item,
                                 "content_index": 0, "transcript": r.text.strip(),
                                 "audio_end_ms": self._ms(audio_end)})
            await self._release_words(item, _words(r.stable_text), audio_end)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - no slot, lost state, engine gone: no more partials, the final decides
            log.debug("chunked partial failed: %s", e)
            if item == self.item_id:
                self._stream_dead = True
        finally:
            if self._partial_task is asyncio.current_task():
                self._partial_task = None
                if item == self.item_id and not self.closed:
                    self._maybe_partial()

    async def _release_words(self, item: str, words: list[str], audio_end: int) -> None:
        """Send the words of ``words`` after those already sent as one delta; a list that does not
        extend what was sent (it should always extend it) sends nothing: deltas never retract."""
        n = len(self._emitted)
        if len(words) <= n or any(_norm(a) != _norm(b) for a, b in zip(self._emitted, words)):
            return
        self._emitted = list(words)
        await self.emit({"type": "conversation.item.input_audio_transcription.delta", "item_id": item,
                         "content_index": 0, "delta": (" " if n else "") + " ".join(words[n:]),
                         "audio_end_ms": self._ms(audio_end)})

    async def _partial(self, item: str, audio: np.ndarray) -> None:
        try:
            t0 = time.perf_counter()
            t = await self.backend.transcribe(audio, self.options, priority=PARTIAL, coalesce_key=self.id)
            if self.metrics is not None:
                self.metrics.observe("partial", time.perf_counter() - t0)
            if t is None or item != self.item_id or self.closed:
                return
            if self.full_partials:
                await self.emit({"type": "conversation.item.input_audio_transcription.partial", "item_id": item,
                                 "content_index": 0, "transcript": t.text.strip(),
                                 "audio_end_ms": self._ms(self._buf_start + audio.size)})
            hyp = _words(t.text)
            agree = 0
            for a, b in zip(self._prev_hyp, hyp):
                if _norm(a) != _norm(b):
                    break
                agree += 1
            self._prev_hyp = hyp
            if agree > len(self._emitted):
                await self._release_words(item, self._emitted + hyp[len(self._emitted):agree],
                                          self._buf_start + audio.size)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - a failed partial is not fatal; the final decides
            log.debug("partial failed: %s", e)
        finally:
            if self._partial_task is asyncio.current_task():
                self._partial_task = None
                if item == self.item_id and not self.closed:
                    self._maybe_partial()  # audio that arrived meanwhile: cadence = max(interval, model latency)

    # ------------------------------------------------------------------ finals
    async def _final(self, item: str, audio: np.ndarray, emitted: list[str], prev: asyncio.Task | None) -> None:
        t0 = time.perf_counter()
        try:
            if self.finalize is not None:
                t = await self.finalize(audio, self.options)
            else:
                t = await self.backend.transcribe(audio, self.options, priority=FINAL)
            err = None
        except asyncio.CancelledError:
            if not self._cut:
                raise
            t, err = None, shutting_down()  # finish(): the server's stop leaves it no time
        except Exception as e:  # noqa: BLE001
            t, err = None, e
        finally:
            self._transcribing.pop(item, None)
        if prev is not None:  # finals leave in commit order
            await _ended(prev)
        if self.metrics is not None:
            self.metrics.observe("final", time.perf_counter() - t0)
            self.metrics.audio_seconds.labels("stream").inc(audio.size / SR)
        if err is not None:
            return await self._failed(item, err)
        text = t.text.strip()
        words = _words(text)
        if emitted and len(words) > len(emitted):
            # the words after those already sent, as the last delta. If the final revised a word
            # already sent (two partials agreed on it, the whole utterance says otherwise), the
            # deltas cannot take it back: they then differ from the final in that word only, and
            # ``completed.transcript`` is authoritative. Never leave the rest of the utterance out.
            await self.emit({"type": "conversation.item.input_audio_transcription.delta", "item_id": item,
                             "content_index": 0, "delta": " " + " ".join(words[len(emitted):])})
        elif not emitted and text:
            await self.emit({"type": "conversation.item.input_audio_transcription.delta", "item_id": item,
                             "content_index": 0, "delta": text})
        await self.emit({"type": "conversation.item.input_audio_transcription.completed", "item_id": item,
                         "content_index": 0, "transcript": text})

    async def _failed(self, item: str, err: BaseException) -> None:
        """``...transcription.failed`` for ``item``, with ``err`` as OpenAI's error object."""
        _, body = error_body(err)
        await self.emit({"type": "conversation.item.input_audio_transcription.failed", "item_id": item,
                         "content_index": 0, "error": body["error"]})
