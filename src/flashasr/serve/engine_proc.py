"""The engine process (multi mode): owns the model and the batching scheduler.

Front-end workers connect over a persistent Unix-domain socket (framing in :mod:`.ipc`).
The engine only starts listening after the model is loaded and warmed up, so a
successful connection (and its ``HELLO``) means "ready". :class:`EngineSupervisor`
(in the front-end's main process) restarts the engine when it dies; the front ends'
:class:`~.ipc.EngineClient` fail in-flight requests with 503 and reconnect.

Shutdown: the engine process ignores SIGINT and SIGTERM (Ctrl-C and ``kill -TERM -PGID`` reach
every process of the group) and stops on SIGUSR1, which :meth:`EngineSupervisor.stop` sends once
the front ends have exited, so it serves their last requests; SIGUSR1 is also what it gets when the
supervisor dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import multiprocessing as mp
import os
import signal
import socket
import time


from ..errors import FlashASRError
from ..options import TranscribeOptions
from ..pipeline.plan import Piece
from .backend import load_and_warm, make_streamer, model_info, startup_info
from .config import ServeConfig
from .ipc import Conn, Frame, FramingError, MsgType, encode, transcript_to_wire, unpack_audio
from .metrics import EngineMetrics
from .scheduler import OFFLINE, BatchScheduler

log = logging.getLogger("flashasr.serve")


class EngineServer:
    """Serves TRANSCRIBE/CANCEL/STATS/PING frames for any number of front-end connections;
    ``restarts``: how many times the supervisor restarted the engine before this one (its HELLO
    says so, so every front end reports the same)."""

    def __init__(self, model, cfg: ServeConfig, restarts: int = 0, load_s: float | None = None):
        self.model = model
        self.cfg = cfg
        self.metrics = EngineMetrics(cfg.device)
        t0 = time.perf_counter()
        streamer = make_streamer(model, cfg)
        self.scheduler = BatchScheduler(model, metrics=self.metrics, streamer=streamer, **cfg.scheduler_options)
        self.hello = {**model_info(model, cfg, streamer), "engine_restarts": int(restarts),
                      "startup_s": startup_info(model, load_s, time.perf_counter() - t0)}
        self.caps = model.capabilities
        self._options_seen: dict[tuple, TranscribeOptions] = {}  # raw options -> resolved (see _options)
        self._active = 0  # requests received and not answered yet: read when the metrics are
        self.metrics.active.set_function(lambda: self._active)

    def _options(self, raw) -> TranscribeOptions:
        """A request's options checked against the model; the same raw options (every chunk of a
        stream carries them) are parsed and checked once. Raises what
        :meth:`TranscribeOptions.from_dict` / ``resolve`` raise."""
        try:  # the value's type is in the key: 1, 1.0 and True are different options
            key = tuple((k, type(v), v) for k, v in raw.items()) if isinstance(raw, dict) else (raw,)
            got = self._options_seen.get(key)
        except TypeError:  # unhashable values (lists): not cached
            return TranscribeOptions.from_dict(raw).resolve(self.caps)
        if got is None:
            got = TranscribeOptions.from_dict(raw).resolve(self.caps)
            if len(self._options_seen) >= 256:
                self._options_seen.clear()
            self._options_seen[key] = got
        return got

    async def handle(self, conn: Conn) -> None:
        """One front end's connection: HELLO, then every frame handled as it arrives
        (:meth:`_frame`, called from the connection's reader), until the connection ends."""
        tasks: dict[int, asyncio.Task] = {}
        chunks: dict = {}  # request id -> the scheduler's item of a stream chunk in flight (_chunk)
        streams: dict = {}  # chunked streams this front end opened -> their options; dropped with the connection
        try:
            await conn.send(encode(MsgType.HELLO, 0, self.hello))
            await conn.read_frames(functools.partial(self._frame, conn, tasks, chunks, streams))
        except asyncio.IncompleteReadError:
            pass
        except (FramingError, ConnectionError, OSError) as e:
            log.warning("dropping front-end connection: %s", e)
        finally:
            for t in list(tasks.values()):
                t.cancel()
            for it in list(chunks.values()):
                self.scheduler.drop(it)
            for key in streams:
                self.scheduler.close_stream(key)
            conn.close()

    def _frame(self, conn: Conn, tasks: dict, chunks: dict, streams: dict, f: Frame) -> None:
        """One frame from a front end, on the event loop as it arrives: a stream chunk is queued
        here (:meth:`_chunk`), any other transcription runs in a task of its own; a reply that finds
        the write queue full holds the reading until it drains (as awaiting ``send`` would). Raises
        FramingError for a message type a front end does not send (the connection is dropped)."""
        if f.type == MsgType.TRANSCRIBE:
            if isinstance(f.meta.get("stream"), str):
                self._chunk(f, conn, chunks, streams)
                return
            t = asyncio.get_running_loop().create_task(self._transcribe(f, conn))
            tasks[f.req_id] = t
            t.add_done_callback(lambda _t, rid=f.req_id: tasks.pop(rid, None))
        elif f.type == MsgType.STREAM_CLOSE:
            key = f.meta.get("stream")
            if isinstance(key, str):
                streams.pop(key, None)
                self.scheduler.close_stream(key)
        elif f.type == MsgType.CANCEL:
            t = tasks.pop(f.req_id, None)
            if t:
                t.cancel()
            it = chunks.pop(f.req_id, None)
            if it is not None:
                self.scheduler.drop(it)
        elif f.type == MsgType.STATS:
            conn.post(encode(MsgType.STATS_REPLY, f.req_id, None, self.metrics.text()))
            conn.hold_reading_until_drained()
        elif f.type == MsgType.PING:
            conn.post(encode(MsgType.PONG, f.req_id))
            conn.hold_reading_until_drained()
        else:
            raise FramingError(f"unexpected message type {f.type} from a front end")

    async def _transcribe(self, f: Frame, conn: Conn) -> None:
        self._active += 1
        try:
            out = encode(MsgType.RESULT, f.req_id, await self._run(f))
        except asyncio.CancelledError:
            self._active -= 1
            return
        except Exception as e:  # noqa: BLE001 - the request's error goes back to it
            out = self._error_frame(f.req_id, e)
        self._active -= 1
        try:
            await conn.send(out)
        except (ConnectionError, OSError):
            pass

    def _chunk(self, f: Frame, conn: Conn, chunks: dict, streams: dict) -> None:
        """A stream chunk's TRANSCRIBE frame, handled as it arrives (:meth:`_frame`): queued for the next
        streamer step with a callback that posts its reply (:meth:`_chunk_done`); no task or
        coroutine per chunk, as at thousands of live streams the event loop's work per chunk is
        what takes the GIL from the model thread's steps. ``chunks``: the connection's chunks in
        flight by request id (a CANCEL or the connection's end drops them); ``streams``: the
        connection's streams and their options (a stream's first chunk carries them, later ones
        may leave them out)."""
        key = f.meta["stream"]
        try:
            samples = unpack_audio(f)
            f.payload = b""
            raw = f.meta.get("options")
            if raw is not None:
                options = streams[key] = self._options(raw)
            elif key in streams:
                options = streams[key]
            else:
                from ..models.parakeet.streaming import StreamError

                raise StreamError(f"stream {key!r} is unknown here and its chunk carries no options (its state "
                                  f"was lost: the engine restarted)")
            it = self.scheduler.queue_chunk(key, samples, options, new=bool(f.meta.get("new")))
        except Exception as e:  # noqa: BLE001 - the request's error goes back to it
            self._post(conn, self._error_frame(f.req_id, e))
            return
        self._active += 1
        chunks[f.req_id] = it
        it.fut.add_done_callback(functools.partial(self._chunk_done, f.req_id, conn, chunks))

    def _chunk_done(self, rid: int, conn: Conn, chunks: dict, fut: asyncio.Future) -> None:
        chunks.pop(rid, None)
        self._active -= 1
        if fut.cancelled():  # its requester went away: no reply
            return
        e = fut.exception()
        self._post(conn, self._error_frame(rid, e) if e is not None else
                   encode(MsgType.RESULT, rid, {"stream_result": vars(fut.result())}))  # flat fields

    @staticmethod
    def _post(conn: Conn, frame: list) -> None:
        try:
            conn.post(frame)
        except (ConnectionError, OSError):
            pass

    @staticmethod
    def _error_frame(rid: int, e: BaseException) -> list:
        """The ERROR frame of a request that raised ``e`` (a FlashASRError's code and status; a
        framing fault is the request's 400; anything else an internal error, logged)."""
        if isinstance(e, FlashASRError):
            return encode(MsgType.ERROR, rid, {"code": e.code, "message": e.message, "param": getattr(e, "param", None),
                                               "status": int(getattr(e, "status", 500))})
        if isinstance(e, FramingError):
            return encode(MsgType.ERROR, rid, {"code": "invalid_request", "message": str(e), "status": 400})
        log.error("engine failure", exc_info=e)
        return encode(MsgType.ERROR, rid, {"code": "internal_error", "status": 500,
                                           "message": f"engine error ({type(e).__name__})"})

    async def _run(self, f: Frame) -> dict:
        """One TRANSCRIBE frame -> the RESULT metadata (see :mod:`.ipc`)."""
        m = f.meta
        samples = unpack_audio(f)
        f.payload = b""
        options = self._options(m.get("options"))
        if m.get("stream") is not None:  # a string key goes to _chunk
            raise FramingError("'stream' must be a string key")
        if m.get("pieces") is not None:
            pieces = _check_pieces(m["pieces"], samples.size, m.get("speech"))
            got = await self.scheduler.submit_pieces(samples, pieces, options, priority=int(m.get("priority", OFFLINE)))
        else:
            t = await self.scheduler.submit(samples, options, priority=int(m.get("priority", OFFLINE)),
                                            coalesce_key=m.get("key"))
            if t is None:
                return {"superseded": True}
            got = [t]
        return {"transcripts": [transcript_to_wire(t) for t in got]}


def _check_pieces(pieces, n: int, speech=None) -> list[Piece]:
    """``[[start, end], ...]`` from the wire: integer ranges within ``[0, n]``, start < end, as
    :class:`~flashasr.pipeline.plan.Piece` s with their speech spans (``speech``: per piece
    ``[[a, b], ...]`` within it, or None)."""
    try:
        out = [(int(a), int(b)) for a, b in pieces]
        spans = [None] * len(out) if speech is None else \
            [None if sp is None else [(int(a), int(b)) for a, b in sp] for sp in speech]
    except (TypeError, ValueError):
        raise FramingError("'pieces' must be a list of [start, end] sample ranges, 'speech' of [a, b] spans") from None
    if any(not 0 <= a < b <= n for a, b in out):
        raise FramingError(f"'pieces' holds a range outside the {n} samples sent")
    if len(spans) != len(out) or any(sp is not None and any(not 0 <= a < b <= e - s for a, b in sp)
                                     for (s, e), sp in zip(out, spans)):
        raise FramingError("'speech' must hold one list of spans inside each piece")
    return [Piece(a, b, sp) for (a, b), sp in zip(out, spans)]


async def serve_unix(path: str, handler) -> None:
    """Accept connections on a Unix socket (mode 0600) forever; ``handler(Conn)`` per connection."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    os.chmod(path, 0o600)
    lsock.listen(128)
    lsock.setblocking(False)
    loop = asyncio.get_running_loop()
    conns: set[asyncio.Task] = set()
    try:
        while True:
            csock, _ = await loop.sock_accept(lsock)
            t = loop.create_task(handler(Conn(csock)))
            conns.add(t)
            t.add_done_callback(conns.discard)
    finally:
        lsock.close()
        for t in list(conns):
            t.cancel()


EXIT_MODEL_FAILED = 3  # the engine's exit status when its model cannot be loaded (the supervisor stops)


async def _engine_async(cfg: ServeConfig, path: str, restarts: int = 0) -> None:
    t0 = time.perf_counter()
    try:
        model = load_and_warm(cfg)
    except Exception as e:  # noqa: BLE001 - a model that will not load: say why once, then exit
        log.error("model %s failed to load on %s: %s: %s", cfg.model or "tiny.en", cfg.device, type(e).__name__, e)
        raise SystemExit(EXIT_MODEL_FAILED) from None
    srv = EngineServer(model, cfg, restarts, load_s=time.perf_counter() - t0)
    srv.scheduler.start()
    if cfg.gc_freeze:
        gc.collect()
        gc.freeze()  # start-up objects (model, tokenizer, modules) leave the GC's scans
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(STOP_SIGNAL, stop.set)  # SIGINT/SIGTERM are ignored (engine_main)
    server = loop.create_task(serve_unix(path, srv.handle))
    await stop.wait()
    server.cancel()
    await srv.scheduler.stop()


STOP_SIGNAL = signal.SIGUSR1  # what stops the engine process (EngineSupervisor.stop sends it)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: get ``sig`` when the parent process dies (no orphaned engines or workers)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the supervisor's normal shutdown still applies
        pass


def engine_main(cfg_dict: dict, path: str, restarts: int = 0) -> None:
    """Entry point of the engine process (``multiprocessing`` spawn target); ``restarts``: the
    supervisor's count of restarts before this engine."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole group is for the front ends:
        signal.signal(sig, signal.SIG_IGN)       # the supervisor stops the engine after them
    die_with_parent(STOP_SIGNAL)
    cfg = ServeConfig.from_dict(cfg_dict)
    logging.basicConfig(level=cfg.log_level.upper())
    from ..malloc import pin_mmap_threshold

    pin_mmap_threshold()  # a spawned process: glibc's settings start afresh
    try:
        import uvloop

        uvloop.run(_engine_async(cfg, path, restarts))
    except ImportError:  # pragma: no cover
        asyncio.run(_engine_async(cfg, path, restarts))


def exit_reason(code: int | None) -> str:
    """A process's exit code in words: ``code 1``, ``killed by SIGKILL``, ``code unknown``."""
    if code is None:
        return "code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


RESTART_STEADY_S = 60.0  # an engine that lived this long died on its own: the restart back-off starts over


class EngineSupervisor:
    """Starts the engine process and restarts it whenever it exits (event-driven, no polling thread).
    A restart waits 0.2 s per exit in a row of engines that died within ``RESTART_STEADY_S`` of
    their start (at most 5 s); ``restarts`` counts every restart of the server's life."""

    def __init__(self, cfg: ServeConfig, path: str, metrics=None):
        self.cfg = cfg
        self.path = path
        self.metrics = metrics
        self.proc: mp.process.BaseProcess | None = None
        self.restarts = 0
        self._streak = 0  # exits in a row, each within RESTART_STEADY_S of its start (the back-off)
        self._started_at = 0.0
        self.on_fatal = None  # called when the engine cannot load its model
        self._ctx = mp.get_context("spawn")
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn()

    def _spawn(self) -> None:
        if self._closing:
            return
        p = self._ctx.Process(target=engine_main, args=(self.cfg.to_dict(), self.path, self.restarts), name="flashasr-engine",
                              daemon=True)
        p.start()
        self.proc = p
        self._started_at = time.monotonic()
        self._loop.add_reader(p.sentinel, self._on_exit, p)

    def begin_shutdown(self) -> None:
        """The server is stopping: an engine that exits from now on is not restarted."""
        self._closing = True

    def _on_exit(self, p) -> None:
        self._loop.remove_reader(p.sentinel)
        # the sentinel closes as the process exits, a moment before it can be reaped: join(0) read
        # exitcode None now and then, so a model that could not load was restarted up to 6 times
        # ("exited (code None); restarting") before the server gave up; wait for the code
        p.join(5)
        if self._closing:
            return
        if p.exitcode == EXIT_MODEL_FAILED:  # restarting cannot help: the server stops (exit 2)
            log.error("the engine process could not load the model (see its log above); stopping")
            self._closing = True
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self.restarts += 1
        if self.metrics is not None:
            self.metrics.engine_restarts.set(self.restarts)
        log.warning("engine process %s exited (%s); restarting (#%d)", p.pid, exit_reason(p.exitcode), self.restarts)
        # found by a new user: the back-off grew with every restart of the server's life
        self._streak = 1 if time.monotonic() - self._started_at >= RESTART_STEADY_S else self._streak + 1
        delay = min(0.2 * self._streak, 5.0)
        self._loop.call_later(delay, self._spawn)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the engine process: :data:`STOP_SIGNAL`, then SIGKILL if it has not exited within
        ``timeout`` s. Call it after the front ends have exited."""
        self._closing = True
        p = self.proc
        if p is None:
            return
        try:
            self._loop.remove_reader(p.sentinel)
        except Exception:  # noqa: BLE001
            pass
        if p.is_alive():
            log.info("stopping the engine process %s", p.pid)
            try:
                os.kill(p.pid, STOP_SIGNAL)
            except ProcessLookupError:
                pass
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(1)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
