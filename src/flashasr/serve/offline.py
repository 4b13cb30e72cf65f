"""The serving layer of uploads: one ``POST /v1/audio/*`` through the pipeline every door uses.

::

    multipart body ──read_multipart──► form + file ──parse_upload──► UploadRequest (options, format)
         (event loop, streamed)                         options.resolve(model capabilities)
                                                                    │
    file ──load_audio──► float32 [N] 16 kHz ──plan_pieces──► [(start, end)] sample ranges
         (CPU pool;                           (CPU pool: Silero VAD; never the model thread;
          a long upload: load_audio_parallel,  a short recording without VAD to run: on the
          its time ranges in decode processes; event loop, it is one piece)
          sequential in a multi-mode front end,
          which may not start processes; a
          short PCM WAV at the model's rate:
          on the event loop, a conversion)
                                                                    │
    backend.transcribe_pieces ──► Transcript per piece ──merge_pieces──► Transcript ──► reply
         (scheduler: pieces of many uploads batched, uploads take turns piece by piece)

The cutting is :func:`flashasr.pipeline.plan_pieces` and the merging
:func:`flashasr.pipeline.merge_pieces`, the same functions as ``flashasr.transcribe`` and the
CLI, so an upload's transcript equals theirs for the same audio and options
(``segmentation=none``: one piece, Whisper's own 30 s seek). No speech: no piece, no model call,
an empty transcript. A refused option (translate on a model that cannot, a language outside the
model's) is answered before the body is decoded; translate before the body is even read.
Follows vLLM's serving layer (``OpenAIServingTranscription``: the server cuts, the model
transcribes what it is given).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from ..errors import AudioError, EmptyAudioError, FlashASRError
from ..formats import render
from ..options import ModelCapabilities, TranscribeOptions
from ..pipeline import default_vad_device, merge_pieces, needs_vad, plan_many, plan_pieces
from ..types import Transcript
from .context import ServeContext
from .errors import APIError
from .protocol import UploadRequest, parse_upload, sse_events
from .scheduler import OFFLINE, SHORT_S
from .upload import read_multipart

log = logging.getLogger("flashasr.serve")

DRAIN_BYTES = 64 << 20   # after a refusal we keep reading (and discarding) this much so the client sees the reply
DRAIN_SECONDS = 5.0


class UploadTranscriber:
    """Answers transcription and translation uploads (``await transcriber(request, task)``)."""

    def __init__(self, ctx: ServeContext):
        self.ctx = ctx

    async def __call__(self, request: Request, task: str) -> Response:
        """One upload -> its reply (JSON, text, SRT, VTT or SSE), or 499 when the client left.

        Raises:
            FlashASRError subclasses (APIError, AudioError, InvalidRequestError, ...): the app maps
            them to OpenAI's error JSON.
        """
        ctx, m = self.ctx, self.ctx.metrics
        await self._refuse_task_early(request, task)
        t0 = time.perf_counter()
        with await self._read(request) as up:
            t1 = time.perf_counter()
            m.observe("upload", t1 - t0)
            if up.file is None:
                raise APIError("missing 'file' part (multipart field 'file' with a filename)", param="file")
            if up.file_size == 0:
                raise EmptyAudioError(f"uploaded file {up.filename!r} is empty (0 bytes)")
            req = parse_upload(up, task)
            caps = await ctx.capabilities()
            opts = req.options.resolve(caps)
            if _decodes_inline(up, caps.sample_rate):  # a copy and a conversion: no pool queue, no thread hop
                wav, damage = self._decode(up, caps.sample_rate)
            else:
                wav, damage = await _decoded(ctx.pool.submit(self._decode, up, caps.sample_rate,
                                                             urgent=up.file_size <= SHORT_UPLOAD_BYTES))
        timing = StageTimes(upload=t1 - t0, decode=time.perf_counter() - t1)
        m.observe("decode", timing.decode)
        for w in damage:  # the server's log says it too (stderr)
            msg = w["message"]  # the decoder's message names the upload already ("uploaded file 'x.wav': ...")
            log.warning("%s", msg if repr(up.filename) in msg else f"upload {up.filename!r}: {msg}")
        samples, segment = wav.samples, wav.segment
        del wav  # the samples are all this request keeps of its decode
        try:
            transcript = await _unless_client_leaves(request, self.transcribe(samples, opts, caps, timing=timing,
                                                                              warnings=damage, segment=segment))
        finally:
            unlink_segment(segment)
        if transcript is None:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        m.observe("request", time.perf_counter() - t1)
        m.audio_seconds.labels("offline").inc(transcript.duration)
        return respond(transcript, req, ignored=caps.ignored(opts), timing=timing)

    async def transcribe(self, samples, options: TranscribeOptions, caps: ModelCapabilities, *,
                         priority: int = OFFLINE, pool=None, warnings=(),
                         timing: "StageTimes | None" = None, segment: str | None = None) -> Transcript:
        """Plan (CPU pool), transcribe the pieces (backend), merge: float32 ``[N]`` at
        ``caps.sample_rate`` and resolved ``options`` -> the recording's Transcript
        (``duration = N / sample_rate``). ``priority``: the scheduler's (a stream's final:
        ``FINAL``); ``pool``: where to plan (default the CPU pool); ``warnings``: the recording's
        own (a damaged upload), first in the transcript's; ``timing``, when given, gets the plan
        and transcribe times; ``segment``: the shared-memory segment that holds ``samples``
        (the backend may hand it over instead of a copy; the caller unlinks it)."""
        ctx, m = self.ctx, self.ctx.metrics
        t0 = time.perf_counter()
        pool = pool or ctx.pool
        short = samples.size <= SHORT_S * caps.sample_rate
        if short and not needs_vad(int(samples.size), options, caps):  # nothing to decide: no pool hop
            pieces = plan_pieces(samples, options, caps)
        else:
            probs = await self._speech_probabilities(samples, options, caps, pool)
            pieces = await pool.run(self._plan, samples, options, caps, probs, urgent=short)
        t1 = time.perf_counter()
        m.observe("plan", t1 - t0)
        parts = []
        if pieces:
            parts = await ctx.backend.transcribe_pieces(samples, pieces, options, priority=priority,
                                                        timeout=ctx.cfg.request_timeout_s, segment=segment)
        t2 = time.perf_counter()
        m.observe("transcribe", t2 - t1)
        if timing is not None:
            timing.plan, timing.transcribe = t1 - t0, t2 - t1
        sr = caps.sample_rate
        return merge_pieces([(a / sr, t) for (a, _b), t in zip(pieces, parts)], samples.size / sr, options=options,
                            caps=caps, warnings=warnings)

    async def _speech_probabilities(self, samples, options: TranscribeOptions, caps: ModelCapabilities, pool):
        """A long recording's CPU VAD as bulk jobs of ``VAD_SLICE_CHUNKS`` state chunks each (about a
        minute of audio, ~0.1 CPU-s), so a short request's work waits behind one slice, not behind a
        whole upload's VAD; the slices are :func:`~flashasr.audio.vad.speech_probabilities` over
        chunk-aligned frame ranges, so their concatenation equals one call's result. None: the
        recording is short, needs no VAD, or gets it elsewhere (the GPU, see :meth:`_plan`)."""
        sr = caps.sample_rate
        if (samples.size <= SHORT_S * sr or sr != 16000 or self._vad_device(samples, caps) != "cpu"
                or not needs_vad(int(samples.size), options, caps)):
            return None
        from ..audio.vad import FRAME, STATE_CHUNK_FRAMES, speech_probabilities

        frames, step = -(-int(samples.size) // FRAME), VAD_SLICE_CHUNKS * STATE_CHUNK_FRAMES
        parts = await asyncio.gather(*(pool.run(speech_probabilities, samples, sr, (lo, min(frames, lo + step)))
                                       for lo in range(0, frames, step)))
        return np.concatenate(parts)

    def _vad_device(self, samples, caps: ModelCapabilities) -> str:
        if samples.size > GPU_VAD_MIN_S * caps.sample_rate and getattr(self.ctx.backend, "mode", "") != "multi":
            return default_vad_device(self.ctx.cfg.device)
        return "cpu"

    def _plan(self, samples, options: TranscribeOptions, caps: ModelCapabilities,
              probs=None) -> list[tuple[int, int]]:
        """:func:`~flashasr.pipeline.plan_pieces` in the CPU pool; a recording longer than
        ``GPU_VAD_MIN_S`` in single mode with the model on CUDA has its VAD run there
        (:func:`~flashasr.pipeline.plan_many`, the job runner's rule: a 1-hour upload's VAD takes
        a fraction of a second instead of ~8 CPU-seconds; both give the same pieces,
        so short uploads keep the CPU VAD and leave the GPU to the model). ``probs``: the CPU VAD's
        probabilities when already computed (:meth:`_speech_probabilities`)."""
        vad = self._vad_device(samples, caps)
        if vad == "cpu":
            return plan_pieces(samples, options, caps, probs=probs)
        return plan_many([samples], options, caps, vad_device=vad)[0]

    async def _refuse_task_early(self, request: Request, task: str) -> None:
        """A task the (known) model cannot do is refused before the body is read: no upload, no decode."""
        caps = self.ctx.backend.capabilities
        if caps is None:
            return
        try:
            TranscribeOptions(task=task).resolve(caps)
        except FlashASRError:
            await drain(request)
            raise

    async def _read(self, request: Request):
        cfg = self.ctx.cfg
        try:
            return await read_multipart(request, max_bytes=cfg.max_upload_bytes, body_timeout=cfg.body_timeout_s)
        except APIError as e:
            if e.status == 413:
                await drain(request)
            raise

    def _decode(self, up, rate: int):
        """Container decode + resample to ``rate`` (runs in the CPU pool; PyAV and soxr release the GIL):
        ``(DecodedAudio, its damage warnings)`` (:meth:`~flashasr.audio.DecodedAudio.damage`, naming
        the upload). An upload on disk is decoded by :func:`~flashasr.audio.load_audio_parallel`
        through its ``/proc/self/fd`` path (one long file on several workers, same samples); in
        multi mode, when those workers are processes, the samples' shared-memory segment keeps its
        name (``DecodedAudio.segment``) so the engine maps the same pages: a 4-hour upload's 880 MB
        are not copied into a second segment."""
        from ..audio import load_audio, load_audio_parallel

        workers = self.ctx.cfg.decode_workers
        path = _upload_path(up.file, up.file_size) if workers != 1 else None
        try:
            if path is not None:
                wav = load_audio_parallel(path, target_rate=rate, max_duration=self.ctx.cfg.max_audio_s,
                                          workers=workers, keep_segment=getattr(self.ctx.backend, "mode", "") == "multi")
            else:
                wav = load_audio(up.file, target_rate=rate, max_duration=self.ctx.cfg.max_audio_s)
            damage = wav.damage(path)
            for w in damage:
                w["message"] = f"uploaded file {up.filename!r}: {w['message']}"
            return wav, damage
        except AudioError as e:
            msg = str(e)
            label = repr(path) if path is not None else None
            if label is not None and msg.startswith(label):  # name the upload, not our temp file
                msg = f"uploaded file {up.filename!r}" + msg[len(label):]
            elif msg.startswith("<") and ">" in msg:  # name the upload, not our temp file object
                msg = f"uploaded file {up.filename!r}" + msg[msg.index(">") + 1:]
            raise AudioError(msg, code=e.code) from None


async def _decoded(job):
    """The result of a decode submitted to the CPU pool (a concurrent future). When the request is
    cancelled meanwhile (the client left), the decode still finishes: its shared-memory segment,
    if it kept one, is unlinked then."""
    try:
        return await asyncio.wrap_future(job)
    except asyncio.CancelledError:
        job.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or unlink_segment(f.result()[0].segment))
        raise


def unlink_segment(name: str | None) -> None:
    """Unlink a decode's shared-memory segment (None: there is none; a missing one is fine)."""
    if name is not None:
        from ..shm import unlink_segment as unlink

        unlink(name)


GPU_VAD_MIN_S = 120.0  # longer uploads in single mode on CUDA: the batched VAD on the GPU
SHORT_UPLOAD_BYTES = 2 << 20  # an upload this small (>= 65 s of 16 kHz PCM16, ~2 min of 128 kb/s mp3) decodes urgently
VAD_SLICE_CHUNKS = 4  # a long recording's CPU VAD in jobs of 4 state chunks (65.5 s of audio)
PARALLEL_MIN_BYTES = 256 << 10  # smaller uploads hold < 60 s at any usual bit rate: decoded from memory


def _decodes_inline(up, rate: int) -> bool:
    """Whether an upload decodes on the event loop instead of in the CPU pool: a plain PCM WAV
    (:func:`~flashasr.audio.decode.plain_pcm_wav`: read with numpy) already at the model's
    ``rate`` and a short request (at most :data:`~flashasr.serve.scheduler.SHORT_S`, 30 s, by its
    header; the size checked first: at most that much 16-bit stereo). Its decode is a copy and a conversion (about 0.1 ms for 10 s
    at 16 kHz), less than the pool's queue and two thread hand-offs under load (H100, 256 uploads
    in flight over 6 front ends: decode p50 9.9 ms in the pool, ``serve_h100_overlap_before.json``)."""
    from ..audio.decode import plain_pcm_wav

    if up.file is None or up.file_size > int(SHORT_S * rate) * 4 + 4096:
        return False
    try:
        wav = plain_pcm_wav(up.file)
    except (OSError, ValueError, AudioError):  # (a rate out of range: the decode names it)
        return False
    return wav is not None and wav[0] == rate and wav[1] <= SHORT_S


def _upload_path(f, size: int) -> str | None:
    """A path that reopens the spooled upload ``f`` (Linux ``/proc/self/fd/N``: the unlinked temp
    file, each open with its own offset), rolling a large in-memory upload over to its temp file
    first; None for small uploads, for short PCM WAVs
    (:func:`~flashasr.audio.decode.plain_pcm_wav`) or where no such path exists (the decode then
    reads ``f``)."""
    from ..audio.decode import plain_pcm_wav
    from ..audio.parallel import MIN_PARALLEL_S

    if size < PARALLEL_MIN_BYTES or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        wav = plain_pcm_wav(f)
    except AudioError:  # a header's rate out of range: the decode from ``f`` names it
        return None
    if wav is not None and wav[1] < MIN_PARALLEL_S:
        return None  # a short PCM WAV: read from memory at once (a long one still decodes in ranges:
        # in multi mode their shared-memory output crosses to the engine without a copy)
    try:
        if hasattr(f, "rollover"):
            f.rollover()  # SpooledTemporaryFile: an in-memory upload goes to its (unlinked) temp file
        path = f"/proc/self/fd/{f.fileno()}"
    except (AttributeError, OSError, ValueError):
        return None
    return path if os.path.isfile(path) else None


@dataclass
class StageTimes:
    """Seconds an upload spent in each stage: receiving the body, container decode, planning (VAD
    cutting) and transcription (the pieces through the backend)."""

    upload: float = 0.0
    decode: float = 0.0
    plan: float = 0.0
    transcribe: float = 0.0

    def server_timing(self) -> str:
        """The W3C ``Server-Timing`` header value: each stage's ``dur`` in milliseconds, and
        ``total``: decode + plan + transcribe (the server's work after the body arrived)."""
        total = self.decode + self.plan + self.transcribe
        parts = [f"{k};dur={v * 1000:.1f}" for k, v in
                 (("upload", self.upload), ("decode", self.decode), ("plan", self.plan),
                  ("transcribe", self.transcribe), ("total", total))]
        return ", ".join(parts)


def respond(transcript: Transcript, req: UploadRequest, ignored: list[str] = (),
            timing: StageTimes | None = None) -> Response:
    """The reply in the requested shape: SSE events with ``stream=true``, else ``response_format``.
    ``ignored``: request options the model does not use, named in an ``X-Flashasr-Ignored`` header;
    the codes of the transcript's warnings (a damaged input, a repetition cut) are in an
    ``X-Flashasr-Warnings`` header whatever the format (``verbose_json`` holds them in full);
    ``timing``: the stages' times in a ``Server-Timing`` header (read by browsers' developer tools and
    the web page: the request's speed factor)."""
    headers = {"X-Flashasr-Ignored": ", ".join(ignored)} if ignored else {}
    if transcript.warnings:
        headers["X-Flashasr-Warnings"] = ", ".join(dict.fromkeys(w["code"] for w in transcript.warnings))
    if timing is not None:
        headers["Server-Timing"] = timing.server_timing()
    if req.stream:
        return StreamingResponse(sse_events(transcript), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    fmt = req.response_format
    body = render(transcript, fmt, words=req.words if fmt == "verbose_json" else None)
    if fmt in ("json", "verbose_json"):
        return Response(body, media_type="application/json", headers=headers)
    return PlainTextResponse(body, headers=headers)


async def drain(request: Request) -> None:
    """Read and discard the rest of a refused body (bounded), so the client gets our reply."""
    n, t_end = 0, time.monotonic() + DRAIN_SECONDS
    while n < DRAIN_BYTES:
        left = t_end - time.monotonic()
        if left <= 0:
            return
        try:
            msg = await asyncio.wait_for(request.receive(), left)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001
            return
        if msg["type"] != "http.request":
            return
        n += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


async def _unless_client_leaves(request: Request, coro):
    """``await coro``, or None when the client disconnects first (the work is cancelled: removed
    from the scheduler's queue, or CANCEL to the engine). Cancelled itself (a stopping server's
    last cut), it cancels the work too."""
    loop = asyncio.get_running_loop()
    work = loop.create_task(coro)
    watch = loop.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    return None if work.cancelled() else work.result()


async def _until_disconnect(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


__all__ = ["UploadTranscriber", "StageTimes", "respond", "drain"]
