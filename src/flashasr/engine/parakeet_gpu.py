"""Parakeet-TDT behind the :class:`~flashasr.models.base.ASRModel` interface, run by the GPU engine.

:class:`ParakeetGPUASR` is a :class:`~flashasr.models.parakeet.model.ParakeetASR` whose encoder
batches go through :class:`~flashasr.engine.offline.OfflineParakeetEngine` (encoder shape
profiles captured as CUDA graphs, bf16 weights with float32 norms, full-graph label-looping
TDT decoding with its own fallbacks). Everything around the tokens -- timestamps, words,
segments, the response shape -- is ParakeetASR's; cutting long audio is the pipeline's. The CLI,
the batch jobs and the server get this fast path by loading a Parakeet model on a CUDA device
(:func:`flashasr.pipeline.engines.accelerate` picks it; ``engine="plain"`` or
``FLASHASR_GPU_ENGINE=0`` keeps the plain PyTorch path).

One engine serves one thread at a time (the engine's own lock guards the CUDA graphs and the
pinned buffers): the server's scheduler and the job runner each call from one thread anyway.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from ..models.base import as_waveform
from ..models.parakeet.decoder import Hypothesis
from ..models.parakeet.model import ParakeetASR
from ..options import TranscribeOptions
from .offline import OfflineTicket

log = logging.getLogger(__name__)

SERVING_SMALL_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # profile rows below each boundary's full batch


class ParakeetGPUASR(ParakeetASR):
    """A ParakeetASR (same weights, same tokenizer) whose pieces run through the GPU engine.

    Args:
        asr: a loaded :class:`ParakeetASR` on a CUDA device. Its encoder weights are converted
            in place to the engine's dtype (bf16 by default; norms stay float32): keep using
            this wrapper, not ``asr``, afterwards.
        warmup: capture every encoder profile and the decoder graphs now (seconds; otherwise on
            first use of each shape).
        **engine_kw: passed to :class:`~flashasr.engine.offline.OfflineParakeetEngine`
            (``profiles``, ``dtype``, ``decoder_dtype``, ``decoder_mode``, ``compile``, ...).
            Default profiles: :data:`SERVING_SMALL_BATCHES` below each length boundary's full
            batch, so a server's batch of a few dozen partials runs in a profile of about its
            size (at most 2x padding in rows), not in the full 512-row one.

    Raises:
        ValueError: ``asr`` is not on a CUDA device.

    Output equals the engine's tokens, which equal the plain path's up to bf16 rounding of the
    encoder (the decoder modes give identical tokens; tested on the H200).
    """

    def __init__(self, asr: ParakeetASR, *, warmup: bool = True, **engine_kw):
        from .offline import OfflineParakeetEngine

        if "profiles" not in engine_kw:
            from .profiles import choose_profiles

            engine_kw["profiles"] = choose_profiles(small_batches=SERVING_SMALL_BATCHES)
        # the settings bench_gpu_profile.py measured fastest on the H200 (cuDNN autotuned, NHWC subsampling convs)
        engine_kw.setdefault("cudnn_benchmark", True)
        engine_kw.setdefault("conv_channels_last", True)
        if not str(asr.device).startswith("cuda"):
            raise ValueError(f"ParakeetGPUASR needs a model on a CUDA device, got {asr.device!r}")
        # the same config, modules (weights), tokenizer and settings as ``asr``: no copy
        super().__init__(asr.cfg, asr.net, asr.tokenizer, device=asr.device, dtype=asr.dtype, name=asr.name)
        for k in ("decoding", "batch_size", "pad_min_seconds", "max_segment_seconds"):
            setattr(self, k, getattr(asr, k))
        t0 = time.perf_counter()
        self.engine = OfflineParakeetEngine(asr, with_text=False, **engine_kw)
        t1 = time.perf_counter()
        self.last_timings: dict | None = None  # OfflineOutput.timings of the last engine call
        self.batch_size = max(p.batch for p in self.engine.encoder.profiles)
        # the pipeline's window: pieces the largest profile holds (a longer input runs eagerly)
        self.max_segment_seconds = min(self.max_segment_seconds, max(p.seconds for p in self.engine.encoder.profiles))
        self.engine_info = {"profiles": [(p.batch, p.seconds) for p in self.engine.encoder.profiles],
                            "decoder_mode": str(self.engine.decoder.mode)}
        captures = self.engine.warmup() if warmup else {}  # every profile's encoder and decoder graphs now
        self.engine_info["startup_s"] = {"engine_build": round(t1 - t0, 1),
                                         "graph_warmup": round(time.perf_counter() - t1, 1),
                                         **{k: v for k, v in captures.items() if k != "profiles"}}

    def _decode_pieces(self, pieces: list[np.ndarray]) -> list[Hypothesis]:
        """All pieces in one engine call (it sorts and packs them into profiles itself)."""
        return self._hypotheses(self._submit(pieces))

    def _submit(self, pieces: list[np.ndarray]) -> OfflineTicket:
        """The engine call of ``pieces`` queued on the device (checked by ASRModel.transcribe_batch or
        submit_batch; serialised by the engine's lock)."""
        self.count_encoder_work([len(p) for p in pieces if len(p) >= self.engine.min_samples])
        return self.engine.submit(pieces, checked=True)

    def _hypotheses(self, ticket: OfflineTicket) -> list[Hypothesis]:
        out = ticket.result()
        self._count("features_upload", float(out.timings.get("host_prep", 0.0)))  # one thread: wall ~ CPU
        self.last_timings = dict(out.timings)  # the job report's per-call engine timings
        return [Hypothesis(list(it.token_ids), list(it.token_frames), list(it.token_durations)) for it in out.items]

    def submit_batch(self, waveforms: Sequence[np.ndarray], options: TranscribeOptions | None = None, *,
                     checked: bool = False) -> "SubmittedBatch":
        """:meth:`transcribe_batch` queued on the device without waiting for it: the returned
        :class:`SubmittedBatch`'s ``result()`` gives the transcripts (equal to
        :meth:`transcribe_batch`'s: the same engine call). A batch submitted before an earlier one's
        ``result()`` is read runs its encoders right behind that one's on the device, while that
        one's decoder runs and its transcripts are built (:meth:`OfflineParakeetEngine.submit`).
        Arguments and errors (raised here) as :meth:`transcribe_batch`."""
        opts = TranscribeOptions.build(options).resolve(self.capabilities)
        waves = list(waveforms) if checked else [as_waveform(w, f"waveform {i}") for i, w in enumerate(waveforms)]
        pieces, shifts = self._padded(waves)
        return SubmittedBatch(self, self._submit(pieces), waves, shifts, opts)

    def make_streamer(self, config=None):
        """Chunked streaming partials on this GPU: a
        :class:`~flashasr.engine.stream_graphs.GraphedStreamer` (one CUDA graph per tick of all
        streams) on the engine's encoder (bf16, fused; the same weights as the offline path)."""
        from .stream_graphs import GraphedStreamer

        return GraphedStreamer(self, config)

    def memory_report(self) -> list[dict]:
        """Per captured encoder profile: its shape and the graph memory it added (see EncoderProfiles)."""
        return self.engine.encoder.memory_report()


class SubmittedBatch:
    """A batch of :meth:`ParakeetGPUASR.submit_batch`, queued on the device: ``wait_encoded()``
    blocks until its encoder work is done (``encoded()`` asks without blocking), ``result()``
    returns one Transcript per waveform."""

    def __init__(self, model: ParakeetGPUASR, ticket: OfflineTicket, waves, shifts, options: TranscribeOptions):
        self._model, self._ticket, self._waves, self._shifts, self._options = model, ticket, waves, shifts, options
        self._out: list | None = None

    def wait_encoded(self) -> None:
        if self._ticket is not None:
            self._ticket.wait_encoded()

    def encoded(self) -> bool:
        """Whether its encoder work is done (does not block)."""
        return self._ticket is None or self._ticket.encoded()

    def result(self) -> list:
        if self._out is None:
            m = self._model
            self._out = m._transcripts(m._hypotheses(self._ticket), self._waves, self._shifts, self._options)
            self._ticket = self._waves = None
        return list(self._out)


__all__ = ["ParakeetGPUASR", "SubmittedBatch"]
