"""Running the server: ``flashasr serve`` (:func:`main`) in the configured process layout.

* ``--mode single`` (:func:`run`): one process; uvicorn serves the app (``make_app``:
  :func:`~.app.create_app`, passed in so that this module does not import the app) with the
  model in a :class:`~.backend.LocalBackend`.
* ``--mode multi``: this process supervises the engine process (:class:`~.engine_proc.EngineSupervisor`,
  model + scheduler, restarted when it dies) and serves front end #0; ``--workers`` - 1 more
  front-end processes (:func:`frontend_main`, replaced when they die) share the listening port
  with ``SO_REUSEPORT``; every front end reaches the engine through a
  :class:`~.backend.RemoteBackend` over the engine's Unix socket (:mod:`.ipc`).

Stopping (SIGINT/SIGTERM, to the supervisor or to the whole process group as Ctrl-C does): every
front end stops taking connections and answers what it holds within :data:`GRACE_S`
(:mod:`.shutdown`: streams deliver their committed finals and close 1001; requests still waiting
for the model a second before the grace ends, and HTTP requests with no response half a second
before, get 503 'shutting down'); in multi mode the supervisor passes the signal on to the worker
front ends, waits for them to exit and only then stops the engine
(:meth:`~.engine_proc.EngineSupervisor.stop`: the engine ignores SIGINT/SIGTERM), so no front end
loses its engine while it still serves.

Each process runs one event loop (uvloop when installed); the soft fd limit is lifted to the hard
one (thousands of WebSockets). With ``--ssl-certfile`` uvicorn serves https:// and wss:// on the same
socket. One line on stderr says where the server listens; log records
follow at ``--log-level``, and each front end's access log at INFO unless ``--no-access-log``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import sys
import tempfile
from dataclasses import replace

from .config import ACCESS_LOGGER, ServeConfig, parse_args

log = logging.getLogger("flashasr.serve")


def _device_problem(device: str) -> str | None:
    """Why torch cannot use ``device`` here (:func:`~flashasr.pipeline.engines.check_device`), or None."""
    from ..errors import FlashASRError
    from ..pipeline.engines import check_device

    try:
        check_device(device)
    except FlashASRError as e:
        return str(e)
    return None


def _check_serve_device(device: str, in_child: bool = False) -> None:
    """:class:`ListenError`-style stop (exit 2, ``argument --device: ...``) for a device torch cannot use
    here (``cuda`` without CUDA), checked before the server announces itself (a new user saw
    "listening on ..." and then the model's load failing). Single mode checks here (this process loads
    the model anyway); multi mode (``in_child``) asks a short-lived spawned process, so this front end
    never imports torch nor touches CUDA (about a second of start-up, only for a device other than cpu)."""
    if str(device) == "cpu":
        return  # nothing to check (and no torch import here)
    if in_child:
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            problem = pool.submit(_device_problem, device).result(timeout=120)
    else:
        problem = _device_problem(device)
    if problem:
        raise ListenError(f"argument --device: {problem}")


def _check_serve_model(spec: str | None) -> None:
    """:class:`ListenError` (exit 2, ``argument --model: ...``) for a model the loader would refuse
    (:func:`~flashasr.models.registry.missing_model`, the loader's own rule: ``large-v3`` without its
    weights, a mistyped path, a hub id neither cached nor downloadable), before the server announces
    itself; a hub id is fetched here (once, before listening). The load decides everything else."""
    from ..models.registry import missing_model

    why = missing_model(spec)
    if why:
        raise ListenError(f"argument --model: {why}")


class ListenError(Exception):
    """The server cannot start as told (``--host``/``--port`` where it cannot listen, a ``--device``
    torch cannot use): exit 2 with this message."""


def _listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket on ``host:port``; raises :class:`ListenError` naming the option at fault
    (a port in use, a host that does not resolve or is not this machine's, a privileged port)."""
    import errno

    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((host, port))
    except socket.gaierror as e:
        s.close()
        raise ListenError(f"argument --host: cannot resolve {host!r} ({e.strerror})") from None
    except OSError as e:
        s.close()
        msg = {errno.EADDRINUSE: f"argument --port: {host}:{port} is already in use",
               errno.EADDRNOTAVAIL: f"argument --host: {host} is not an address of this machine",
               errno.EACCES: f"argument --port: no permission to listen on port {port} (below 1024 needs root)"}
        raise ListenError(msg.get(e.errno, f"cannot listen on {host}:{port}: {e.strerror}")) from None
    s.listen(4096)
    s.setblocking(False)
    return s


EXIT_MODEL_FAILED = 2  # the model cannot be loaded: the server stops (as `flashasr transcribe` exits 2)
SAME_STOP_S = 1.0  # a second SIGINT/SIGTERM this soon after the first is the same stop; a later SIGINT forces the exit
GRACE_S = 5.0  # a stopping front end's time to finish its requests (uvicorn's timeout_graceful_shutdown)


async def _serve(cfg: ServeConfig, app, sock: socket.socket, on_stop=None) -> int:
    """Serve until stopped; returns the exit status (``app.state.shutdown(code)`` stops it early,
    e.g. when the model cannot be loaded). When it begins to stop (the first SIGINT/SIGTERM, or
    ``shutdown``), once, on the event loop: ``app.state.stopping.begin`` (:mod:`.shutdown`: streams
    deliver their committed finals and close, requests still waiting a second before :data:`GRACE_S`
    get 503 'shutting down'), then ``on_stop()``; uvicorn's shutdown of the connections waits for the
    streams to close (:meth:`~.shutdown.Stopping.sessions_closed`)."""
    import uvicorn

    ucfg = uvicorn.Config(app, loop="none", lifespan="on", log_level=cfg.log_level, access_log=False,
                          ws_max_size=16 << 20, timeout_keep_alive=30, backlog=4096,
                          timeout_graceful_shutdown=GRACE_S, ssl_certfile=cfg.ssl_certfile,
                          ssl_keyfile=cfg.ssl_keyfile)
    _install_log_filters()  # uvicorn.Config set up uvicorn's log handlers just now
    server = _quiet_stop_server(uvicorn)(ucfg)
    status = {"code": 0, "stopping": False}
    loop = asyncio.get_running_loop()
    stopping = app.state.stopping

    def begin_stop() -> None:
        if status["stopping"]:
            return
        status["stopping"] = True
        stopping.begin(GRACE_S, app.state.flashasr.get("backend"))
        if on_stop is not None:
            on_stop()

    def shutdown(code: int) -> None:
        status["code"] = code
        server.should_exit = True
        begin_stop()

    server.on_exit_signal = lambda: loop.call_soon_threadsafe(begin_stop)  # from the signal handler
    server.before_shutdown = stopping.sessions_closed
    app.state.shutdown = shutdown
    await server.serve(sockets=[sock])
    return status["code"]


def _quiet_stop_server(uvicorn):
    """``uvicorn.Server`` whose SIGINT/SIGTERM stop the server gracefully and end there. uvicorn
    (0.29+) raises the captured signal again once ``serve()`` has returned; under ``asyncio.run`` /
    ``uvloop.run`` that SIGINT cancels the main task while Starlette's lifespan still waits, and every
    Ctrl-C printed an ERROR traceback (KeyboardInterrupt, then CancelledError) and exited 1. Each
    signal also calls ``on_exit_signal()`` when set (in the signal handler: it must only schedule).
    A signal within :data:`SAME_STOP_S` of the first is ignored: ``timeout -s INT`` and a signal to
    the process group with one to the process deliver the same stop twice, and uvicorn took the
    second SIGINT as a force-quit (tracebacks, WebSockets closed 1012 with their finals unsent).

    ``before_shutdown`` (a coroutine function, when set) runs when uvicorn begins its shutdown, after
    the listening sockets close and before uvicorn shuts the connections down (its ``1012`` to every
    WebSocket at once); uvicorn's graceful timeout then gets what is left of it."""
    import contextlib
    import signal
    import threading
    import time

    from uvicorn.server import HANDLED_SIGNALS

    class Server(uvicorn.Server):
        on_exit_signal = None
        before_shutdown = None

        _first_signal = None

        def handle_exit(self, sig, frame) -> None:
            now = time.monotonic()
            if self._first_signal is not None and now - self._first_signal < SAME_STOP_S:
                return  # the same stop delivered twice (to the process and to its group): not a force-quit
            if self._first_signal is None:
                self._first_signal = now
            super().handle_exit(sig, frame)
            if self.on_exit_signal is not None:
                self.on_exit_signal()

        async def shutdown(self, sockets=None) -> None:
            t0 = time.monotonic()
            if self.before_shutdown is not None:
                for server in self.servers:
                    server.close()  # no new connections meanwhile (uvicorn closes them again: harmless)
                await self._before_shutdown()
            grace = self.config.timeout_graceful_shutdown
            if grace is not None:
                self.config.timeout_graceful_shutdown = max(0.5, grace - (time.monotonic() - t0))
            await super().shutdown(sockets)

        async def _before_shutdown(self) -> None:
            """``before_shutdown()``, given up on a second Ctrl-C (uvicorn's ``force_exit``)."""
            task = asyncio.ensure_future(self.before_shutdown())
            while not task.done() and not self.force_exit:
                await asyncio.wait([task], timeout=0.1)
            task.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            before = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    return Server


def _run_loop(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


def _remote_factory(path: str, supervisor=None, engine: dict | None = None):
    def make(cfg, pool, metrics):
        from .backend import RemoteBackend

        return RemoteBackend(cfg, path, metrics=metrics, supervisor=supervisor, engine=engine)

    return make


def frontend_main(cfg_dict: dict, path: str, make_app, engine: dict | None = None) -> None:
    """Entry point of an extra front-end worker process (multi mode, ``--workers`` > 1); ``engine``:
    the supervisor's view of the engine when it started this one (:class:`~.backend.RemoteBackend`)."""
    from .engine_proc import die_with_parent

    die_with_parent()
    cfg = ServeConfig.from_dict(cfg_dict)
    _configure_logging(cfg)
    _raise_fd_limit()
    sock = _listen_socket(cfg.host, cfg.port, reuse_port=True)
    _run_loop(_serve(cfg, make_app(cfg, _remote_factory(path, engine=engine)), sock))


def _configure_logging(cfg: ServeConfig) -> None:
    """Log records at ``--log-level`` to stderr; the access log (:data:`~.config.ACCESS_LOGGER`, on
    unless ``--no-access-log``) at INFO whatever the level of the rest."""
    logging.basicConfig(level=cfg.log_level.upper())
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if cfg.access_log else logging.CRITICAL + 1)
    _install_log_filters()


def _install_log_filters() -> None:
    """:class:`RedactApiKeys` on every handler of the root and uvicorn loggers (uvicorn installs its
    own handlers when its Config is made: call this again after) and :class:`ClientFaultLog` on
    uvicorn's error logger."""
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for h in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactApiKeys) for f in h.filters):
                h.addFilter(RedactApiKeys())
    errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ClientFaultLog) for f in errors.filters):
        errors.addFilter(ClientFaultLog())


class ClientFaultLog(logging.Filter):
    """A client's protocol fault that uvicorn answers itself is one INFO line, not an ERROR with a
    traceback: a text WebSocket frame that is not UTF-8 (uvicorn closes the connection with 1007 and
    logs the decode error's traceback, so a client could flood the log with them). Other records
    pass unchanged."""

    FAULTS = {"Invalid UTF-8 sequence received from client.":
              "WebSocket closed (1007): the client sent a text frame that is not UTF-8"}

    def filter(self, record: logging.LogRecord) -> bool:
        line = self.FAULTS.get(record.msg) if isinstance(record.msg, str) else None
        if line is not None:
            record.msg, record.args, record.exc_info, record.exc_text = line, None, None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


class RedactApiKeys(logging.Filter):
    """Replaces the value of an ``api_key=`` query parameter in log lines with ``***`` (uvicorn logs a
    WebSocket's path with its query string, where browsers must put the key)."""

    _RE = re.compile(r"(api_key=)[^&\s\"']+")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "api_key=" in msg:
            record.msg, record.args = self._RE.sub(r"\1***", msg), None
        return True


def _raise_fd_limit() -> None:
    """Thousands of WebSockets need thousands of fds: lift the soft limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover
        pass


def _announce(cfg: ServeConfig, sock) -> None:
    """One start-up line on stderr: where the server listens (the port may have been 0)."""
    import sys

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if cfg.ssl_certfile else "http"
    print(f"flashasr serve: listening on {scheme}://{shown}:{port} (model {cfg.model or 'tiny.en'}, "
          f"{cfg.mode} mode); /ready answers 200 once the model is loaded and warmed; Ctrl-C stops",
          file=sys.stderr, flush=True)


def run(cfg: ServeConfig, make_app, run_ray=None) -> int:
    """Serve ``make_app(cfg, backend_factory=None)`` (:func:`~.app.create_app`) until SIGINT/SIGTERM
    in the configured process layout (mode ``ray``: ``run_ray(cfg, make_app)``); returns the exit
    status (0, or :data:`EXIT_MODEL_FAILED`)."""
    _configure_logging(cfg)
    _raise_fd_limit()
    if cfg.mode == "ray":  # ingress + model replicas on Ray Serve (run_ray: flashasr.serve.ray_serve.run_ray)
        if run_ray is None:
            raise ValueError("mode 'ray' needs run_ray (flashasr.serve.app.main passes it)")
        return run_ray(cfg, make_app)  # deploys (loads the model on its replicas' nodes) before announcing
    _check_serve_model(cfg.model)  # before "listening on ...": a model the loader would refuse stops the start
    if cfg.mode == "single":
        _check_serve_device(cfg.device)  # before "listening on ...": a device that cannot work stops the start
        sock = _listen_socket(cfg.host, cfg.port, reuse_port=False)
        _announce(cfg, sock)
        app = make_app(cfg)
        return _exit_when_idle(app, int(_run_loop(_serve(cfg, app, sock)) or 0))
    return _run_multi(cfg, make_app)


EXIT_WAIT_S = 1.0  # single mode: how long a stopped server's exit waits for a model call still running


def _exit_when_idle(app, code: int, wait_s: float = EXIT_WAIT_S) -> int:
    """Single mode, once the server has stopped: returns ``code`` when no model call runs (after
    at most ``wait_s``). Otherwise the process leaves at once with it (``os._exit``, logs
    flushed): the interpreter's exit would join the model thread until the call ends (seconds for a
    long final on a CPU; the call's clients have had their 503 or ``failed`` event, unless a forced
    exit cut them off), and a Ctrl-C in that join aborted the process. From here on a SIGINT or
    SIGTERM leaves at once too. Multi mode's engine is its own process."""
    import signal

    def leave(*_) -> None:
        _flush_output()
        os._exit(code)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)
    backend = (getattr(getattr(app, "state", None), "flashasr", None) or {}).get("backend")
    idle = getattr(backend, "wait_idle", None)
    if idle is None or idle(wait_s):
        return code
    log.warning("exiting with a model call still running (its results are dropped)")
    leave()
    return code  # not reached (os._exit does not return)


def _flush_output() -> None:
    for h in [*logging.getLogger().handlers, *log.handlers]:
        h.flush()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass


class _Workers:
    """The extra front-end worker processes of multi mode; one that dies is replaced (until
    :meth:`begin_stop`). ``engine_state()``: the supervisor's view of the engine, handed to each
    worker it starts (``{"up": bool, "restarts": int}``)."""

    def __init__(self, cfg: ServeConfig, path: str, make_app):
        import multiprocessing as mp

        self.cfg, self.path, self.make_app = cfg, path, make_app
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.stopping = False
        self.engine_state = dict

    def start(self, loop) -> None:
        if self.stopping:  # a replacement scheduled just before the server began to stop
            return
        p = self.ctx.Process(target=frontend_main, args=(self.cfg.to_dict(), self.path, self.make_app, self.engine_state()),
                             name="flashasr-frontend", daemon=True)
        p.start()
        self.procs.append(p)
        loop.add_reader(p.sentinel, self._on_exit, loop, p)

    def _on_exit(self, loop, p) -> None:  # a front-end worker died: replace it (its clients' connections are gone)
        from ..shm import unlink_segments_of
        from .engine_proc import exit_reason

        loop.remove_reader(p.sentinel)
        p.join(0.5)  # the sentinel closes before the exit is reaped: wait a moment for its code
        self.procs.remove(p)
        unlink_segments_of(p.pid)  # its pooled shared memory (its parent, this process, lives on)
        if not self.stopping:
            log.warning("front-end worker %s exited (%s); starting another", p.pid, exit_reason(p.exitcode))
            loop.call_later(0.5, self.start, loop)

    def begin_stop(self, loop) -> None:
        """SIGTERM to every worker (each stops as front end #0 does); none is replaced from now on."""
        if self.stopping:
            return
        self.stopping = True
        for p in self.procs:
            loop.remove_reader(p.sentinel)
            if p.is_alive():
                p.terminate()

    def stop(self, loop, timeout: float) -> None:
        """Stop every worker and wait for them, up to ``timeout`` s; SIGKILL for any still running."""
        import time

        from ..shm import unlink_segments_of

        self.begin_stop(loop)
        t_end = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, t_end - time.monotonic()))  # not the sentinel alone: it closes before the exit is reaped
            if p.is_alive():
                log.warning("front-end worker %s did not stop within %.0f s; killing it", p.pid, timeout)
                p.kill()
            p.join(1)
            if not p.is_alive():
                unlink_segments_of(p.pid)  # what a worker stopped hard left behind
        self.procs.clear()


def _run_multi(cfg: ServeConfig, make_app) -> int:
    """The engine process (supervised), front end #0 here and ``cfg.workers - 1`` worker processes."""
    from .engine_proc import EngineSupervisor
    from ..shm import cleanup_stale_segments

    cleanup_stale_segments()  # shared memory left by crashed front ends of earlier runs
    sock = _listen_socket(cfg.host, cfg.port, reuse_port=cfg.workers > 1)  # first: a bad --port leaves nothing
    _check_serve_device(cfg.device, in_child=True)  # before "listening on ..." as in single mode
    tmpdir = None
    path = cfg.engine_socket
    if path is None:
        tmpdir = tempfile.mkdtemp(prefix="flashasr-")
        path = os.path.join(tmpdir, "engine.sock")
    _announce(cfg, sock)
    workers = _Workers(replace(cfg, port=sock.getsockname()[1]), path, make_app)  # --port 0: the port bound here

    async def main_async() -> int:
        sup = EngineSupervisor(cfg, path)
        loop = asyncio.get_running_loop()
        app = make_app(cfg, _remote_factory(path, sup))
        sup.metrics = app.state.metrics
        sup.on_fatal = lambda: app.state.shutdown(EXIT_MODEL_FAILED)  # set by _serve before any engine exit
        # a worker started now learns what front end #0 knows: whether the engine serves, its restarts
        workers.engine_state = lambda: {"up": bool(getattr(app.state.flashasr.get("backend"), "ready", False)),
                                        "restarts": sup.restarts}

        def on_stop() -> None:  # front end #0 begins to stop: the workers too, and no engine restarts
            workers.begin_stop(loop)
            sup.begin_shutdown()

        try:
            sup.start()
            for _ in range(cfg.workers - 1):
                workers.start(loop)
            return await _serve(cfg, app, sock, on_stop)
        finally:  # front end #0 has finished; the workers next (they stopped meanwhile), then the engine
            workers.stop(loop, GRACE_S + 5.0)
            sup.stop()

    try:
        return int(_run_loop(main_async()) or 0)
    finally:
        if tmpdir:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            os.rmdir(tmpdir)


def main(argv: list[str] | None, make_app, run_ray=None) -> int:
    """``flashasr serve`` with these arguments (None: ``sys.argv[1:]``), serving ``make_app``
    (``run_ray``: the runner of ``--ray``). Returns the exit status."""
    import sys

    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run(cfg, make_app, run_ray)
    except ListenError as e:
        print(f"flashasr serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        return 130
