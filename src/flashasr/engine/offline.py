"""Offline Parakeet-TDT engine: many waveforms in memory -> token ids / frames / durations.

Pipeline per batch (inputs sorted by length and packed into encoder profiles)::

    numpy float32 16 kHz --PinnedUploader--> GPU [B, N]
        --EncoderProfiles (CUDA graph: log-mel -> FastConformer -> joint encoder projection)-->
        [B, T, J] --TDTGraphDecoder (full-graph label looping)--> tokens, frames, durations

Stage times are wall-clock with a device synchronisation at each stage boundary (the decoder
synchronises at its end anyway); ``OfflineOutput.timings`` splits the wall time. Inputs longer than the largest profile run
eagerly at their own shape (logged); empty inputs give empty results.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..errors import FlashASRError
from ..models.base import as_waveform
from .features_gpu import PinnedUploader
from .profiles import EncoderProfiles, Profile, choose_profiles
from .tdt_graphs import DecodeMode, TDTGraphDecoder

log = logging.getLogger(__name__)

#: rows the pipelined path gathers into one decoder launch (see OfflineParakeetEngine.decode_groups)
DECODE_GROUP_ROWS = 256


@dataclass
class OfflineItem:
    """Result for one input: token ids, emission frames and durations (encoder frames of
    ``frame_seconds``), and the decoded text (when the model has a tokenizer)."""

    token_ids: list[int]
    token_frames: list[int]
    token_durations: list[int]
    text: str | None = None


@dataclass
class OfflineOutput:
    """Results in input order; ``timings`` in seconds: ``host_prep`` (padding into pinned memory),
    ``upload``, ``encoder`` (features + encoder + projection), ``decoder`` (incl. device->host
    copy and Python lists), ``total`` (wall), ``text`` (tokenizer, outside ``total``); ``audio_seconds``; ``batches`` = list
    of (profile batch, profile seconds, rows) actually run; ``decoder_modes`` used."""

    items: list[OfflineItem]
    timings: dict = field(default_factory=dict)
    audio_seconds: float = 0.0
    batches: list = field(default_factory=list)
    decoder_modes: dict = field(default_factory=dict)

    @property
    def speed_factor(self) -> float:
        """Audio seconds per wall second (RTFx)."""
        return self.audio_seconds / max(1e-12, self.timings.get("total", 0.0))


class OfflineParakeetEngine:
    """Batched offline transcription of in-memory waveforms with a Parakeet-TDT model.

    Args:
        model: :class:`flashasr.models.parakeet.model.ParakeetASR` (on the target device).
        profiles: encoder profiles (default :func:`~flashasr.engine.profiles.choose_profiles`).
        dtype: encoder dtype (bf16 on CUDA by default; norms stay float32).
        decoder_dtype: predictor/joint dtype (default float32).
        decoder_mode: preferred :class:`~flashasr.engine.tdt_graphs.DecodeMode`.
        use_graphs / compile / cudnn_benchmark / conv_channels_last / fast_attention / fuse: see
            :class:`~flashasr.engine.profiles.EncoderProfiles`.
        with_text: decode token ids to text with the model's tokenizer.
        launch_cost_s: fixed cost of one batch (graph replays, decoder, synchronisation) in
            seconds of audio the encoder would process meanwhile; :meth:`plan` trades it
            against padding (default 16 s: about 2 ms of an H200 at ~8,000x).
        decoder_priority: CUDA priority of the pipelined decoder's side stream (0 = default,
            the lowest; negative = higher than the encoder's stream, so the latency-bound
            decoder steps are scheduled ahead of the encoder's large kernels).
        decode_group_rows: the pipelined path decodes consecutive profile batches together until
            a launch holds this many rows (:meth:`decode_groups`; default
            :data:`DECODE_GROUP_ROWS`, or the environment's ``FLASHASR_DECODE_GROUP_ROWS``; 1: one
            decoder launch per profile batch, as before 2026-12-06).

    The engine works IN PLACE on ``model`` (one copy of the weights): it puts the model in eval
    mode, applies the exact-math encoder fusions and fast attention, casts the encoder to
    ``dtype`` (norms float32) and the predictor/joint to ``decoder_dtype``. The model's own
    methods keep working (the fused encoder computes the same function, ``state_dict`` still
    gives the unfused weights), but in the engine's precision. Calls are serialised by a lock:
    static buffers, CUDA graphs and the pinned upload buffer are single-user.

    Raises:
        FlashASRError: ``invalid_profiles`` for an empty profile list or a bad ``launch_cost_s``.
    """

    def __init__(self, model, *, profiles: Sequence[Profile] | None = None, dtype: torch.dtype | None = None,
                 decoder_dtype: torch.dtype = torch.float32, decoder_mode: DecodeMode | str = DecodeMode.FULL_GRAPH,
                 use_graphs: bool = True, compile: bool | str = False, with_text: bool = True,
                 cudnn_benchmark: bool = False, conv_channels_last: bool = False, fast_attention: bool = True,
                 fuse: bool = True, launch_cost_s: float = 16.0, decoder_priority: int = 0,
                 decode_group_rows: int | None = None):
        if profiles is not None and len(profiles) == 0:
            raise FlashASRError("OfflineParakeetEngine: profiles is empty (pass None for the defaults)",
                                code="invalid_profiles")
        if not (isinstance(launch_cost_s, (int, float)) and math.isfinite(launch_cost_s) and launch_cost_s >= 0):
            raise FlashASRError(f"OfflineParakeetEngine: launch_cost_s must be a finite number >= 0, got "
                                f"{launch_cost_s!r}", code="invalid_profiles")
        parts = [p for p in (getattr(model, n, None) for n in ("encoder", "predictor", "joint", "preprocessor"))
                 if isinstance(p, torch.nn.Module)]
        if any(m.training for p in parts for m in p.modules()):
            log.info("OfflineParakeetEngine: model put in eval mode (inference; BatchNorm running statistics)")
            for p in parts:
                p.eval()
        self.model = model
        self._lock = threading.RLock()
        self._open: OfflineTicket | None = None  # the call submitted last whose last decode is unread
        self._last_decode = None  # CUDA event: the decode launched last has read its input (static output)
        self.decoder_priority = int(decoder_priority)
        if decode_group_rows is None:
            decode_group_rows = int(os.environ.get("FLASHASR_DECODE_GROUP_ROWS", DECODE_GROUP_ROWS))
        self.decode_group_rows = int(decode_group_rows)
        self.launch_cost_s = float(launch_cost_s)
        self.device = next(model.encoder.parameters()).device
        model.predictor.to(decoder_dtype)
        model.joint.to(decoder_dtype)
        self.encoder = EncoderProfiles(model, profiles or choose_profiles(), dtype=dtype, project=True,
                                       use_graphs=use_graphs, compile=compile, cudnn_benchmark=cudnn_benchmark,
                                       conv_channels_last=conv_channels_last, fast_attention=fast_attention,
                                       fuse=fuse)
        self.decoder = TDTGraphDecoder(model.predictor, model.joint, mode=decoder_mode)
        self.uploader = PinnedUploader(self.device)
        self.with_text = with_text
        self.sample_rate = int(getattr(model, "sample_rate", 16000))
        self.frame_seconds = float(getattr(model, "frame_seconds", 0.08))
        self.warmup_report: list[dict] = []  # per profile, the last warmup()'s capture seconds
        # like ParakeetASR: inputs shorter than one encoder frame (80 ms) give an empty result
        self.min_samples = int(model.preprocessor.hop_length * model.encoder.cfg.subsampling_factor)

    def plan(self, lengths: Sequence[int]) -> list[tuple[Profile | None, list[int]]]:
        """Group input indices into batches, each run in one encoder profile.

        Inputs shorter than one encoder frame are left out (their result is empty); inputs
        longer than every profile form single-row batches with profile None (eager). The rest,
        sorted by length (longest first), is cut into consecutive runs by dynamic programming
        so that the padded work -- sum over batches of ``profile.batch x profile.samples`` plus
        ``launch_cost_s`` of audio per batch (the fixed cost of one graph replay and decode) --
        is smallest. A run starting at input i always fills its profile's rows (fewer rows in the
        same profile never cost less), so only one transition per candidate profile is
        tried: O(inputs x profiles).
        """
        order = sorted((i for i in range(len(lengths)) if lengths[i] >= self.min_samples),
                       key=lambda i: -lengths[i])
        bounds, cands = self._plan_candidates()
        max_samples = bounds[-1]
        plan: list[tuple[Profile | None, list[int]]] = []
        k0 = 0
        while k0 < len(order) and lengths[order[k0]] > max_samples:
            plan.append((None, [order[k0]]))
            k0 += 1
        rest = order[k0:]
        n = len(rest)
        if not n:
            return plan
        launch = self.launch_cost_s * self.sample_rate
        inf = float("inf")
        cost = [inf] * n + [0.0]  # cost[i]: cheapest plan for rest[i:]
        choice: list[tuple[Profile, int] | None] = [None] * n
        k = 0  # rest is sorted longest first: as i falls the need grows, so k only rises
        for i in range(n - 1, -1, -1):
            need = lengths[rest[i]]
            while bounds[k] < need:
                k += 1
            for p, rows, work in cands[k]:
                j = min(n, i + rows)
                c = work + launch + cost[j]
                if c < cost[i]:
                    cost[i], choice[i] = c, (p, j)
        i = 0
        while i < n:
            p, j = choice[i]
            plan.append((p, rest[i:j]))
            i = j
        return plan

    def _plan_candidates(self) -> tuple[list[int], list[list[tuple[Profile, int, int]]]]:
        """The length boundaries of the profiles (samples, ascending) and, per boundary, for each
        batch size the shortest profile of at least that length as ``(profile, rows, padded
        samples)``. Computed once per profile set (it cost ~3 ms per call when rebuilt: O(profiles^2)
        property reads)."""
        key = tuple(self.encoder.profiles)
        cached = getattr(self, "_cands_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        bounds = sorted({p.samples for p in key})
        cands = []
        for b in bounds:
            best: dict[int, Profile] = {}
            for q in key:
                if q.samples >= b and (q.batch not in best or q.samples < best[q.batch].samples):
                    best[q.batch] = q
            cands.append([(q, q.batch, q.batch * q.samples) for q in best.values()])
        self._cands_cache = (key, (bounds, cands))
        return bounds, cands

    def warmup(self, lengths: Sequence[int] | None = None) -> dict:
        """Capture encoder profiles (all, or those ``lengths`` would use) and decoder graphs
        (CUDA only; a no-op on CPU).

        Returns where the time went, in seconds (wall, device synchronised after each capture):
        ``{"encoder_graphs": s, "decoder_graphs": s, "profiles": n}`` (zeros on CPU); a server's
        ``/ready`` shows it (``startup_s``). Per profile in :attr:`warmup_report` (``batch``,
        ``seconds``, ``encoder_s``, ``decoder_s``; ``bench/profile_engine_startup.py``)."""
        out = {"encoder_graphs": 0.0, "decoder_graphs": 0.0, "profiles": 0}
        self.warmup_report = []
        if self.device.type != "cuda":
            return out
        plan = self.plan(lengths) if lengths is not None else [(p, [0] * p.batch) for p in self.encoder.profiles]
        seen = set()
        for p, idx in plan:
            if p is None or p in seen:
                continue
            seen.add(p)
            t0 = time.perf_counter()
            self.encoder.warmup([p])
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            t_enc = int(round(p.seconds / self.frame_seconds)) + 1
            self.decoder.capture(p.batch if lengths is None else len(idx), t_enc)
            torch.cuda.synchronize(self.device)
            t2 = time.perf_counter()
            out["encoder_graphs"] += t1 - t0
            out["decoder_graphs"] += t2 - t1
            self.warmup_report.append({"batch": p.batch, "seconds": p.seconds, "encoder_s": round(t1 - t0, 3),
                                       "decoder_s": round(t2 - t1, 3)})
        out["profiles"] = len(seen)
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}

    @torch.no_grad()
    def transcribe_arrays(self, waveforms: Sequence[np.ndarray], *, pipelined: bool | None = None,
                          checked: bool = False) -> OfflineOutput:
        """Transcribe float32 16 kHz mono waveforms (numpy ``[N]`` each); results in input order.

        ``pipelined`` (default: on CUDA): the decoder of batch k runs on a side stream while
        the encoder of batch k+1 runs and the host prepares batch k+2; timings are then
        ``host_prep``, ``encoder_gpu``/``decoder_gpu`` (device time of each stream, overlapping),
        ``wait`` (host blocked on results) and ``total``, with the counts ``decoder_launches``
        (:meth:`decode_groups`) and ``decoder_captures`` (decoder graphs captured meanwhile). Not pipelined: stages run one after the
        other with a synchronisation between them, and the timings split the wall time.

        Thread-safe: concurrent calls run one after the other. ``checked=True``: the waveforms already
        passed :func:`~flashasr.models.base.as_waveform` (the model interface checked them): not
        checked again (one pass over every sample saved).

        Raises:
            AudioError: an input is not a 1-D float array, or contains NaN or infinite samples.
        """
        waves = list(waveforms) if checked else [as_waveform(w, f"input {i}") for i, w in enumerate(waveforms)]
        with self._lock:
            return self._transcribe_checked(waves, pipelined)

    @torch.no_grad()
    def submit(self, waveforms: Sequence[np.ndarray], *, checked: bool = False) -> "OfflineTicket":
        """:meth:`transcribe_arrays` without waiting: the call's uploads, encoder replays and decoder
        launches are queued on the device and its :class:`OfflineTicket` returned; ``result()``
        gives the :class:`OfflineOutput`, ``wait_encoded()`` blocks until its encoders are done.

        Calls overlap: a call submitted while an earlier one is still on the device queues its
        encoders behind that call's and its decoder behind that call's decoder (whose results are
        read first: the decoder's output buffers are shared), so the earlier call's decoder and
        host work (results, transcripts) run while the device encodes the next call. Results equal
        :meth:`transcribe_arrays`' (same plan, same graphs). On the CPU the call runs at once.
        Arguments and errors as :meth:`transcribe_arrays`.
        """
        waves = list(waveforms) if checked else [as_waveform(w, f"input {i}") for i, w in enumerate(waveforms)]
        with self._lock:
            if self.device.type != "cuda":
                return OfflineTicket.finished(self._transcribe_checked(waves, False))
            return self._launch(waves, [len(w) for w in waves])

    def _transcribe_checked(self, waves: list[np.ndarray], pipelined: bool | None) -> OfflineOutput:
        lengths = [len(w) for w in waves]
        if self._open is not None:  # a submitted call's decode is read before the buffers are reused
            self._open._finish_pending()
            self._open = None
        cuda = self.device.type == "cuda"
        if pipelined is None:
            pipelined = cuda
        if pipelined and cuda:
            return self._launch(waves, lengths).result()
        items: list[OfflineItem | None] = [None] * len(waves)
        t = {"host_prep": 0.0, "upload": 0.0, "encoder": 0.0, "decoder": 0.0}
        batches, modes = [], {}

        def sync():
            if cuda:
                torch.cuda.synchronize()

        sync()
        t_start = time.perf_counter()
        for prof, idx in self.plan(lengths):
            h0 = time.perf_counter()
            rows = [waves[i] for i in idx]
            if prof is None:
                log.info("input of %.1f s is longer than every encoder profile: running eagerly",
                         lengths[idx[0]] / self.sample_rate)
            audio, alen = self.uploader.upload(rows)
            h1 = time.perf_counter()
            sync()
            h2 = time.perf_counter()
            if prof is None:
                f, flen = self.encoder.forward_eager(audio, alen)
            else:
                f, flen = self.encoder.run(audio, alen, prof)
            sync()
            h3 = time.perf_counter()
            res = self.decoder.decode(f, flen, projected=True, lengths_checked=True)  # ends with the device->host copy
            h4 = time.perf_counter()
            t["host_prep"] += h1 - h0
            t["upload"] += h2 - h1
            t["encoder"] += h3 - h2
            t["decoder"] += h4 - h3
            modes[res.mode] = modes.get(res.mode, 0) + 1
            for k, i in enumerate(idx):
                items[i] = OfflineItem(res.token_ids[k], res.token_frames[k], res.token_durations[k])
            batches.append((prof.batch if prof else None, prof.seconds if prof else None, len(idx)))
        t["total"] = time.perf_counter() - t_start
        return self._output(items, t, lengths, batches, modes)

    def _output(self, items, t, lengths, batches, modes) -> OfflineOutput:
        """Empty results for inputs shorter than one encoder frame, texts (outside ``total``)."""
        for i, it in enumerate(items):
            if it is None:
                items[i] = OfflineItem([], [], [])
        if self.with_text and getattr(self.model, "tokenizer", None) is not None:
            t0 = time.perf_counter()
            for it in items:
                it.text = self.model.tokenizer.decode(it.token_ids)
            t["text"] = time.perf_counter() - t0
        return OfflineOutput(items, t, sum(lengths) / self.sample_rate, batches, modes)

    def decode_groups(self, plan: list[tuple[Profile | None, list[int]]]) -> list[list[int]]:
        """Which consecutive plan entries (indices into ``plan``) share one decoder launch.

        Label looping runs until the longest row of a launch is done, and a step is bound by its
        kernel launches more than by its rows (on the H200 one decode of 512 rows took 2.6x one
        of 64, ``bench/results/gpu_decoder_fused.json``): the decoder's time follows the number
        of launches times their frames more than the rows. A plan of a call with mixed lengths has many small entries (a 512-piece call of a
        job: about 10), so the entries are decoded together, longest first, until a group holds
        ``decode_group_rows`` rows; a group never grows past ``2 x decode_group_rows`` rows (or
        its first entry's) and an eager entry (an input longer than every profile) decodes alone.
        ``decode_group_rows <= 1``: one launch per entry.
        """
        G = self.decode_group_rows
        groups: list[list[int]] = []
        rows = 0
        for k, (prof, idx) in enumerate(plan):
            alone = prof is None or G <= 1
            if (groups and not alone and rows < G and rows + len(idx) <= 2 * G
                    and plan[groups[-1][-1]][0] is not None):
                groups[-1].append(k)
                rows += len(idx)
            else:
                groups.append([k])
                rows = len(idx)
        return groups

    def _launch(self, waves, lengths) -> "OfflineTicket":
        """Queue one call's work (lock held): encoders on the current stream, decoders on a side
        stream, the decode of group g running while the encoders of group g + 1 do
        (:meth:`decode_groups`); the last group's decode is left running (the ticket's
        ``result()`` reads it). The call before it (``self._open``) keeps running meanwhile: its
        last decode's results are read just before this call's first decoder launch."""
        main = torch.cuda.current_stream()
        if getattr(self, "_side", None) is None:
            self._side = torch.cuda.Stream(priority=self.decoder_priority)
        side = self._side
        tk = OfflineTicket(self, len(waves), lengths)
        plan = self.plan(lengths)
        captures = self.decoder.captures
        if self._open is None:
            torch.cuda.synchronize()  # timings of a call alone start with an idle device
        tk.t_start = time.perf_counter()
        try:
            for group in self.decode_groups(plan):
                outs = []  # per entry: (encoder output [rows, T, J], lengths [rows]), copied when the group has several
                for k in group:
                    prof, idx = plan[k]
                    h0 = time.perf_counter()
                    audio, alen = self.uploader.upload([waves[i] for i in idx])
                    tk.t["host_prep"] += time.perf_counter() - h0
                    last = self._last_decode
                    if last is not None:
                        main.wait_event(last)  # the static encoder outputs may be reused
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record(main)
                    if prof is None:
                        f, flen = self.encoder.forward_eager(audio, alen)
                    else:
                        f, flen = self.encoder.run(audio, alen, prof)
                    if len(group) > 1:  # the next profile run overwrites the graphs' static outputs
                        f, flen = f.clone(), flen.clone()
                    e1.record(main)
                    tk.enc_ev.append((e0, e1))
                    outs.append((f, flen))
                    tk.batches.append((prof.batch if prof else None, prof.seconds if prof else None, len(idx)))
                if len(outs) == 1:
                    f, flen = outs[0]
                else:
                    T = max(o[0].shape[1] for o in outs)
                    f = torch.cat([o[0] if o[0].shape[1] == T else
                                   torch.nn.functional.pad(o[0], (0, 0, 0, T - o[0].shape[1])) for o in outs])
                    flen = torch.cat([o[1] for o in outs])
                # the decoder's buckets are shared: the decode launched last is read before the next launch
                if tk.pending is not None:
                    tk._finish_pending()
                elif self._open is not None:
                    self._open._finish_pending()
                    self._open = None
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    d0 = torch.cuda.Event(enable_timing=True)
                    d0.record(side)
                    pend = self.decoder.decode_async(f, flen, projected=True, lengths_checked=True)
                    d1 = torch.cuda.Event(enable_timing=True)
                    d1.record(side)
                tk.dec_ev.append((d0, d1))
                # kept alive until the decode is read: the joined f and flen were made on this stream and are
                # read on the decoder's; freed now, the next encoder run could reuse their memory first
                tk.pending = (pend, [i for k in group for i in plan[k][1]], (f, flen, outs), len(outs) == 1)
                # a decode that reads an encoder graph's static output: the next encoder replays wait for it
                self._last_decode = pend.input_consumed if len(outs) == 1 else None
        except BaseException:
            if tk.pending is not None:  # leave no launch unread behind a failed call
                tk.pending[0].result()
                tk.pending = None
            raise
        tk.captures0 = captures
        if tk.pending is not None:  # (a call with nothing to decode leaves the open one open)
            self._open = tk
        return tk


class OfflineTicket:
    """One call of :meth:`OfflineParakeetEngine.submit`, queued on the device.

    ``wait_encoded()`` blocks until the call's encoder work is done (its decoder may still run;
    ``encoded()`` asks without blocking);
    ``result()`` waits for the rest and returns the :class:`OfflineOutput` (the same object on
    every call). Both may be called from any thread (the engine's lock serialises them with other
    calls)."""

    def __init__(self, engine: OfflineParakeetEngine | None, n: int, lengths: Sequence[int]):
        self.engine = engine
        self.lengths = list(lengths)
        self.items: list[OfflineItem | None] = [None] * n
        self.t = {"host_prep": 0.0, "wait": 0.0}
        self.batches: list = []
        self.modes: dict = {}
        self.enc_ev: list = []
        self.dec_ev: list = []
        self.pending = None  # (PendingDecode, input indices in row order, the decoder's input kept alive, it is a
        # view of the encoder graphs' static output)
        self.t_start = time.perf_counter()
        self.captures0 = 0
        self._output: OfflineOutput | None = None

    @classmethod
    def finished(cls, out: OfflineOutput) -> "OfflineTicket":
        """A ticket whose output is already computed (the synchronous path)."""
        tk = cls(None, 0, [])
        tk._output = out
        return tk

    def _finish_pending(self) -> None:
        """Read the decode launched last (its results into ``items``)."""
        if self.pending is None:
            return
        pend, idx, _keep, _static = self.pending
        self.pending = None
        w0 = time.perf_counter()
        res = pend.result()
        self.t["wait"] += time.perf_counter() - w0
        self.modes[res.mode] = self.modes.get(res.mode, 0) + 1
        for k, i in enumerate(idx):
            self.items[i] = OfflineItem(res.token_ids[k], res.token_frames[k], res.token_durations[k])

    def wait_encoded(self) -> None:
        """Block until the call's encoder work on the device is done (no lock: only an event)."""
        if self._output is None and self.enc_ev:
            self.enc_ev[-1][1].synchronize()

    def encoded(self) -> bool:
        """Whether the call's encoder work on the device is done (does not block)."""
        return self._output is not None or not self.enc_ev or self.enc_ev[-1][1].query()

    def result(self) -> OfflineOutput:
        """The call's output (waits for its decoder)."""
        if self._output is not None:
            return self._output
        eng = self.engine
        with eng._lock:
            if self._output is None:
                self._finish_pending()
                if eng._open is self:
                    eng._open = None
                t = self.t
                t["total"] = time.perf_counter() - self.t_start
                t["encoder_gpu"] = sum(a.elapsed_time(b) for a, b in self.enc_ev) / 1e3
                t["decoder_gpu"] = sum(c.elapsed_time(d) for c, d in self.dec_ev) / 1e3
                t["decoder_launches"] = len(self.dec_ev)
                t["decoder_captures"] = eng.decoder.captures - self.captures0  # graphs captured during the
                # call (their capture time is inside decoder_gpu)
                self._output = eng._output(self.items, t, self.lengths, self.batches, self.modes)
        return self._output


__all__ = ["OfflineParakeetEngine", "OfflineOutput", "OfflineItem", "OfflineTicket"]
