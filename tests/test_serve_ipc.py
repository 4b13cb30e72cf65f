"""Unit tests of the engine <-> front-end wire framing, shared-memory hand-off and batch picking."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time

import numpy as np
import pytest

from flashasr.serve import ipc
from flashasr.serve.scheduler import FINAL, OFFLINE, PARTIAL, BatchScheduler
from flashasr.types import Segment, Transcript, Word


async def _roundtrip(frames: list[list]) -> list[ipc.Frame]:
    a, b = socket.socketpair()
    ca, cb = ipc.Conn(a), ipc.Conn(b)
    out = []
    for f in frames:  # one at a time: a large payload does not fit in the socket buffer
        send = asyncio.ensure_future(ca.send(f))
        out.append(await cb.recv_frame())
        await send
    ca.close()
    cb.close()
    return out


def test_frames_inline_and_shared_memory():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(48000).astype(np.float32)
    i16 = (rng.standard_normal(1000) * 3000).astype(np.int16)
    pool = ipc.ShmPool(max_bytes=4 << 20)
    f1, m1, p1, h1 = ipc.pack_audio(x, shm_threshold=1 << 30)         # inline float32
    f2, m2, p2, h2 = ipc.pack_audio(x, shm_threshold=1024)            # one-off shared memory
    f3, m3, p3, h3 = ipc.pack_audio(i16, shm_threshold=1 << 30)       # inline int16
    f4, m4, p4, h4 = ipc.pack_audio(x, shm_threshold=1024, pool=pool)  # pooled shared memory
    assert h1 is None and h3 is None and p2 == b"" and p4 == b""
    assert f2 & ipc.Flag.SHM and not f2 & ipc.Flag.SHM_POOLED and f4 & ipc.Flag.SHM_POOLED
    frames = [ipc.encode(ipc.MsgType.TRANSCRIBE, 7, dict(m1, language="en"), p1, f1),
              ipc.encode(ipc.MsgType.TRANSCRIBE, 2**40, m2, p2, f2),
              ipc.encode(ipc.MsgType.TRANSCRIBE, 9, m3, p3, f3),
              ipc.encode(ipc.MsgType.PING, 10),
              ipc.encode(ipc.MsgType.TRANSCRIBE, 11, m4, p4, f4)]
    got = asyncio.run(_roundtrip(frames))
    assert [g.req_id for g in got] == [7, 2**40, 9, 10, 11]
    assert got[0].meta["language"] == "en" and len(got[0].payload) == x.nbytes
    np.testing.assert_array_equal(ipc.unpack_audio(got[0]), x)
    np.testing.assert_array_equal(ipc.unpack_audio(got[1]), x)       # copied out of shm, then unlinked
    with pytest.raises(FileNotFoundError):
        ipc.shared_memory.SharedMemory(name=m2["shm"])
    ipc.release_audio(h2, replied=True)                               # sender's clean-up: missing is fine
    np.testing.assert_allclose(ipc.unpack_audio(got[2]), i16.astype(np.float32) / 32768)
    assert got[3].type == ipc.MsgType.PING and got[3].meta == {} and len(got[3].payload) == 0
    y = ipc.unpack_audio(got[4])                                      # pooled: read in place, no copy
    np.testing.assert_array_equal(y, x)
    assert not y.flags.owndata
    del y
    ipc.release_audio(h4, replied=True)                               # reply arrived: the segment is reused
    _, m5, _, h5 = ipc.pack_audio(x[::-1].copy(), shm_threshold=1024, pool=pool)
    assert m5["shm"] == m4["shm"]
    np.testing.assert_array_equal(ipc.unpack_audio(ipc.Frame(2, 12, int(f4), m5, b"")), x[::-1])
    ipc.release_audio(h5, replied=False)                              # no reply: discarded, never reused
    _, m6, _, h6 = ipc.pack_audio(x, shm_threshold=1024, pool=pool)
    assert m6["shm"] != m4["shm"]
    ipc.release_audio(h6, replied=True)
    pool.close()
    with pytest.raises(FileNotFoundError):
        ipc.shared_memory.SharedMemory(name=m6["shm"])


def test_burst_of_small_and_large_frames():
    """Many frames back to back: small ones share read-ahead, a large payload straddles it."""
    rng = np.random.default_rng(1)
    waves = [rng.standard_normal(n).astype(np.float32) for n in (10, 3, 200_000, 7, 1, 70_000, 5)]

    async def go():
        a, b = socket.socketpair()
        ca, cb = ipc.Conn(a), ipc.Conn(b)

        async def send_all():
            for i, w in enumerate(waves):
                f, m, p, _ = ipc.pack_audio(w, shm_threshold=1 << 30)
                await ca.send(ipc.encode(ipc.MsgType.TRANSCRIBE, i, m, p, f))

        t = asyncio.ensure_future(send_all())
        got = [await cb.recv_frame() for _ in waves]
        await t
        ca.close()
        cb.close()
        return got

    got = asyncio.run(go())
    for i, (g, w) in enumerate(zip(got, waves)):
        assert g.req_id == i
        np.testing.assert_array_equal(ipc.unpack_audio(g), w)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_concurrent_senders_coalesce_and_frames_stay_whole(loop_kind):
    """Frames queued by many tasks in one turn of the loop leave together at its end (nothing
    sent before it, the queue empty after it); with large payloads beyond the socket's buffer
    in between and a sender cancelled while it waits for the queue to drain, every frame
    arrives whole, in the order of the calls, and a frame sent just before close() arrives."""
    rng = np.random.default_rng(2)
    sizes = [int(n) for n in rng.integers(1, 3000, 300)]
    sizes[50] = sizes[200] = 3_000_000  # 12 MB frames: over WRITE_HIGH, the senders after them wait
    waves = [rng.standard_normal(n).astype(np.float32) for n in sizes]

    async def go():
        a, b = socket.socketpair()
        ca, cb = ipc.Conn(a), ipc.Conn(b)
        frames = []
        for i, w in enumerate(waves[:20]):  # one turn, no awaits in between: one flush at its end
            f, m, p, _ = ipc.pack_audio(w, shm_threshold=1 << 30)
            frames.append(asyncio.ensure_future(ca.send(ipc.encode(ipc.MsgType.TRANSCRIBE, i, m, p, f))))
        await asyncio.sleep(0)   # the sends ran: all queued, none written yet
        queued = len(ca._wq)
        await asyncio.sleep(0)   # the flush ran
        after = len(ca._wq)
        await asyncio.gather(*frames)

        async def send(i):
            f, m, p, _ = ipc.pack_audio(waves[i], shm_threshold=1 << 30)
            await ca.send(ipc.encode(ipc.MsgType.TRANSCRIBE, i, m, p, f))

        tasks = [asyncio.ensure_future(send(i)) for i in range(20, len(waves))]
        await asyncio.sleep(0)
        tasks[201 - 20].cancel()  # queued behind a 12 MB frame, waiting for the drain
        got = [await cb.recv_frame() for _ in waves]
        await asyncio.gather(*tasks, return_exceptions=True)
        await ca.send(ipc.encode(ipc.MsgType.PING, 999))
        ca.close()
        last = await cb.recv_frame()
        cb.close()
        return queued, after, got, last

    queued, after, got, last = _run_loop(loop_kind, go())
    assert queued == 2 * 20 and after == 0, (queued, after)  # header + payload per frame
    assert [g.req_id for g in got] == list(range(len(waves)))
    for g, w in zip(got, waves):
        np.testing.assert_array_equal(ipc.unpack_audio(g), w)
    assert last.type == ipc.MsgType.PING and last.req_id == 999


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_read_frames_hands_every_frame_to_the_callback_in_order(loop_kind):
    """The engine's way of reading (``Conn.read_frames``): frames read ahead by ``recv_frame`` come
    first, then every frame as it arrives, whole and in order -- small ones many to a receive, a
    payload larger than the read-ahead buffer received into its own array, metadata larger than it
    -- while the reader stays registered; the end of the stream, a malformed frame and an exception
    of the callback end the reading with that error; a closed connection ends it too."""
    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.integers(1, 3000, 200)]
    sizes[20] = 400_000  # 1.6 MB: beyond the 256 KiB read-ahead buffer
    waves = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    big_meta = {"text": "x" * 300_000}  # beyond the buffer too

    async def go():
        a, b = socket.socketpair()
        ca, cb = ipc.Conn(a), ipc.Conn(b)
        for i in range(2):  # two frames in one send: recv_frame reads both ahead, returns the first
            await ca.send(ipc.encode(ipc.MsgType.PING, 100 + i))
        first = await cb.recv_frame()
        got = []
        done = cb.read_frames(got.append)
        for i, w in enumerate(waves):
            f, m, p, _ = ipc.pack_audio(w, shm_threshold=1 << 30)
            if i == 50:
                m.update(big_meta)
            await ca.send(ipc.encode(ipc.MsgType.TRANSCRIBE, i, m, p, f))
            if i % 37 == 0:
                await asyncio.sleep(0.001)
        while len(got) < len(waves) + 1:
            await asyncio.sleep(0.01)
        assert not done.done()
        ca.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await done
        cb.close()

        ends = []
        for bad in (b"XX" + ipc.encode(ipc.MsgType.PING, 1)[0][2:], None):  # malformed; a callback that raises
            a, b = socket.socketpair()
            c = ipc.Conn(b)

            def boom(f):
                raise RuntimeError("boom")

            done = c.read_frames(boom if bad is None else got.append)
            a.sendall(bad or ipc.encode(ipc.MsgType.PING, 1)[0])
            with pytest.raises((ipc.FramingError, RuntimeError)) as e:
                await asyncio.wait_for(done, 5)
            ends.append(type(e.value))
            c.close()
            a.close()
        a, b = socket.socketpair()
        c = ipc.Conn(b)
        done = c.read_frames(got.append)
        c.close()
        with pytest.raises(ConnectionError):
            await done
        a.close()
        return first, got, ends

    first, got, ends = _run_loop(loop_kind, go())
    assert first.req_id == 100 and got[0].req_id == 101
    got = got[1:]
    assert [g.req_id for g in got] == list(range(len(waves)))
    for g, w in zip(got, waves):
        np.testing.assert_array_equal(ipc.unpack_audio(g), w)
    assert got[50].meta["text"] == big_meta["text"]
    assert ends == [ipc.FramingError, RuntimeError]


def test_read_frames_holds_while_replies_wait_for_a_peer_that_does_not_read():
    """An engine's STATS or PING reply to a front end that does not read: once more than WRITE_HIGH
    bytes wait to be sent, ``hold_reading_until_drained`` stops the reading (as awaiting ``send``
    after the frame did) and the reading goes on once the peer has read them."""

    async def go():
        a, b = socket.socketpair()
        peer, c = ipc.Conn(a), ipc.Conn(b)
        got = []

        def on_frame(f):
            got.append(f.req_id)
            if f.req_id == 1:  # a reply far beyond the socket's buffer: most of it waits
                c.post(ipc.encode(ipc.MsgType.STATS_REPLY, 1, None, bytes(ipc.WRITE_HIGH + (1 << 20))))
                c.hold_reading_until_drained()

        done = c.read_frames(on_frame)
        for i in (1, 2, 3):
            await peer.send(ipc.encode(ipc.MsgType.PING, i))
        await asyncio.sleep(0.2)
        held = list(got)
        reply = await peer.recv_frame()  # the peer reads: the queue drains, the reading goes on
        for _ in range(100):
            if len(got) == 3:
                break
            await asyncio.sleep(0.01)
        peer.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await done
        c.close()
        return held, got, reply

    held, got, reply = asyncio.run(go())
    assert held == [1] and got == [1, 2, 3]
    assert reply.type == ipc.MsgType.STATS_REPLY and len(reply.payload) == ipc.WRITE_HIGH + (1 << 20)


def _run_loop(kind: str, coro):
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run(coro)
    return asyncio.run(coro)


def test_malformed_frames_are_rejected():
    good = ipc.encode(ipc.MsgType.PING, 1)[0]
    for bad in (b"XX" + good[2:],                                       # magic
                good[:2] + b"\x09" + good[3:],                          # version
                good[:3] + b"\x63" + good[4:]):                         # type
        with pytest.raises(ipc.FramingError):
            ipc.parse_header(bad)
    huge_meta = ipc.HEADER.pack(ipc.MAGIC, ipc.VERSION, 2, 0, 0, 1, ipc.MAX_META + 1, 0)
    with pytest.raises(ipc.FramingError):
        ipc.parse_header(huge_meta)
    # metadata that is not a JSON object, payload/sample count mismatch, SHM frame without a name
    notjson = ipc.HEADER.pack(ipc.MAGIC, ipc.VERSION, 2, 0, 0, 1, 3, 0) + b"{x}"
    a, b = socket.socketpair()
    a.sendall(notjson)
    a.close()

    async def read():
        c = ipc.Conn(b)
        try:
            return await c.recv_frame()
        finally:
            c.close()

    with pytest.raises(ipc.FramingError):
        asyncio.run(read())
    with pytest.raises(ipc.FramingError):
        ipc.unpack_audio(ipc.Frame(2, 1, 0, {"n": 5}, b"\0" * 16))
    with pytest.raises(ipc.FramingError):
        ipc.unpack_audio(ipc.Frame(2, 1, 0, {"n": 1}, b"\0" * 3))
    with pytest.raises(ipc.FramingError):
        ipc.unpack_audio(ipc.Frame(2, 1, int(ipc.Flag.SHM), {"n": 4}, b""))


def test_metadata_codec_is_json_s_own():
    """The frames' metadata codec (one C encoder, the C scanner of ``json.loads``) writes what
    ``json.dumps`` with compact separators writes and reads what ``json.loads`` reads; whitespace
    around the object is still accepted, trailing data is refused."""
    import json

    ref = json.JSONEncoder(separators=(",", ":"))
    for m in ({"stream_result": {"text": "h\u00e9llo \"x\"\n\u65e5", "stable_text": "", "frames": 3, "audio_s": 0.24,
                                 "new_tokens": 0, "tokens": 5}},
              {"a": [1, 2.5, float("inf"), float("-inf"), None, True, {"b": []}], "n": 2**70, "e": 1e-300}):
        text = ipc._JSON_ENCODE(m)
        assert text == ref.encode(m)
        b = text.encode()
        assert json.dumps(ipc._meta(b, 0, len(b))) == json.dumps(json.loads(b))
    assert ipc._meta(b' {"a": 1} ', 0, 10) == {"a": 1}
    for bad in (b'{"a":1} x', b'{"a":1}{}', b'{x}', b"[1]"):
        with pytest.raises(ipc.FramingError):
            ipc._meta(bad, 0, len(bad))
    with pytest.raises(TypeError):
        ipc._JSON_ENCODE({"a": object()})


def test_transcript_wire_roundtrip():
    w = [Word(" a", 0.0, 0.5, 0.9), Word(" b", 0.5, 1.0, None)]
    t = Transcript("a b", "en", 1.0, [Segment(0, 0.0, 1.0, " a b", [1, 2], -0.1, 0.01, 1.2, 0.0, 0, w)], w,
                   "m")
    assert ipc.transcript_from_wire(ipc.transcript_to_wire(t)) == t


@contextlib.asynccontextmanager
async def _engine_and_client(tmp_path, model, config):
    """An ``EngineServer`` of ``model`` on a Unix socket under ``tmp_path`` and a ready client of it
    (yields ``(server, client, path)``); both stopped on the way out."""
    from flashasr.serve.engine_proc import EngineServer, serve_unix

    path = str(tmp_path / "e.sock")
    server = EngineServer(model, config)
    server.scheduler.start()
    srv = asyncio.ensure_future(serve_unix(path, server.handle))
    await asyncio.sleep(0.05)
    client = ipc.EngineClient(path)
    await client.start()
    try:
        assert await client.wait_ready(5)
        yield server, client, path
    finally:
        await client.close()
        srv.cancel()
        await server.scheduler.stop()


def _take(s: BatchScheduler) -> list:
    """The items of the scheduler's next model call, as if that call finished the batch at once."""
    kind, work = s._pick()
    if kind == "run":
        s._stepped(work, None, done=True)
        return work.items
    return work or []


def test_scheduler_priorities_packing_and_coalescing():
    class NoModel:  # the picking logic runs without any model call
        sample_rate = 16000

    async def go():
        s = BatchScheduler(NoModel(), max_batch=3)
        s._wake = asyncio.Event()
        z = lambda n: np.zeros(n, np.float32)  # noqa: E731
        tasks = [asyncio.ensure_future(s.submit(z(n), priority=OFFLINE)) for n in (1000, 90000, 1100, 50000, 1200)]
        tasks.append(asyncio.ensure_future(s.submit(z(10), priority=PARTIAL, coalesce_key="s1")))
        tasks.append(asyncio.ensure_future(s.submit(z(20), priority=PARTIAL, coalesce_key="s1")))
        tasks.append(asyncio.ensure_future(s.submit(z(5), priority=FINAL)))
        await asyncio.sleep(0)
        assert await asyncio.wait_for(tasks[5], 1) is None  # superseded partial
        picks = []
        while True:
            b = _take(s)
            if not b:
                break
            picks.append([(it.priority, it.samples.size) for it in b])
        for t in tasks:
            t.cancel()
        await s.stop()
        return picks

    picks = asyncio.run(go())
    assert picks[0] == [(FINAL, 5), (PARTIAL, 20)]  # streaming work first; partials fill a final's batch
    # offline: the oldest item anchors the batch, the closest lengths join it
    assert picks[1] == [(OFFLINE, 1000), (OFFLINE, 1100), (OFFLINE, 1200)]
    assert picks[2] == [(OFFLINE, 90000), (OFFLINE, 50000)]


def test_stream_session_final_delta_completes_the_text_even_after_a_revision():
    """Deltas end with the final's words after those already sent, also when the final revised a
    word two partials had agreed on (before: no last delta at all, the rest of the utterance lost)."""
    from types import SimpleNamespace

    from flashasr.serve.stream import StreamSession

    class Backend:
        def __init__(self):
            self.partials = ["And I", "And I knew"]

        async def transcribe(self, samples, options, *, priority=None, **kw):
            if priority == PARTIAL:
                return SimpleNamespace(text=self.partials.pop(0) if self.partials else "And I knew")
            return SimpleNamespace(text="And you knew for a paper like that.")

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        s = StreamSession(Backend(), emit, input_rate=16000, partial_interval_ms=100)
        pcm = (np.zeros(1600, "<i2")).tobytes()
        for _ in range(3):  # three partials' worth of audio, each partial awaited
            await s.append_pcm16(pcm)
            for _ in range(20):
                await asyncio.sleep(0)
        await s.commit()
        await s.drain(5)
        return events

    events = asyncio.run(go())
    deltas = [e["delta"] for e in events if e["type"].endswith("transcription.delta")]
    final = next(e["transcript"] for e in events if e["type"].endswith("transcription.completed"))
    assert deltas[0] == "And I"  # agreed by the first two partials
    assert "".join(deltas) == "And I knew for a paper like that."  # 'I' was revised to 'you' by the final
    assert final == "And you knew for a paper like that."


def test_scheduler_batches_by_task_and_passes_the_options_to_every_call():
    """Items of different tasks never share a model call, and every call receives the options
    object (with its task), transcribe included: no keyword is left out to please a model."""
    from flashasr.options import TranscribeOptions

    calls = []

    class Recorder:
        sample_rate = 16000
        name = "rec"

        def transcribe_batch(self, ws, options):
            calls.append((len(ws), options))
            return [Transcript(text=options.task, language="en", duration=w.size / 16000) for w in ws]

    async def go():
        s = BatchScheduler(Recorder(), max_batch=8, batch_wait_s=0.01)
        s.start()
        z = np.zeros(1600, np.float32)
        outs = await asyncio.gather(*[s.submit(z, task=t) for t in ("translate", "transcribe", "translate",
                                                                     "transcribe")])
        await s.stop()
        return [o.text for o in outs]

    assert asyncio.run(go()) == ["translate", "transcribe", "translate", "transcribe"]
    assert sorted((n, o.task) for n, o in calls) == [(2, "transcribe"), (2, "translate")]
    assert all(isinstance(o, TranscribeOptions) for _, o in calls)


def test_translate_task_crosses_the_engine_socket(tmp_path):
    """Front end -> engine process protocol, in one process: the task reaches the engine's model,
    the HELLO says whether the model translates, and the result comes back marked translate."""
    from flashasr.models.base import ASRModel
    from flashasr.options import TranscribeOptions
    from flashasr.serve.config import ServeConfig

    seen = []

    class Translator(ASRModel):
        name, family, multilingual, translates = "fake-translator", "whisper", True, True

        def _transcribe(self, waves, options):
            seen.extend(options.task for _ in waves)
            return [Transcript(text=f"[{options.task}]", language="en" if options.task == "translate" else "de",
                               duration=w.size / 16000, task=options.task) for w in waves]

    async def go():
        async with _engine_and_client(tmp_path, Translator(), ServeConfig()) as (_, client, _):
            assert client.info["translates"] is True
            z = np.zeros(1600, np.float32)
            [a] = await client.transcribe(z, TranscribeOptions(task="translate"), timeout=10)
            [b] = await client.transcribe(z, TranscribeOptions(), timeout=10)
            return a, b

    a, b = asyncio.run(go())
    assert (a.text, a.task, a.language) == ("[translate]", "translate", "en")
    assert (b.text, b.task) == ("[transcribe]", "transcribe")
    assert seen == ["translate", "transcribe"]
    assert a.to_dict()["task"] == "translate"


def test_a_request_before_the_engine_connects_waits_for_it_then_says_why_not(tmp_path):
    """Multi mode: each front end connects to the engine on its own, so a request can reach one a
    moment before its connection is up (CI once got 503 'restarting' there). Such a request waits for
    the connection (connect_wait_s) and succeeds; with no engine at all it gets the 503 saying the
    engine is starting, after a lost connection restarting, after close() shutting down."""
    from flashasr.models.base import ASRModel
    from flashasr.options import TranscribeOptions
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.engine_proc import EngineServer, serve_unix
    from flashasr.serve.errors import EngineUnavailable

    class Echo(ASRModel):
        name, family = "fake-echo", "whisper"

        def _transcribe(self, waves, options):
            return [Transcript(text=f"{w.size}", language="en", duration=w.size / 16000) for w in waves]

    async def go():
        path = str(tmp_path / "e.sock")
        out = {}
        lonely = ipc.EngineClient(str(tmp_path / "nobody.sock"), connect_wait_s=0.2)
        await lonely.start()
        with pytest.raises(EngineUnavailable) as e:
            await lonely.transcribe(np.zeros(160, np.float32), TranscribeOptions(), timeout=5)
        out["starting"] = (str(e.value), e.value.status)
        await lonely.close()
        with pytest.raises(EngineUnavailable) as e:
            await lonely.transcribe(np.zeros(160, np.float32), TranscribeOptions(), timeout=5)
        out["closed"] = str(e.value)

        client = ipc.EngineClient(path, connect_wait_s=5.0)
        await client.start()  # nothing listens at path yet
        held = asyncio.ensure_future(client.transcribe(np.zeros(1600, np.float32), TranscribeOptions(), timeout=10))
        await asyncio.sleep(0.3)
        out["pending_before_engine"] = not held.done()
        server = EngineServer(Echo(), ServeConfig())
        server.scheduler.start()
        srv = asyncio.ensure_future(serve_unix(path, server.handle))
        [t] = await held
        out["text"] = t.text
        srv.cancel()  # the engine goes away, as when it dies: no listener, the connection closed
        await asyncio.sleep(0.05)
        if os.path.exists(path):
            os.unlink(path)
        if client._conn is not None:
            client._conn.close()
        await asyncio.sleep(0.3)
        out["restarting"] = client.unavailable_reason() if client._conn is None else "still connected"
        await client.close()
        await server.scheduler.stop()
        return out

    out = asyncio.run(go())
    assert out["starting"][1] == 503 and "starting" in out["starting"][0], out
    assert "shutting down" in out["closed"], out
    assert out["pending_before_engine"] and out["text"] == "1600", out
    assert "restarting" in out["restarting"], out


def test_scheduler_short_requests_first_bulk_shared_fairly_nothing_starves():
    """Short requests (at most 30 s of audio) go before the pieces of long uploads, waiting for
    the call running only, while bulk work keeps one call in every four under a flood of them;
    long uploads among themselves share the model fairly by audio seconds (an upload arriving
    behind a long one of equal-length pieces is served within the next two batches) and a long
    upload keeps moving while others keep arriving."""
    from flashasr.options import TranscribeOptions
    from flashasr.serve.scheduler import BULK_EVERY

    class NoModel:
        sample_rate = 16000

    opts = TranscribeOptions()
    secs = lambda n: [(k * 16000, (k + 1) * 16000) for k in range(n)]  # noqa: E731 - n pieces of 1 s

    async def go(n_long: int, max_batch: int, arrivals: int, short_s: float):
        """A long upload, then before each of ``arrivals`` picks a 2-piece (first pick) or 1-piece
        upload; returns per pick how many of its pieces were the long upload's."""
        s = BatchScheduler(NoModel(), max_batch=max_batch, short_s=short_s)
        s._wake = asyncio.Event()
        xl = np.zeros(16000 * n_long, np.float32)
        tasks = [asyncio.ensure_future(s.submit_pieces(xl, secs(n_long), opts))]
        await asyncio.sleep(0)
        picks = [_take(s)]
        for k in range(arrivals):
            tasks.append(asyncio.ensure_future(s.submit_pieces(np.zeros(32000, np.float32), secs(2 if k == 0 else 1),
                                                               opts)))
            await asyncio.sleep(0)
            picks.append(_take(s))
        for b in picks:
            for it in b:
                if not it.fut.done():
                    it.fut.set_result(None)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await s.stop()
        return [sum(it.samples.base is xl for it in b) for b in picks]

    # short requests: B's two pieces go next, C after them with a 1 s piece of the long upload beside it
    assert asyncio.run(go(40, 2, 2, 30.0)) == [2, 0, 1]
    # a flood of short requests: bulk work still gets one call in every BULK_EVERY + 1
    longs = asyncio.run(go(40, 1, 80, 30.0))
    assert all(sum(longs[k: k + BULK_EVERY + 1]) >= 1 for k in range(0, 80 - BULK_EVERY)), longs
    assert sum(longs[:20]) == 20 // (BULK_EVERY + 1), longs
    # bulk among itself (no request counts as short): equal lengths, batches of 2: A's first batch,
    # then B's two pieces within the next two batches
    longs = asyncio.run(go(20, 2, 2, 0.0))
    assert longs[0] == 2 and 4 - sum(longs[1:]) == 2 + 1  # B's 2 pieces and the 1-piece C, A's the rest
    longs = asyncio.run(go(20, 2, 1, 0.0))
    assert longs[1] <= 1  # B's pieces lead the very next batch
    # overload: batches of 1 and a new upload before every pick. Each upload gets an equal
    # share, so the long one's share shrinks as the backlog of short ones grows, but it keeps moving
    # (the virtual time reaches its next piece) and finishes; a rule that always let newer uploads'
    # first pieces go first would leave it at its first piece forever
    longs = asyncio.run(go(10, 1, 80, 0.0))
    assert sum(longs) == 10, longs
    assert sum(longs[:20]) >= 5, longs


def test_engine_options_are_parsed_once_per_distinct_raw_options():
    """The engine resolves a stream's options once (every chunk carries them) but never mixes up
    raw options that hash alike (1, 1.0 and True), still refuses bad ones on every request, and
    passes unhashable values (lists) uncached to the parser, whose error names the option."""
    from flashasr.errors import FlashASRError
    from flashasr.models.base import ASRModel
    from flashasr.options import TranscribeOptions
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.engine_proc import EngineServer

    class English(ASRModel):
        name, family, multilingual = "fake-en", "whisper", False

        def languages(self):
            return frozenset({"en"})

        def _transcribe(self, waves, options):
            return []

    server = EngineServer(English(), ServeConfig())
    calls = []
    real = TranscribeOptions.from_dict

    def counted(d):
        calls.append(d)
        return real(d)

    TranscribeOptions.from_dict = staticmethod(counted)
    try:
        a = server._options({"language": "en", "word_timestamps": True})
        assert server._options({"language": "en", "word_timestamps": True}) is a and len(calls) == 1
        assert a.max_segment_s == server.caps.window_s  # resolved against the model
        with pytest.raises(FlashASRError):  # 1 is not True: parsed (and refused) on its own
            server._options({"language": "en", "word_timestamps": 1})
        for _ in range(2):  # a refused option is refused every time, never cached
            with pytest.raises(FlashASRError):
                server._options({"language": "de"})
        for _ in range(2):  # unhashable values (a list) go uncached to the parser, which says what is wrong
            with pytest.raises(FlashASRError, match="temperature"):
                server._options({"language": "en", "temperature": [0.0, 0.2]})
        assert server._options(None) is server._options(None)
    finally:
        TranscribeOptions.from_dict = real


class _NoModel:  # the picking logic runs without any model call
    sample_rate = 16000


class _NoStreamer:
    def step(self, requests):
        return [None] * len(requests)


def test_finals_gather_while_partials_wait_then_run_in_time():
    """``final_wait_s``: while partial work is queued a young final waits (partials run first), a final
    that has waited ``final_wait_s`` -- or a full batch of finals -- runs first, and with nothing else
    queued a final runs at once."""
    async def go():
        s = BatchScheduler(_NoModel(), max_batch=3, streamer=_NoStreamer(), final_wait_s=0.05)
        s._wake = asyncio.Event()
        z = lambda n: np.zeros(n, np.float32)  # noqa: E731
        final = lambda n: asyncio.ensure_future(s.submit(z(n), priority=FINAL))  # noqa: E731
        chunk = lambda k: asyncio.ensure_future(s.submit_chunk(k, z(100), s_opts))  # noqa: E731
        from flashasr.options import TranscribeOptions
        s_opts = TranscribeOptions()
        tasks = [final(5)]
        await asyncio.sleep(0)
        assert [it.priority for it in _take(s)] == [FINAL]  # nothing else queued: at once
        tasks += [chunk("a"), chunk("b"), final(6)]
        await asyncio.sleep(0)
        first = _take(s)
        assert [(it.priority, it.stream) for it in first] == [(PARTIAL, "a"), (PARTIAL, "b")]  # the final gathers
        tasks += [chunk("c"), final(7)]
        await asyncio.sleep(0.06)  # the oldest final has now waited final_wait_s
        assert [(it.priority, it.samples.size) for it in _take(s)] == [(FINAL, 6), (FINAL, 7)]
        assert [it.stream for it in _take(s)] == ["c"]
        tasks += [chunk("d")] + [final(8 + i) for i in range(3)]
        await asyncio.sleep(0)
        assert [it.samples.size for it in _take(s)] == [8, 9, 10]  # a full batch of finals does not wait
        for t in tasks:
            t.cancel()
        await s.stop()

    asyncio.run(go())


def test_finals_gather_longer_while_partials_are_late():
    """``final_wait_max_s``: while the oldest queued chunked partial has waited ``PARTIALS_LATE_S``,
    a final gathers up to ``final_wait_max_s`` (larger final batches leave the engine to the late
    partials); with young partials ``final_wait_s`` holds as before, a full batch never waits,
    ``final_wait_s`` 0 keeps finals strictly first, and chunks held on purpose (``partial_wait_s``)
    are not late. Ages are set by hand: no timing in the test."""
    from flashasr.options import TranscribeOptions
    from flashasr.serve.scheduler import PARTIALS_LATE_S

    opts, z = TranscribeOptions(), np.zeros(100, np.float32)

    def queued(s, ages_ms: dict, finals_ms: list):
        """Chunks of streams (key -> age) and finals (ages) queued, then the next call's kinds."""
        now = time.perf_counter()
        for k, age in ages_ms.items():
            s.queue_chunk(k, z, opts, new=True).t_enq = now - age / 1000
        for age in finals_ms:
            s._enqueue(z, opts, FINAL).t_enq = now - age / 1000
        return [it.priority for it in _take(s)]

    async def go():
        late = 1000 * PARTIALS_LATE_S + 5
        s = BatchScheduler(_NoModel(), max_batch=3, streamer=_NoStreamer(), final_wait_s=0.02, final_wait_max_s=0.06)
        s._wake = asyncio.Event()
        got = [queued(s, {"a": 10}, [30])]      # young chunk, final past 20 ms: the final first
        _take(s)
        got.append(queued(s, {"b": late}, [30]))  # late chunk: the 30 ms final waits (60 ms)
        got.append(queued(s, {"c": late}, []))    # (the final is still queued, 30 ms old)
        s._queues[FINAL][0].t_enq -= 0.035        # now 65 ms: due
        got.append([it.priority for it in _take(s)])
        _take(s)
        got.append(queued(s, {"d": late}, [1, 1, 1]))  # a full batch of finals does not wait
        _take(s)
        await s.stop()
        strict = BatchScheduler(_NoModel(), max_batch=3, streamer=_NoStreamer(), final_wait_s=0, final_wait_max_s=0.06)
        strict._wake = asyncio.Event()
        got.append(queued(strict, {"e": late}, [0]))  # final_wait_s 0: finals always first
        await strict.stop()
        held = BatchScheduler(_NoModel(), max_batch=3, streamer=_NoStreamer(), final_wait_s=0.02,
                              final_wait_max_s=0.06, partial_wait_s=0.2)
        held._wake = asyncio.Event()
        got.append(queued(held, {"f": late}, [30]))  # held on purpose (wait 200 ms): not late
        await held.stop()
        return got

    assert asyncio.run(go()) == [[FINAL], [PARTIAL], [PARTIAL], [FINAL], [FINAL] * 3, [FINAL], [FINAL]]


def test_queue_depth_gauges_are_read_when_the_metrics_are():
    """``flashasr_engine_queue_depth`` by kind is the queue's length when the metrics are read (no
    gauge update per item): queued chunks and finals count, a chunk dropped or taken into a model
    call does not."""
    from flashasr.options import TranscribeOptions

    def depth(s):
        return {smp.labels["kind"]: smp.value for m in s.metrics.registry.collect()
                if m.name == "flashasr_engine_queue_depth" for smp in m.samples}

    async def go():
        s = BatchScheduler(_NoModel(), max_batch=3, streamer=_NoStreamer())
        s._wake = asyncio.Event()
        opts, z = TranscribeOptions(), np.zeros(100, np.float32)
        its = [s.queue_chunk(k, z, opts, new=True) for k in "abc"]
        final = asyncio.ensure_future(s.submit(z, priority=FINAL))
        await asyncio.sleep(0)
        got = [depth(s)]
        s.drop(its[1])
        got.append(depth(s))
        assert [it.priority for it in _take(s)] == [FINAL]  # (chunks are a streamer step: not in its batch)
        got.append(depth(s))
        assert [it.stream for it in _take(s)] == ["a", "c"]
        got.append(depth(s))
        final.cancel()
        await s.stop()
        return got

    got = asyncio.run(go())
    assert got == [{"final": 1, "partial": 3, "offline": 0}, {"final": 1, "partial": 2, "offline": 0},
                   {"final": 0, "partial": 2, "offline": 0}, {"final": 0, "partial": 0, "offline": 0}], got


def test_streamer_gauges_follow_its_pool_and_counters():
    """``EngineMetrics.watch_streamer`` (every door's scheduler calls it for its streamer): the state pool's capacity and live slots, graph captures and
    the streamer's work counters are read from the streamer when the metrics are (a pool that grew
    or a step that ran shows at the next read)."""
    from types import SimpleNamespace

    pool = SimpleNamespace(capacity=4, free=[2, 3])
    st = SimpleNamespace(pool=pool, captures=10, counters={"steps": 1, "rows": 5, "encoder_frames": 30,
                                                           "padded_frames": 35})
    m = BatchScheduler(_NoModel(), streamer=st).metrics  # a scheduler given a streamer exports it

    def read():
        return {(smp.name, tuple(sorted(smp.labels.values()))): smp.value for mm in m.registry.collect()
                if mm.name.startswith("flashasr_stream") for smp in mm.samples}

    a = read()
    pool.capacity, pool.free = 8, [7]
    st.captures += 3
    st.counters.update(steps=3, rows=9)
    b = read()
    assert a[("flashasr_stream_slots", ("capacity",))] == 4 and a[("flashasr_stream_slots", ("live",))] == 2
    assert b[("flashasr_stream_slots", ("capacity",))] == 8 and b[("flashasr_stream_slots", ("live",))] == 7
    assert (a[("flashasr_stream_graph_captures_total", ())], b[("flashasr_stream_graph_captures_total", ())]) == (10, 13)
    assert [b[("flashasr_stream_work_total", (k,))] for k in ("steps", "rows", "encoder_frames", "padded_frames")] == [3, 9, 30, 35]
    text = m.text().decode()  # counters to Prometheus (rate() sees an engine restart as a counter reset)
    assert "# TYPE flashasr_stream_work_total counter" in text and "# TYPE flashasr_stream_slots gauge" in text


def test_finals_share_calls_under_a_stream_of_partials():
    """A running scheduler whose model calls take 5 ms, finals arriving one by one every 2 ms while
    chunked partials are always queued: with ``final_wait_s`` the finals share calls (fewer, larger
    final batches than with strict priority), every final is answered, and none waited much more
    than ``final_wait_s`` plus two calls."""
    import time as _time

    from flashasr.options import TranscribeOptions

    class Slow:
        sample_rate = 16000

        def transcribe_batch(self, waves, options=None, **kw):
            _time.sleep(0.005)
            return [Transcript(text="f", language="en", duration=len(w) / 16000) for w in waves]

    class SlowStreamer:
        def step(self, requests):
            _time.sleep(0.005)
            return [None] * len(requests)

    def run(wait):
        async def go():
            s = BatchScheduler(Slow(), max_batch=64, streamer=SlowStreamer(), final_wait_s=wait)
            s.start()
            opts = TranscribeOptions()
            stop = False

            async def partials(k):
                while not stop:
                    await s.submit_chunk(k, np.zeros(160, np.float32), opts)

            ps = [asyncio.ensure_future(partials(f"s{i}")) for i in range(8)]
            waits = []

            async def one_final(i):
                t = _time.perf_counter()
                r = await s.submit(np.zeros(1600, np.float32), opts, priority=FINAL)
                waits.append(_time.perf_counter() - t)
                return r

            fs = []
            for i in range(60):
                fs.append(asyncio.ensure_future(one_final(i)))
                await asyncio.sleep(0.002)
            done = await asyncio.wait_for(asyncio.gather(*fs), 30)
            stop = True
            await asyncio.gather(*ps, return_exceptions=True)
            sizes = next(m for m in s.metrics.registry.collect() if m.name == "flashasr_engine_batch_size")
            n = sum(x.value for x in sizes.samples if x.name.endswith("_count") and x.labels.get("kind") == "final")
            await s.stop()
            return done, n, max(waits)

        return asyncio.run(go())

    done0, calls0, _ = run(0.0)
    done1, calls1, worst = run(0.03)
    print(f"final calls: strict priority {calls0}, final_wait 30 ms {calls1}; worst wait {worst * 1000:.0f} ms")
    assert all(r is not None and r.text == "f" for r in done0 + done1)
    assert calls1 < calls0  # finals shared calls
    assert worst < 0.03 + 0.5  # bounded: the wait plus a few calls (generous for a loaded CI machine)


def test_chunked_partials_gather_for_a_larger_step_only_when_nothing_else_runs():
    """``partial_wait_s``: a few young chunks wait (the hold is at most the wait), a full step's worth,
    an old chunk, offline work or a due final does not."""
    async def go():
        from flashasr.options import TranscribeOptions

        opts = TranscribeOptions()
        s = BatchScheduler(_NoModel(), max_batch=4, streamer=_NoStreamer(), stream_batch=3, partial_wait_s=0.05,
                           final_wait_s=0.02)
        s._wake = asyncio.Event()
        z = lambda n: np.zeros(n, np.float32)  # noqa: E731
        assert s._hold() == 0.0  # nothing queued
        tasks = [asyncio.ensure_future(s.submit_chunk(k, z(100), opts)) for k in ("a", "b")]
        await asyncio.sleep(0)
        h = s._hold()
        assert 0.03 < h <= 0.05  # two young chunks of a step of three: wait
        tasks.append(asyncio.ensure_future(s.submit(z(9), opts, priority=FINAL)))
        await asyncio.sleep(0)
        assert 0 < s._hold() <= 0.02  # a queued final: at most until it is due
        await asyncio.sleep(0.025)
        assert s._hold() == 0.0  # the final is due
        assert [it.priority for it in _take(s)] == [FINAL]
        await asyncio.sleep(0.03)
        assert s._hold() == 0.0  # the oldest chunk has waited partial_wait_s
        tasks.append(asyncio.ensure_future(s.submit_chunk("c", z(100), opts)))
        await asyncio.sleep(0)
        assert s._hold() == 0.0  # a full step
        assert [it.stream for it in _take(s)] == ["a", "b", "c"]
        tasks.append(asyncio.ensure_future(s.submit_chunk("d", z(100), opts)))
        tasks.append(asyncio.ensure_future(s.submit(z(50), opts, priority=OFFLINE)))
        await asyncio.sleep(0)
        assert s._hold() == 0.0  # offline work is runnable: no idle wait
        s2 = BatchScheduler(_NoModel(), streamer=_NoStreamer(), stream_batch=3)  # default: no wait
        s2._wake = asyncio.Event()
        tasks.append(asyncio.ensure_future(s2.submit_chunk("e", z(100), opts)))
        await asyncio.sleep(0)
        assert s2._hold() == 0.0
        for t in tasks:
            t.cancel()
        await s.stop()
        await s2.stop()

    asyncio.run(go())


def test_the_scheduler_sets_the_switch_interval_while_it_runs():
    """``switch_interval_s`` is the interpreter's GIL switch interval from start() to stop(); the
    config passes ``--switch-interval-ms``, whose default 0 leaves CPython's alone."""
    import sys

    from flashasr.serve.config import ServeConfig

    assert ServeConfig(switch_interval_ms=0.5).scheduler_options["switch_interval_s"] == 0.0005
    assert ServeConfig().scheduler_options["switch_interval_s"] is None
    before = sys.getswitchinterval()

    async def go():
        s = BatchScheduler(_NoModel(), switch_interval_s=0.0005)
        s.start()
        during = sys.getswitchinterval()
        await s.stop()
        return during

    assert abs(asyncio.run(go()) - 0.0005) < 1e-9
    assert sys.getswitchinterval() == before


def test_new_work_ends_a_partial_wait():
    """A running scheduler holding a lone chunk for ``partial_wait_s`` (0.5 s) answers a final, an
    upload or a full step that arrives meanwhile at once, not when the wait runs out."""
    import time as _time

    from flashasr.options import TranscribeOptions

    class Echo:
        sample_rate = 16000

        def transcribe_batch(self, waves, options=None, **kw):
            return [Transcript(text="t", language="en", duration=len(w) / 16000) for w in waves]

    async def timed(aw):
        t = _time.perf_counter()
        await aw
        return _time.perf_counter() - t

    async def go():
        s = BatchScheduler(Echo(), max_batch=8, streamer=_NoStreamer(), stream_batch=2, partial_wait_s=0.5)
        s.start()
        opts = TranscribeOptions()
        z = np.zeros(1600, np.float32)
        took = {}
        for what in ("final", "upload", "full step"):
            lone = asyncio.ensure_future(s.submit_chunk(f"lone-{what}", z, opts))
            await asyncio.sleep(0.05)  # the scheduler is holding the lone chunk now
            if what == "final":
                took[what] = await timed(s.submit(z, opts, priority=FINAL))
            elif what == "upload":
                took[what] = await timed(s.submit(z, opts, priority=OFFLINE))
            else:
                took[what] = await timed(s.submit_chunk(f"second-{what}", z, opts))
            await asyncio.wait_for(lone, 2)
        await s.stop()
        return took

    took = asyncio.run(go())
    assert all(t < 0.3 for t in took.values()), took


def test_stream_chunks_over_the_engine_socket_options_cancel_and_disconnect(tmp_path):
    """Stream chunks are queued from the engine's receive loop (no task per chunk): a stream's
    options come with its first chunk and serve its later ones (an unknown stream without options is
    refused, naming the lost state); a chunk cancelled while queued never reaches the streamer, nor
    do the queued chunks of a front end whose connection drops; each of those streams is closed."""
    import threading

    from flashasr.models.base import ASRModel
    from flashasr.options import TranscribeOptions
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.errors import APIError
    from flashasr.types import StreamResult

    class Streamer:
        L, C, frame_seconds = 4, 7, 0.08
        pool = type("P", (), {"capacity": 8})()

        def __init__(self):
            self.seen, self.closed, self.gate = [], [], threading.Event()
            self.gate.set()

        def step(self, requests):
            assert self.gate.wait(10)
            self.seen += [(k, len(a), new) for k, a, new in requests]
            return [StreamResult(text=k, stable_text="", frames=len(a), audio_s=0.0, new_tokens=0, tokens=0)
                    for k, a, new in requests]

        def close(self, key):
            self.closed.append(key)

    streamer = Streamer()

    class Model(ASRModel):
        name, family = "fake-parakeet", "parakeet"

        def _transcribe(self, waves, options):
            return [Transcript(text="", language="en", duration=w.size / 16000) for w in waves]

        def make_streamer(self, cfg):
            return streamer

    async def go():
        async with _engine_and_client(tmp_path, Model(), ServeConfig(warmup=False, partial_wait_ms=0)) \
                as (server, client, path):
            opts, z = TranscribeOptions(), np.zeros(800, np.float32)
            r1 = await client.stream_chunk("a", z, opts, new=True, timeout=10)
            r2 = await client.stream_chunk("a", z[:400], opts, timeout=10)  # no options on the wire
            assert (r1.text, r1.frames, r2.frames) == ("a", 800, 400)
            client._stream_options.add("ghost")  # as after an engine restart: the client sends no options
            with pytest.raises(APIError) as e:  # a stream this engine never saw, no options: its state was lost
                await client.stream_chunk("ghost", z, opts, timeout=10)
            assert "unknown here" in e.value.message and "ghost" in e.value.message
            streamer.gate.clear()  # the next step blocks in the model thread ...
            running = asyncio.ensure_future(client.stream_chunk("b", z, opts, new=True, timeout=10))
            await asyncio.sleep(0.2)
            queued = asyncio.ensure_future(client.stream_chunk("c", z, opts, new=True, timeout=10))
            await asyncio.sleep(0.1)
            queued.cancel()  # ... so this one is still queued when its CANCEL arrives
            await asyncio.sleep(0.1)
            streamer.gate.set()
            assert (await running).text == "b"
            # a second front end leaves with a chunk queued behind a blocked step
            other = ipc.EngineClient(path)
            await other.start()
            assert await other.wait_ready(5)
            streamer.gate.clear()
            blocked = asyncio.ensure_future(client.stream_chunk("d", z, opts, new=True, timeout=10))
            await asyncio.sleep(0.2)
            orphan = asyncio.ensure_future(other.stream_chunk("e", z, opts, new=True, timeout=10))
            await asyncio.sleep(0.1)
            await other.close()
            await asyncio.sleep(0.1)
            streamer.gate.set()
            assert (await blocked).text == "d"
            with pytest.raises(Exception):
                await orphan
            await asyncio.sleep(0.1)
            depth = server.scheduler.depth()
        return depth

    depth = asyncio.run(go())
    keys = [k for k, _, _ in streamer.seen]
    assert keys == ["a", "a", "b", "d"], streamer.seen
    assert [new for _, _, new in streamer.seen] == [True, False, True, True]
    assert "e" in streamer.closed  # the dropped front end's stream
    assert depth == 0


def test_a_dead_front_end_workers_shared_memory_is_removed():
    """Found by a new user: a front-end worker killed with SIGKILL left its pooled segments in
    /dev/shm for good (``cleanup_stale_segments`` keeps a segment while its maker's parent -- the
    server, alive -- lives). The server now unlinks the dead worker's segments, and its log says
    how the worker ended."""
    import subprocess
    import sys

    import _posixshmem

    from flashasr import shm
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.engine_proc import exit_reason as _exit_reason
    from flashasr.serve.process import _Workers

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip())
    mine = [f"{shm.SHM_PREFIX}{dead}_p{os.getpid()}_{i}" for i in (1, 2)]
    other = f"{shm.SHM_PREFIX}{dead}0_p{os.getpid()}_1"  # another process's: its pid starts with the same digits
    for n in mine + [other]:
        os.close(_posixshmem.shm_open("/" + n, os.O_CREAT | os.O_RDWR, mode=0o600))

    class Proc:
        pid, sentinel, exitcode = dead, -1, -9

        def join(self, timeout=None):
            pass

    class Loop:
        def remove_reader(self, fd):
            pass

    try:
        shm.cleanup_stale_segments()
        assert set(mine) <= set(os.listdir("/dev/shm"))  # kept: the parent (this process) lives
        w = _Workers(ServeConfig(), "unused.sock", None)
        w.stopping = True  # no replacement started
        p = Proc()
        w.procs.append(p)
        w._on_exit(Loop(), p)
        left = set(os.listdir("/dev/shm"))
        assert not set(mine) & left and other in left and not w.procs
    finally:
        for n in mine + [other]:
            shm.unlink_segment(n)
    assert (_exit_reason(-9), _exit_reason(1), _exit_reason(None)) == ("killed by SIGKILL", "code 1", "code unknown")


def test_the_engine_restart_back_off_starts_over_after_a_steady_run(monkeypatch):
    """Found by a new user: the wait before an engine restart grew with every restart of the
    server's life (0.2 s each, up to 5 s). It grows with crashes in a row (engines that died
    within ``RESTART_STEADY_S`` of their start) and starts over after an engine that ran steadily;
    ``restarts`` still counts them all."""
    from flashasr.serve import engine_proc
    from flashasr.serve.config import ServeConfig

    now = [1000.0]
    monkeypatch.setattr(engine_proc.time, "monotonic", lambda: now[0])
    delays = []

    class Loop:
        def remove_reader(self, fd):
            pass

        def call_later(self, delay, fn, *a):
            delays.append(round(delay, 3))

    class Proc:
        pid, sentinel, exitcode = 1, -1, -9

        def join(self, timeout=None):
            pass

    sup = engine_proc.EngineSupervisor(ServeConfig(), "unused.sock")
    sup._loop = Loop()
    for lived in (1, 1, 1, engine_proc.RESTART_STEADY_S + 1, 1):
        sup._started_at = now[0]
        now[0] += lived
        sup._on_exit(Proc())
    assert delays == [0.2, 0.4, 0.6, 0.2, 0.4] and sup.restarts == 5


@pytest.mark.parametrize("queued_on_device", [True, False])
def test_finals_with_chunks_share_a_call_and_finals_are_answered_before_the_step_ends(queued_on_device):
    """``finals_with_chunks``: a due final batch and the queued chunks go in one model call; the
    finals are answered while the step still runs (the step below waits for that), each side gets
    its own results and its own errors, and the call's time is split between the two kinds. A model
    without queued device work (the CPU) keeps finals in calls of their own (a trial on the VM: shared
    calls made each final wait for a chunk step)."""
    import threading

    from flashasr.options import TranscribeOptions
    from flashasr.types import StreamResult

    answered, step_started = threading.Event(), threading.Event()

    class Model:
        sample_rate = 16000

        def transcribe_batch(self, waves, options=None, **kw):
            if any(len(w) == 3 for w in waves):
                raise RuntimeError("bad final")
            return [Transcript(text=f"final {len(w)}", language="en", duration=len(w) / 16000) for w in waves]

    class Queued(Model):  # a model whose batches are queued on a device (the GPU engine's submit_batch)
        def submit_batch(self, waves, options=None, checked=False):
            model = self

            class Submitted:
                def result(self):  # read while the step runs (in a call of their own it never would)
                    assert step_started.wait(5), "the finals' call did not run the step"
                    return model.transcribe_batch(waves, options)
            return Submitted()

    class Streamer:
        def __init__(self):
            self.steps = []

        def step(self, requests):
            step_started.set()
            if queued_on_device:
                assert answered.wait(5), "the finals were not answered while the step ran"
            self.steps.append([k for k, _, _ in requests])
            return [StreamResult(text=k, stable_text="", frames=1, audio_s=0.0, new_tokens=0, tokens=0)
                    if k != "bad" else ValueError("bad chunk") for k, _, _ in requests]

    async def go():
        streamer = Streamer()
        s = BatchScheduler(Queued() if queued_on_device else Model(), max_batch=8, streamer=streamer,
                           stream_batch=8, final_wait_s=0.0, finals_with_chunks=True)
        s.start()
        opts = TranscribeOptions()
        chunks = [asyncio.ensure_future(s.submit_chunk(k, np.zeros(160, np.float32), opts)) for k in ("a", "bad")]
        finals = [asyncio.ensure_future(s.submit(np.zeros(n, np.float32), opts, priority=FINAL)) for n in (1600, 800)]

        async def watch():
            await asyncio.gather(*finals)
            answered.set()
        w = asyncio.ensure_future(watch())
        got = await asyncio.wait_for(asyncio.gather(*chunks, return_exceptions=True), 10)
        await w
        one_call = _metric(s, 'flashasr_engine_stage_seconds_count{stage="inference"}')
        bad_final = await asyncio.wait_for(asyncio.gather(
            s.submit(np.zeros(3, np.float32), opts, priority=FINAL),
            s.submit_chunk("c", np.zeros(160, np.float32), opts), return_exceptions=True), 10)
        await s.stop()
        return [f.result().text for f in finals], got, bad_final, streamer.steps, s, one_call

    texts, got, bad_final, steps, s, one_call = asyncio.run(go())
    assert one_call == (1 if queued_on_device else 2)  # the finals and the step: one model call (GPU)
    assert texts == ["final 1600", "final 800"]
    assert got[0].text == "a" and isinstance(got[1], ValueError)
    assert isinstance(bad_final[0], RuntimeError) and bad_final[1].text == "c"  # a failing final fails alone
    assert steps[0] == ["a", "bad"]
    assert _metric(s, 'flashasr_engine_inference_seconds_count{kind="final"}') == 2  # the call's time, split
    assert _metric(s, 'flashasr_engine_inference_seconds_count{kind="partial"}') == 2
    assert s.finals_with_chunks == queued_on_device


def _metric(s, name: str) -> float:
    """A sample of the scheduler's metrics by its exact name and labels."""
    m = re.search(re.escape(name) + r" (\S+)", s.metrics.text().decode())
    return float(m.group(1)) if m else 0.0


def test_hello_says_where_the_engine_start_up_went():
    """The engine's HELLO (``/ready``) carries ``startup_s``: the model's load and warm-up as measured by
    the engine process, the streamer's captures, and what the model reports of its own start-up (a GPU
    engine's build and graph warm-up, a random joint's calibration)."""
    from flashasr.models.base import ASRModel
    from flashasr.serve.config import ServeConfig
    from flashasr.serve.engine_proc import EngineServer

    class Timed(ASRModel):
        name, family = "timed-fake", "whisper"
        engine_info = {"startup_s": {"engine_build": 1.5, "graph_warmup": 40.0}}
        calibration = {"blank_bias": 4.0, "seconds": 0.3}

        def _transcribe(self, waves, options):
            return [Transcript(text="", language="en", duration=0.0, model=self.name) for _ in waves]

    s = EngineServer(Timed(), ServeConfig(), load_s=42.04).hello["startup_s"]
    assert s["model_s"] == 42.0 and s["streamer_s"] >= 0
    assert (s["engine_build_s"], s["graph_warmup_s"], s["calibration_s"]) == (1.5, 40.0, 0.3)

    class Plain(Timed):
        engine_info = None
        calibration = None

    assert set(EngineServer(Plain(), ServeConfig()).hello["startup_s"]) == {"model_s", "streamer_s"}
