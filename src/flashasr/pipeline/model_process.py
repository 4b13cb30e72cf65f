"""A model loaded and run in a process of its own, called like the model.

Why: the GPU engine's call gives its process's GIL up at every PyTorch operation it issues, and
gets it back only when the interpreter lets it. Beside any busy Python thread of the same process
the call slows by the GIL's switch interval per operation: the job's 512-piece model call took
447-456 ms alone and 960-1,005 ms beside one spinning Python thread, 2,589 ms beside three, and
only 1.04x beside 15 busy processes (H100, ``bench/results/model_contention_h100.json``). A job's
main process has such threads (decoded files arriving, the VAD planner, the conductor, the
writers), so the model runs here, in a process whose one thread is the model's.

Transport (one machine): a batch goes as ``(segment name, byte offset, samples)`` per waveform plus
the options and speech spans, pickled through a pipe; the samples themselves never cross it:

* a waveform lying in a shared-memory segment whose name the job kept (the decode workers'
  segments, :func:`flashasr.shm.take_array` with ``keep_for``) is mapped here by name, no copy;
* any other waveform is copied once into a transfer segment of this object (reused, grown when a
  batch needs more).

The answer is one :class:`~flashasr.types.Transcript` or exception per waveform (the child runs
:func:`flashasr.pipeline.transcribe_pieces`: one bad piece fails alone), plus the child's CPU
seconds for the call and its model's ``stage_cpu_s``. With Parakeet on the GPU engine the child
starts a call that arrives while the one before still encodes right behind it on the device
(:func:`flashasr.pipeline.run.start_pieces`) and then answers the earlier one, whose decoder and
transcripts thus run while the next one encodes. The child ignores SIGINT (the parent decides
when to stop), and ends when the pipe closes, so it never outlives the parent's job.
"""

from __future__ import annotations

import mmap
import os
import pickle
import queue
import threading
import time
import warnings
from typing import Sequence

import numpy as np

from ..errors import FlashASRError, ModelLoadError
from ..models.base import ASRModel, as_waveform
from ..options import TranscribeOptions
from ..shm import populate

#: the child's program: drop the current folder from sys.path, then serve on the socket (argv[1])
_CHILD = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
          "from flashasr.pipeline.model_process import _serve; _serve(int(sys.argv[1]), int(sys.argv[2]))")

#: calls that may be pending in one model process: the one it runs and the next, whose samples it
#: maps and checks meanwhile
IN_FLIGHT = 2

#: attributes of the loaded model the parent mirrors (see :class:`~flashasr.models.base.ASRModel`)
MIRRORED = ("name", "family", "sample_rate", "max_segment_seconds", "long_form", "multilingual", "translates",
            "prompts", "uses_temperature", "uses_speech", "speech_gate", "device")


class ModelProcessError(FlashASRError):
    """The model process died or broke its protocol (not a piece's own failure)."""

    code = "model_process_error"
    status = 500


class ModelProcess(ASRModel):
    """:func:`flashasr.pipeline.load_model` in a spawned process; this object stands in for the model.

    Args:
        spec, device, dtype, engine: as :func:`flashasr.pipeline.load_model` (run in the child).
        start_timeout_s: how long to wait for the child's model to load.
    Attributes:
        the loaded model's :data:`MIRRORED` attributes and ``languages()``; ``stage_cpu_s``: the
        child model's own stage counters (as of the last call); ``last_timings``: its engine's
        timings of the last call (the GPU engine's, else None); ``remote_cpu_s``: the child's CPU
        seconds in calls; ``copied_bytes`` / ``shared_bytes``: samples that crossed by a copy into
        the transfer segment / by mapping a kept segment; ``pid``: the child's process id.
    Raises (constructor):
        what the load raises in the child (``ModelLoadError``, ``UnsupportedModelError``,
        ``invalid_device``...), re-raised here; ModelProcessError when the child dies or does not
        answer within ``start_timeout_s``.
    """

    isolates_pieces = True  # run_pieces: one bad piece fails alone, in one round trip
    maps_shared_memory = True  # waveforms in kept segments cross without a copy (flashasr.shm)

    def __init__(self, spec=None, *, device: str = "cpu", dtype: str | None = None, engine: str = "auto",
                 start_timeout_s: float = 900.0):
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        # a fresh interpreter (not multiprocessing's spawn, which re-runs the caller's main script,
        # nor fork, which would copy a CUDA context); the pipe is a socket pair
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # -c, not -m: the current folder leaves sys.path before anything is imported (a flashasr.py
        # there must not shadow this package), and the child's classes are this module's, not
        # __main__'s (the exceptions it sends back unpickle here)
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid())],
                                      pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(("load", (list(sys.path), spec, device, dtype, engine)))
        self.pid = self._proc.pid
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._seq = 0
        self._pending: list[PendingPieces] = []  # calls sent and not yet answered
        self._answers: dict[int, tuple] = {}  # answers read while waiting for another call's
        self._given_up: set[int] = set()  # calls whose wait was interrupted: their answers are dropped
        self._transfer = [None] * IN_FLIGHT  # this object's transfer segments (SharedMemory), reused
        self.remote_cpu_s = 0.0
        self.copied_bytes = 0
        self.shared_bytes = 0
        self.stage_cpu_s = None
        self.last_timings = None
        self._closed = False
        try:
            if not self._conn.poll(start_timeout_s):
                raise ModelProcessError(f"the model process did not load {spec or 'the default model'} "
                                        f"within {start_timeout_s:g} s")
            try:
                kind, payload = self._recv()
            except (EOFError, OSError) as e:
                raise self._died(e) from None
        except BaseException:
            self.close()
            raise
        if kind == "error":
            self.close()
            raise payload
        for k in MIRRORED:
            setattr(self, k, payload[k])
        self._languages = payload["languages"]

    def languages(self) -> frozenset | None:
        return self._languages

    # ------------------------------------------------------------------ calls
    def transcribe_batch(self, waveforms: Sequence[np.ndarray], options: TranscribeOptions | None = None, *,
                         speech: Sequence | None = None, checked: bool = False, **changes) -> list:
        """:meth:`ASRModel.transcribe_batch`, run in the model process; the first failing
        waveform's error is raised (see :meth:`run_pieces` for per-waveform results). ``checked``
        changes nothing here: the model process checks what it maps itself."""
        opts = TranscribeOptions.build(options, **changes).resolve(self.capabilities)
        outs = self.run_pieces(waveforms, opts, speech)
        for o in outs:
            if isinstance(o, BaseException):
                raise o
        return outs

    def _transcribe(self, waveforms, options):  # pragma: no cover - transcribe_batch is overridden
        return self.transcribe_batch(waveforms, options)

    def run_pieces(self, waveforms: Sequence[np.ndarray], options: TranscribeOptions,
                   speech: Sequence | None = None) -> list:
        """:func:`flashasr.pipeline.transcribe_pieces` in the model process: per waveform (float32
        ``[N_i]`` at the model's rate) its Transcript or the exception it raised alone.

        Raises:
            ModelProcessError: the process died (its exit code named) or was closed.
        """
        return self.start_pieces(waveforms, options, speech).result()

    def start_pieces(self, waveforms: Sequence[np.ndarray], options: TranscribeOptions,
                     speech: Sequence | None = None) -> "PendingPieces":
        """:meth:`run_pieces` without waiting: the batch is sent and the model process takes it
        as soon as the calls before it are done (it maps and checks the samples of the next batch
        while the current one runs). At most :data:`IN_FLIGHT` calls may be pending: keep the
        waveforms alive until their ``result()`` (in any order).

        Raises:
            ModelProcessError: the process died or was closed, or ``IN_FLIGHT`` calls are pending.
        """
        waves = list(waveforms)
        with self._send_lock:
            if self._closed:
                raise ModelProcessError("the model process was closed")
            live = [p for p in self._pending if not p.done]
            if len(live) >= IN_FLIGHT:
                raise ModelProcessError(f"{len(live)} calls are already pending in the model process")
            self._seq += 1
            seq = self._seq
            refs, errors = self._place(waves, slot=seq % IN_FLIGHT)
            keep = [i for i, r in enumerate(refs) if r is not None]
            pend = PendingPieces(self, seq, keep, errors)
            if not keep:
                pend.done = True
                return pend
            spans = None if speech is None else list(speech)
            spans = None if spans is None else [spans[i] for i in keep]
            try:
                self._conn.send(("run", seq, [refs[i] for i in keep], options, spans, keep))
            except (OSError, EOFError, ValueError) as e:
                raise self._died(e) from None
            self._pending = live + [pend]
            return pend

    def _answer(self, seq: int):
        """The child's answer to call ``seq`` (answers come in call order; those read on the way to
        it are kept for their own calls, whose results may be asked for later -- found by a new
        user: read out of order, the earlier call waited forever --, except one to a call given up,
        cut short by an interrupt, which is dropped)."""
        with self._recv_lock:
            while seq not in self._answers:
                try:
                    kind, payload = self._recv()
                except TimeoutError:  # an interrupt (a signal-based time limit), not the pipe (found
                    raise  # by a new user: it made the process look dead for good)
                except (OSError, EOFError) as e:
                    raise self._died(e) from None
                if kind == "done":
                    if payload[0] in self._given_up:
                        self._given_up.discard(payload[0])
                    else:
                        self._answers[payload[0]] = payload
            return self._answers.pop(seq)

    def _give_up(self, seq: int) -> None:
        """Call ``seq``'s wait was interrupted: its answer, read or still to come, is dropped."""
        with self._recv_lock:
            if self._answers.pop(seq, None) is None:
                self._given_up.add(seq)

    def _place(self, waves: list, slot: int = 0) -> tuple[list, list]:
        """Per waveform ``(segment name, byte offset, samples)`` (where the child maps it), or None
        with its error in the second list (not mono float samples, or not finite). Waveforms not
        in a kept segment are copied into transfer segment ``slot`` (one per pending call)."""
        from ..shm import shared_location

        refs: list = [None] * len(waves)
        errors: list = [None] * len(waves)
        copy: list[tuple[int, np.ndarray]] = []
        for i, w in enumerate(waves):
            a = w if isinstance(w, np.ndarray) else np.asarray(w)
            loc = shared_location(a) if a.dtype == np.float32 and a.ndim == 1 else None
            if loc is None:
                try:
                    copy.append((i, as_waveform(a, f"waveform {i}")))
                except Exception as e:  # noqa: BLE001 - this waveform's own failure
                    errors[i] = e
            else:
                refs[i] = (loc[0], loc[1], int(a.size))
                self.shared_bytes += a.nbytes
        if copy:
            need = sum(a.nbytes for _i, a in copy)
            buf = self._transfer_segment(need, slot)
            off = 0
            for i, a in copy:
                np.frombuffer(buf.buf, np.float32, count=a.size, offset=off)[:] = a
                refs[i] = (buf.name, off, int(a.size))
                off += a.nbytes
            self.copied_bytes += need
        return refs, errors

    def _transfer_segment(self, need: int, slot: int):
        from ..shm import create_segment, unlink_segment

        seg = self._transfer[slot]
        if seg is None or seg.size < need:
            if seg is not None:
                seg.close()
                unlink_segment(seg.name)
            seg = self._transfer[slot] = create_segment(max(need, 1 << 20))
        return seg

    def _recv(self):
        kind, payload = self._conn.recv()
        if kind == "gone":
            raise ModelProcessError(f"the model process failed: {payload}")
        return kind, payload

    def _died(self, e: BaseException) -> ModelProcessError:
        if getattr(self, "_closed_by_caller", False):  # close() was called: nothing died (found by a new
            # user: a pending call's result said "died (exit code 0)")
            return ModelProcessError("the model process was closed before this call was answered")
        try:
            code = self._proc.wait(timeout=1.0)
        except Exception:  # noqa: BLE001 - still running: a broken pipe, not a death
            code = None
        self._closed = True
        return ModelProcessError(f"the model process (pid {self.pid}) died (exit code {code}): "
                                 f"{type(e).__name__}: {e}" if code is None else
                                 f"the model process (pid {self.pid}) died (exit code {code})")

    # ------------------------------------------------------------------ life
    def kill(self) -> None:
        """End the model process at once (SIGKILL), even inside a call: that call then raises
        ModelProcessError in its caller. For a job interrupted twice; :meth:`close` still frees
        the rest."""
        try:
            self._proc.kill()
        except OSError:
            pass

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the model process (after the call running, if any) and free the transfer segment."""
        from ..shm import unlink_segment

        if getattr(self, "_closed", True) and not any(getattr(self, "_transfer", None) or ()):
            return
        self._closed = self._closed_by_caller = True
        try:
            self._conn.send(("stop", None))
        except (OSError, EOFError, ValueError):
            pass
        try:
            self._proc.wait(timeout_s)
        except Exception:  # noqa: BLE001 - it did not stop in time
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        for k, seg in enumerate(self._transfer):
            if seg is not None:
                seg.close()
                unlink_segment(seg.name)
                self._transfer[k] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self.close(timeout_s=1.0)
        except Exception:
            pass


class PendingPieces:
    """A batch sent to the model process (:meth:`ModelProcess.start_pieces`); :meth:`result`
    waits for its answer."""

    def __init__(self, owner: ModelProcess, seq: int, keep: list[int], out: list):
        self._owner, self.seq, self._keep, self._out = owner, seq, keep, out
        self.done = False
        self.child_times: tuple[float, float] | None = None  # the model process's time.time() when it
        # started the call and when it answered it (after result(); None for a call with nothing to run)
        self._error: BaseException | None = None

    def result(self) -> list:
        """Per waveform its Transcript or exception (as :meth:`ModelProcess.run_pieces`).

        Raises:
            ModelProcessError: the process died or was closed (again on every later call), or
                an earlier wait for this answer was interrupted (the call was given up).
        """
        if self._error is not None:
            raise self._error
        if self.done:
            return self._out
        try:
            _seq, outs, cpu_s, stages, timings, self.child_times = self._owner._answer(self.seq)
        except ModelProcessError as e:
            self._error = e
            raise
        except BaseException:  # interrupted: its answer, when it comes, is dropped
            self._error = ModelProcessError(f"the wait for model call {self.seq} was interrupted")
            self._owner._give_up(self.seq)
            raise
        finally:
            self.done = True
        o = self._owner
        o.remote_cpu_s += cpu_s
        o.stage_cpu_s = stages
        o.last_timings = timings
        for i, x in zip(self._keep, outs):
            self._out[i] = x
        return self._out


# ---------------------------------------------------------------------- the child
def _portable(x):
    """A result the parent can unpickle: an exception that does not survive pickling becomes a
    FlashASRError with its code and message."""
    if not isinstance(x, BaseException):
        return x
    try:
        pickle.loads(pickle.dumps(x))
        return x
    except Exception:  # noqa: BLE001
        return FlashASRError(f"{type(x).__name__}: {x}", code=str(getattr(x, "code", "internal_error")))


class _Maps:
    """The child's mappings of the parent's segments for one call (opened by name, closed after).

    Per segment only the pages its pieces in this call cover are mapped (:meth:`plan` first): a
    long file's pieces spread over many calls, and each call maps just its own part."""

    def __init__(self):
        self.maps: dict[str, tuple[mmap.mmap, int]] = {}  # name -> (mapping, its start in the segment)
        self.spans: dict[str, tuple[int, int]] = {}  # name -> (first byte, end byte) of this call's pieces

    def plan(self, refs: list) -> None:
        for name, offset, n in refs:
            a, b = self.spans.get(name, (offset, offset))
            self.spans[name] = (min(a, offset), max(b, offset + 4 * n))

    def view(self, name: str, offset: int, n: int) -> np.ndarray:
        got = self.maps.get(name)
        if got is None:
            import _posixshmem

            a, b = self.spans.get(name, (offset, offset + 4 * n))
            start = a - a % mmap.ALLOCATIONGRANULARITY
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
            try:  # read-only (the parent's samples never change)
                m = mmap.mmap(fd, max(1, b - start), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start)
            finally:
                os.close(fd)
            # all pages mapped now, without holding the GIL the main thread needs for the call running
            # meanwhile (flashasr.shm.populate): the engine's copy into pinned memory then takes no faults
            populate(m)
            got = self.maps[name] = (m, start)
        m, start = got
        return np.frombuffer(m, np.float32, count=n, offset=offset - start)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so a killed
    job never leaves its model process running; elsewhere nothing (the pipe's end still stops it)."""
    import signal

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux
        return
    if os.getppid() != parent:  # the parent died before the call above
        os._exit(0)


def _serve(fd: int, parent: int | None = None) -> None:
    """The model process: load, say hello, then run batches until told to stop or the pipe closes
    (a parent gone mid-call: the answer has nowhere to go, the process ends quietly)."""
    try:
        _serve_calls(fd, parent)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass


def _serve_calls(fd: int, parent: int | None) -> None:
    import signal
    import sys
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if parent is not None:
        _die_with_parent(parent)
    # the waveforms are read-only views of the parent's segments: a model that hands one to
    # torch.as_tensor (Whisper's CPU features) reads it, never writes it
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    conn = Connection(fd)
    _kind, (path, spec, device, dtype, engine) = conn.recv()
    sys.path[:] = path + [p for p in sys.path if p not in path]
    from . import load_model
    from .run import start_pieces

    try:
        model = load_model(spec, device=device, dtype=dtype, engine=engine)
        info = {k: getattr(model, k) for k in MIRRORED}
        info["device"] = str(info["device"])
        info["languages"] = model.languages()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        err = _portable(e if isinstance(e, FlashASRError) else
                        ModelLoadError(f"{type(e).__name__}: {e}"))
        conn.send(("error", err))
        return
    conn.send(("hello", info))
    prepared: queue.Queue = queue.Queue()
    threading.Thread(target=_prepare_calls, args=(conn, prepared), name="flashasr-model-prepare", daemon=True).start()
    pending = None  # the call started last: its device work may still run (start_pieces)

    def finish(p) -> bool:
        """Wait for a started call, answer it; False: the call itself failed (the process ends)."""
        seq, started, waves, outs, maps, c0, t0 = p
        try:
            if started is not None:
                for (i, _w), o in zip(waves, started.result()):
                    outs[i] = o
        except BaseException as e:  # noqa: BLE001 - the call itself failed: the parent decides
            conn.send(("gone", f"{type(e).__name__}: {e}"))
            return False
        finally:
            maps.maps.clear()
        stages = dict(getattr(model, "stage_cpu_s", None) or {}) or None
        timings = getattr(model, "last_timings", None)
        conn.send(("done", (seq, [_portable(o) for o in outs], time.process_time() - c0, stages, timings,
                            (t0, time.time()))))
        return True

    while True:
        call = _NOTHING
        while pending is not None and call is _NOTHING:
            # the next call, if it comes while the one started last still encodes on the device,
            # starts right behind it; else that one is answered first (at once when it ran at once:
            # a model without submit_batch, found by a new user: on the CPU each answer waited for
            # the next call)
            if pending[1] is not None and pending[1].on_device:
                try:
                    call = prepared.get(timeout=0.001)
                    break
                except queue.Empty:
                    if not pending[1].encoded():
                        continue
            if not finish(pending):
                return
            pending = None
        if call is _NOTHING:
            call = prepared.get()
        if call is None:
            if pending is not None:
                finish(pending)
            return
        seq, waves, outs, options, speech, maps = call
        del call
        c0 = time.process_time()  # the whole process: the model's intra-op threads too
        t0 = time.time()
        try:
            # queued on the device behind the call before it (Parakeet on the GPU engine), whose
            # decoder and transcripts then run while this one's encoders do; other models run now
            started = start_pieces(model, [w for _i, w in waves], options,
                                   None if speech is None else [speech[i] for i, _w in waves],
                                   checked=True) if waves else None
        except BaseException as e:  # noqa: BLE001 - the call itself failed: the parent decides
            conn.send(("gone", f"{type(e).__name__}: {e}"))
            return
        if pending is not None and not finish(pending):
            return
        pending = (seq, started, waves, outs, maps, c0, t0)


_NOTHING = object()  # no call taken from the queue yet


def _prepare_calls(conn, prepared: "queue.Queue") -> None:
    """The model process's second thread: receive each call, map its pieces' samples and check
    them (:func:`~flashasr.models.base.as_waveform`), while the main thread runs the call before
    it; then hand it over. A piece whose samples are gone, or not finite, fails alone. None is
    handed over when the parent says stop or the pipe closes."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = None
        if msg is None or msg[0] != "run":
            prepared.put(None)
            return
        _kind, seq, refs, options, speech, places = msg  # places: each piece's index in the caller's call
        maps = _Maps()
        maps.plan(refs)
        waves, outs = [], [None] * len(refs)
        for i, r in enumerate(refs):
            try:
                w = maps.view(*r)
            except (OSError, ValueError) as e:  # this piece's samples are gone (a segment removed
                # under the job) or not where the reference says
                outs[i] = ModelProcessError(f"the piece's samples are not in shared memory ({r[0]}): {e}")
                continue
            try:
                waves.append((i, as_waveform(w, f"waveform {places[i]}")))
            except Exception as e:  # noqa: BLE001 - this piece's own failure (not finite)
                outs[i] = e
        prepared.put((seq, waves, outs, options, speech, maps))


__all__ = ["ModelProcess", "ModelProcessError", "PendingPieces", "IN_FLIGHT"]
