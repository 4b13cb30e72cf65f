"""Multi-process mode: one engine process + 2 front-end workers over Unix sockets (real tiny.en).

Covers the shared-memory path, a garbage client on the engine socket, and engine death:
in-flight requests get 503 (none hangs), the engine restarts, service resumes; a replaced worker
and /ready on every front end; shutdown however the signal comes (front ends first, then the
engine); and the engine client, whose close wakes every request waiting on the engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from websockets.asyncio.client import connect

from conftest import AUDIO
from test_serve_util import CLIP, CLIP_WORDS, Server, pcm16, words

KEY = "k"


def _shm() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("flashasr_")} if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi")
    s = Server(tmp, "--mode", "multi", "--workers", "2", "--api-key", KEY, "--shm-threshold-kb", "64", "--no-warmup",
               "--engine-socket", str(tmp / "engine.sock"))
    s.engine_socket = tmp / "engine.sock"
    yield s
    s.stop()


def _client(s):
    return openai.OpenAI(base_url=s.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_multi_workers_and_shared_memory(multi):
    before = _shm()
    pids, engine = set(), set()
    t_end = time.monotonic() + 90
    while len(pids) < 2 and time.monotonic() < t_end:  # the second worker may still be starting
        r = httpx.get(multi.base + "/ready")  # a new connection each time: SO_REUSEPORT spreads them
        if r.status_code == 200:
            pids.add(r.json()["frontend_pid"])
            engine.add(r.json()["pid"])
        else:
            time.sleep(0.1)
    assert len(pids) == 2 and multi.proc.pid in pids  # two front-end processes share the port
    startup = r.json()["startup_s"]  # where the engine's start-up went: load + warm-up, the streamer's
    assert startup["model_s"] > 0 and startup["streamer_s"] >= 0
    assert len(engine) == 1 and not engine & pids  # ... and one separate engine process
    # 2.97 s = 190 KB of float32 > --shm-threshold-kb 64: the audio crosses through shared memory
    client = _client(multi)  # one keep-alive connection: both requests reach the same front end
    for _ in range(2):  # the second request reuses the pooled segment
        t = client.audio.transcriptions.create(model="whisper-1", file=CLIP.open("rb"))
        assert words(t.text) == CLIP_WORDS
    mine = {n for n in _shm() - before if int(n.split("_")[1]) in pids | engine}  # not other servers' on this machine
    owners = [int(n.split("_")[1]) for n in mine]
    # one pooled segment per front end that served, reused by its second request (the keep-alive
    # connection normally keeps both requests on one front end, but under load a new connection
    # can reach the other)
    assert mine and set(owners) <= pids and len(owners) == len(set(owners))
    assert multi.metric("flashasr_engine_requests_active") == 0


def test_multi_stream_through_engine(multi):
    async def go():
        async with connect(f"ws://127.0.0.1:{multi.port}/v1/stream?sample_rate=16000&partial_interval_ms=0",
                           additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await ws.recv()
            pcm = pcm16()
            for off in range(0, len(pcm), 640):
                await ws.send(pcm[off:off + 640])
            await ws.send(json.dumps({"type": "commit"}))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if ev["type"].endswith("completed"):
                    return ev["transcript"]

    assert words(asyncio.run(go())) == CLIP_WORDS


def test_multi_status_and_page(multi):
    """/status in multi mode: the model from the engine's HELLO, the engine's figures over its socket."""
    httpx.post(multi.base + "/v1/audio/transcriptions", files={"file": ("clip.wav", CLIP.read_bytes())},
               headers={"Authorization": f"Bearer {KEY}"}, timeout=60).raise_for_status()
    assert httpx.get(multi.base + "/").status_code == 200
    for _ in range(50):  # new connections reach either front end; the one that served the upload counted it
        s = httpx.get(multi.base + "/status").json()
        if "request" in s["latency_ms"]:
            break
    assert s["status"] == "ready" and s["mode"] == "multi" and s["model"]["name"] == "whisper-tiny.en"
    assert s["engine"]["requests_active"] == 0 and s["latency_ms"]["request"]["n"] >= 1
    assert s["limits"]["api_key_required"] is True


def test_garbage_on_engine_socket(multi):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(multi.engine_socket))
    assert s.recv(2) == b"FA"  # the engine greets (HELLO) ...
    s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\xff" * 100)
    with pytest.raises((ConnectionResetError, AssertionError)):  # ... and drops this connection (bad magic)
        while True:
            assert s.recv(65536)
    s.close()
    t = _client(multi).audio.transcriptions.create(model="whisper-1", file=CLIP.open("rb"), response_format="text")
    assert words(t) == CLIP_WORDS


def test_client_gone_cancels_engine_work(multi):
    """A client that disconnects while the engine works on its file: the front end sends CANCEL."""
    data = (AUDIO / "long" / "long-silero-test-60s.wav").read_bytes()
    part = b"--b0\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.wav\"\r\n\r\n"
    body = part + data + b"\r\n--b0--\r\n"
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary=b0\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", multi.port), timeout=10)
    s.sendall(head + body)
    t_end = time.monotonic() + 60
    while multi.metric("flashasr_engine_requests_active") < 1:
        assert time.monotonic() < t_end
        time.sleep(0.05)
    s.close()
    t_end = time.monotonic() + 5
    while multi.metric("flashasr_engine_requests_active") > 0:  # cancelled, not left running to the end
        assert time.monotonic() < t_end
        time.sleep(0.05)


def test_engine_death_gives_503_and_restarts(multi):
    info = httpx.get(multi.base + "/ready").json()
    old_pid = info["pid"]
    long_clip = (AUDIO / "long" / "long-silero-test-60s.wav").read_bytes()
    result = {}

    def work():
        try:
            _client(multi).audio.transcriptions.create(model="whisper-1", file=("long.wav", long_clip))
            result["status"] = 200
        except openai.APIStatusError as e:
            result["status"], result["code"] = e.status_code, e.body.get("code")
        result["t"] = time.monotonic()

    th = threading.Thread(target=work)
    th.start()
    t_end = time.monotonic() + 60
    while multi.metric("flashasr_engine_requests_active") < 1:  # the long request reached the engine
        assert time.monotonic() < t_end and th.is_alive()
        time.sleep(0.05)
    os.kill(old_pid, signal.SIGKILL)
    t_kill = time.monotonic()
    th.join(30)
    assert not th.is_alive(), "in-flight request hung after the engine died"
    assert result["status"] == 503 and result["code"] == "engine_unavailable"
    assert result["t"] - t_kill < 5
    # the engine comes back (new process) and service resumes
    t_end = time.monotonic() + 120
    while True:
        r = httpx.get(multi.base + "/ready")
        if r.status_code == 200 and r.json()["pid"] != old_pid:
            break
        assert time.monotonic() < t_end, r.text
        time.sleep(0.2)
    t = _client(multi).audio.transcriptions.create(model="whisper-1", file=CLIP.open("rb"))
    assert words(t.text) == CLIP_WORDS
    # front end #0 counts at once, a worker from the new engine's HELLO (0 until it has reconnected)
    assert multi.metric("flashasr_engine_restarts") in (0.0, 1.0)


def test_dead_frontend_worker_is_replaced(multi):
    workers = {httpx.get(multi.base + "/ready").json()["frontend_pid"] for _ in range(40)} - {multi.proc.pid}
    assert len(workers) == 1
    old = workers.pop()
    os.kill(old, signal.SIGKILL)
    t_end = time.monotonic() + 90
    seen = set()
    while not seen - {multi.proc.pid, old}:  # a new worker process answers on the same port
        assert time.monotonic() < t_end, seen
        try:
            r = httpx.get(multi.base + "/ready", timeout=5)
            if r.status_code == 200:
                seen.add(r.json()["frontend_pid"])
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def test_multi_translation_task_reaches_the_engine(multi):
    """tiny.en in the engine process cannot translate: the front end learns it from the engine's
    HELLO and answers 400 unsupported_task (the socket protocol itself: test_serve_ipc.py)."""
    with pytest.raises(openai.APIStatusError) as ei:
        _client(multi).audio.translations.create(model="whisper-1", file=CLIP.open("rb"))
    assert ei.value.status_code == 400 and ei.value.body["code"] == "unsupported_task", ei.value.body


def _ready_by_front_end(s, n: int = 2, timeout: float = 60) -> dict[int, dict]:
    """``/ready`` bodies (200) of ``n`` different front ends, by pid (new connections reach either)."""
    got: dict[int, dict] = {}
    t_end = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < t_end, got
        r = httpx.get(s.base + "/ready", timeout=5)
        if r.status_code == 200:
            got[r.json()["frontend_pid"]] = r.json()
    return got


def test_a_replaced_worker_knows_the_engine_is_up(multi):
    """A front-end worker that dies is replaced; its successor is told the engine is up, so it takes
    requests only once it has its engine connection: no /ready in between says 503 (it said
    'loading' for a moment, as if the model were loading) -- every answer while it starts is 200,
    from front end #0 or from it."""
    old = next(p for p in _ready_by_front_end(multi) if p != multi.proc.pid)
    os.kill(old, signal.SIGKILL)
    seen, not_ready, done = set(), [], threading.Event()

    def poll():  # new connections as fast as they go, so some wait in the new worker's backlog
        while not done.is_set():
            try:
                r = httpx.get(multi.base + "/ready", timeout=5)
            except httpx.HTTPError:  # the killed worker's queued connections are reset
                continue
            if r.status_code != 200:
                not_ready.append(r.json())
            else:
                seen.add(r.json()["frontend_pid"])
                if seen - {multi.proc.pid, old}:
                    done.set()

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for th in threads:
        th.start()
    done.wait(90)
    done.set()
    for th in threads:
        th.join(10)
    assert seen - {multi.proc.pid, old}, "no new worker answered"
    assert not_ready == [], not_ready


def test_ready_says_the_same_on_every_front_end(multi):
    """``/ready`` has the same keys whichever front end answers (``engine_restarts`` was front end #0's
    alone), and the same engine restarts (1: test_engine_death_gives_503_and_restarts): the engine's
    HELLO carries the count to every front end."""
    bodies = _ready_by_front_end(multi)
    keys = {p: sorted(b) for p, b in bodies.items()}
    assert len(set(map(tuple, keys.values()))) == 1, keys
    assert {b["engine_restarts"] for b in bodies.values()} == {1}, bodies


def test_ready_while_the_engine_is_away_says_why_with_the_same_keys(tmp_path):
    """``/ready`` before the engine connection (503): the same keys on front end #0 (the supervisor's)
    and on a worker, with the reason a request would get and the engine restarts known."""
    from starlette.testclient import TestClient

    from flashasr.serve.app import create_app
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.process import _remote_factory

    class Supervisor:
        restarts = 2

    path = str(tmp_path / "nobody.sock")
    bodies = []
    for sup in (Supervisor(), None):
        with TestClient(create_app(ServeConfig(), _remote_factory(path, sup))) as client:
            r = client.get("/ready")
            assert r.status_code == 503
            bodies.append(r.json())
    assert sorted(bodies[0]) == sorted(bodies[1]), bodies
    assert bodies[0]["engine_restarts"] == 2 and bodies[1]["engine_restarts"] == 0, bodies
    assert all("starting" in b["reason"] and b["status"] == "loading" for b in bodies), bodies


# ------------------------------------------------------------------------------------- shutdown
def _group(pgid: int) -> set[int]:
    """The live processes of process group ``pgid`` (zombies left out: they have exited)."""
    out = set()
    for d in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{d}/stat").read()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.add(int(d))
    return out


@pytest.mark.parametrize("how", ["SIGTERM to the supervisor", "SIGINT to the group (Ctrl-C)", "SIGTERM to the group"])
def test_shutdown_stops_front_ends_then_engine(tmp_path, how):
    """Shutdown in multi mode, however the signal comes (one to the supervisor; Ctrl-C or `kill -TERM
    -PGID` reaching every process of the group): the front ends stop first -- an upload the engine is
    transcribing then either finishes or gets 503 'shutting down', never 'restarting' -- and the engine
    only after them (it ignores SIGINT/SIGTERM; the supervisor stops it). The supervisor exits 0 within
    15 s, every process of the group is gone with it, and the log has no traceback, error or lost
    engine connection."""
    from conftest import sigint_default

    s = Server(tmp_path, "--mode", "multi", "--workers", "2", "--no-warmup", start_new_session=True,
               preexec_fn=sigint_default)
    try:
        pgid = s.proc.pid
        assert len(_group(pgid)) >= 3  # supervisor + front end #1 + engine
        long_clip = (AUDIO / "long" / "long-silero-test-60s.wav").read_bytes()
        results = []

        def upload():
            try:
                r = httpx.post(s.base + "/v1/audio/transcriptions", files={"file": ("long.wav", long_clip)}, timeout=60)
                results.append((r.status_code, r.json() if r.headers.get("content-type") == "application/json"
                                else r.text))
            except Exception as e:  # noqa: BLE001 - no answer at all (the connection dropped), or not JSON
                results.append((None, repr(e)))

        threads = [threading.Thread(target=upload) for _ in range(3)]  # new connections: both front ends
        for th in threads:
            th.start()
        t_end = time.monotonic() + 60
        # all three uploads at the engine, past their decode: a signal while front end #0's decode pool
        # starts its forkserver (its first long file, about a second) still prints the forkserver's
        # KeyboardInterrupt traceback (the upload then decodes sequentially)
        while s.metric("flashasr_engine_requests_active") < 3:
            assert time.monotonic() < t_end, s.log()
            time.sleep(0.05)
        if how == "SIGTERM to the supervisor":
            os.kill(pgid, signal.SIGTERM)
        else:
            os.killpg(pgid, signal.SIGINT if "SIGINT" in how else signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = s.proc.wait(15)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 15 s after {how}:\n{s.log()}") from None
        for th in threads:
            th.join(15)
        while _group(pgid) and time.monotonic() - t0 < 20:  # the multiprocessing resource tracker follows
            time.sleep(0.05)
        assert not _group(pgid), f"left running: {_group(pgid)}"
        log = s.log_path.read_text(errors="replace")
        assert rc == 0, log
        assert not any(th.is_alive() for th in threads), "an upload got no answer"
        assert len(results) == 3 and all(st == 200 or (st == 503 and "shutting down" in body["error"]["message"])
                                         for st, body in results), (results, log)
        for noise in ("Traceback", "ERROR", "engine connection lost", "restarting", "exited (", "did not stop"):
            assert noise not in log, log
    finally:
        s.stop()
        for pid in _group(s.proc.pid):  # a failed run must not leave processes behind
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------- the engine client: nobody waits forever
async def _fake_engine(path: str, *, reads: bool = True, drop_after_s: float | None = None) -> None:
    """An engine that greets one front end (HELLO) and never replies: it reads and drops what it gets
    (``reads=False``: reads nothing, so a large frame fills the socket and its sender blocks), and
    closes the connection after ``drop_after_s`` (None: never), as an engine that dies."""
    from flashasr.serve.ipc import MsgType, encode

    loop = asyncio.get_running_loop()
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(path)
    lsock.listen()
    lsock.setblocking(False)
    c, _ = await loop.sock_accept(lsock)
    c.setblocking(False)
    await loop.sock_sendall(c, b"".join(bytes(b) for b in encode(MsgType.HELLO, 0, {"model": "fake", "pid": 1})))
    try:
        t_end = None if drop_after_s is None else loop.time() + drop_after_s
        while t_end is None or loop.time() < t_end:
            if not reads:
                await asyncio.sleep(0.05)
                continue
            try:
                if not await asyncio.wait_for(loop.sock_recv(c, 1 << 16), 0.05):
                    break
            except asyncio.TimeoutError:
                pass
    finally:
        c.close()
        lsock.close()


def _run_loop(kind: str, coro):
    if kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("case", ["awaiting_reply", "awaiting_connection", "blocked_in_send", "engine_drops"])
def test_engine_client_close_wakes_every_waiter(tmp_path, case, loop_kind):
    """A request waiting on the engine -- for its reply, for a connection (the engine not up yet:
    connect_wait_s is 30 s here), or inside the send of a frame the engine does not read -- fails
    within a second with 503 'shutting down' once the client closes; one waiting for its reply when
    the engine's connection drops fails as promptly with 503 'restarting'. Nothing hangs."""
    from flashasr.options import TranscribeOptions
    from flashasr.serve.errors import EngineUnavailable
    from flashasr.serve.ipc import EngineClient

    path = str(tmp_path / "engine.sock")
    engine = {"awaiting_reply": {}, "awaiting_connection": None, "blocked_in_send": {"reads": False},
              "engine_drops": {"drop_after_s": 0.5}}[case]  # the fake engine's keywords (None: no engine)
    n = 8 << 20 if case == "blocked_in_send" else 1600  # 32 MB inline (no shared memory): far above a socket's buffer

    async def go():
        srv = asyncio.ensure_future(_fake_engine(path, **engine)) if engine is not None else None
        await asyncio.sleep(0.05)
        client = EngineClient(path, connect_wait_s=30.0, shm_threshold=1 << 30)
        await client.start()
        if srv is not None:
            assert await client.wait_ready(5)
        req = asyncio.ensure_future(client.transcribe(np.zeros(n, np.float32), TranscribeOptions()))
        await asyncio.sleep(0.3)
        assert not req.done()
        t0 = time.monotonic()
        if case != "engine_drops":
            await client.close()
        with pytest.raises(EngineUnavailable) as e:
            await asyncio.wait_for(req, 5)  # a hang shows as TimeoutError instead
        waited = time.monotonic() - t0
        await client.close()
        if srv is not None:
            srv.cancel()
            await asyncio.gather(srv, return_exceptions=True)
        return waited, e.value

    waited, err = _run_loop(loop_kind, go())
    assert err.status == 503 and err.code == "engine_unavailable"
    assert ("restarting" if case == "engine_drops" else "shutting down") in err.message, err.message
    assert waited < (1.5 if case == "engine_drops" else 1.0), waited
