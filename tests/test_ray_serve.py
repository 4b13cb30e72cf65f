"""``flashasr serve --ray``: the server on Ray Serve (one ingress replica, one model replica, CPU,
tiny.en) in a private local Ray instance that the server process starts and ends. Real clients:
the official ``openai`` package (every format, SSE, errors), a Realtime WebSocket client streaming a
real clip, the binary stream; a model replica killed mid-request (errors, none hangs, it comes
back). Plus the router's stickiness and the replicas' metrics merge, without a cluster."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from conftest import AUDIO
from test_serve_util import CLIP, CLIP_WORDS, Server, pcm16, wav_bytes, words

pytest.importorskip("ray")
from websockets.asyncio.client import connect  # noqa: E402

from flashasr.serve.ray_serve import merge_metrics  # noqa: E402

KEY = "ray-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import psutil

    s = Server(tmp_path_factory.mktemp("ray-serve"), "--ray=local", "--api-key", KEY, "--no-warmup",
               "--partial-interval-ms", "300", ready_timeout=240)
    family = [s.proc.pid] + [c.pid for c in psutil.Process(s.proc.pid).children(recursive=True)]
    yield s
    s.stop()  # SIGTERM: the application is deleted and the Ray instance of that process ends
    t_end = time.monotonic() + 20
    for pid in family:  # anything of that instance still alive after its driver left (by PID)
        while psutil.pid_exists(pid) and time.monotonic() < t_end:
            time.sleep(0.2)
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _create(client, data: bytes, name: str = "clip.wav", **kw):
    return client.audio.transcriptions.create(model="whisper-1", file=(name, data), **kw)


def test_ready_lists_the_model_replica(server):
    info = httpx.get(server.base + "/ready").json()
    assert info["status"] == "ready" and info["mode"] == "ray" and info["model"] == "whisper-tiny.en"
    assert len(info["replicas"]) == 1 and info["replicas"][0]["pid"] != info["frontend_pid"] != server.proc.pid


def test_openai_client_every_format_sse_and_errors(server, client):
    data = CLIP.read_bytes()
    text = _create(client, data).text
    assert words(text) == CLIP_WORDS
    assert _create(client, data, response_format="text").strip() == text
    srt = _create(client, data, response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and words(srt.split("\n", 2)[2]) == CLIP_WORDS
    vtt = _create(client, data, response_format="vtt")
    assert vtt.startswith("WEBVTT") and words(vtt.split("\n", 3)[3]) == CLIP_WORDS
    v = _create(client, data, response_format="verbose_json", timestamp_granularities=["word", "segment"])
    assert v.text == text and abs(v.duration - 2.97) < 0.01 and [words(w.word)[0] for w in v.words] == CLIP_WORDS
    deltas, done = [], None
    for ev in _create(client, data, stream=True):
        if ev.type == "transcript.text.delta":
            deltas.append(ev.delta)
        elif ev.type == "transcript.text.done":
            done = ev.text
    assert done == text and "".join(deltas) == text
    with pytest.raises(openai.BadRequestError) as e:  # not audio: 400 with the code plain serve gives
        _create(client, b"RIFF" + os.urandom(3000), name="bad.wav")
    assert e.value.status_code == 400 and e.value.body["code"] == "unsupported_format"
    with pytest.raises(openai.BadRequestError) as e:  # a task the model cannot do: refused in the ingress
        client.audio.translations.create(model="whisper-1", file=("clip.wav", data))
    assert e.value.body["code"] == "unsupported_task"
    bad_key = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.audio.transcriptions.create(model="whisper-1", file=("clip.wav", data))
    # the engine metrics come from the replica (published 0.1 s after a request ends, summed), the
    # request counts from the ingress
    t_end = time.monotonic() + 5
    while server.metric("flashasr_engine_audio_seconds_total") < 5 * 2.97:
        assert time.monotonic() < t_end, httpx.get(server.base + "/metrics").text
        time.sleep(0.1)
    assert server.metric("flashasr_engine_batch_size_count") >= 5
    m = httpx.get(server.base + "/metrics").text
    assert 'flashasr_requests_total{endpoint="/v1/audio/transcriptions",status="400"}' in m


def _ws(server, path: str):
    return connect(f"ws://127.0.0.1:{server.port}{path}", additional_headers={"Authorization": f"Bearer {KEY}"})


async def _events_until(ws, want: str, timeout: float = 90.0) -> list[dict]:
    out, t_end = [], time.monotonic() + timeout
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), max(0.1, t_end - time.monotonic())))
        out.append(ev)
        if ev["type"] == want:
            return out


def test_realtime_stream_final_equals_offline(server, client):
    """The Realtime protocol, 20 ms packets (faster than real time), a manual commit: partial
    deltas, then a final equal to the offline transcript of the audio sent."""
    pcm = pcm16()

    async def go():
        async with _ws(server, "/v1/realtime") as ws:
            assert json.loads(await ws.recv())["type"] == "transcription_session.created"
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {
                "input_audio_format": "pcm16", "input_audio_sample_rate": 16000, "turn_detection": None}}))
            assert json.loads(await ws.recv())["type"] == "transcription_session.updated"
            for i in range(0, len(pcm), 640):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm[i:i + 640]).decode()}))
                await asyncio.sleep(0.005)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            return await _events_until(ws, "conversation.item.input_audio_transcription.completed")

    evs = asyncio.run(go())
    final = evs[-1]["transcript"]
    assert final == _create(client, wav_bytes(pcm)).text and words(final) == CLIP_WORDS
    assert any(e["type"] == "input_audio_buffer.committed" for e in evs)


def test_binary_stream_final_equals_offline(server, client):
    pcm = pcm16()

    async def go():
        async with _ws(server, "/v1/stream?sample_rate=16000&partial_interval_ms=0") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for i in range(0, len(pcm), 999):
                await ws.send(pcm[i:i + 999])
            await ws.send(json.dumps({"type": "commit"}))
            evs = await _events_until(ws, "conversation.item.input_audio_transcription.completed")
            await ws.send(json.dumps({"type": "close"}))
            return evs

    assert asyncio.run(go())[-1]["transcript"] == _create(client, CLIP.read_bytes()).text


def test_killed_replica_fails_in_flight_requests_and_comes_back(server, client):
    info = httpx.get(server.base + "/ready").json()
    (old,) = [r["pid"] for r in info["replicas"]]
    long_clip = (AUDIO / "long" / "long-silero-test-60s.wav").read_bytes()
    results = []

    def work():
        try:
            _create(client, long_clip, name="long.wav")
            results.append((200, None, time.monotonic()))
        except openai.APIStatusError as e:
            results.append((e.status_code, e.body.get("code"), time.monotonic()))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for th in threads:
        th.start()
    t_end = time.monotonic() + 60
    while server.metric("flashasr_engine_requests_active") < 2:  # both reached the replica
        assert time.monotonic() < t_end and all(th.is_alive() for th in threads)
        time.sleep(0.1)
    os.kill(old, signal.SIGKILL)
    t_kill = time.monotonic()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "an in-flight request hung after its replica died"
    assert [(s, c) for s, c, _t in results] == [(503, "engine_unavailable")] * 2
    assert max(t for _s, _c, t in results) - t_kill < 10
    t_end = time.monotonic() + 150  # Serve starts another replica; service resumes
    while True:
        r = httpx.get(server.base + "/ready")
        if r.status_code == 200 and [x["pid"] for x in r.json()["replicas"]] not in ([], [old]):
            break
        assert time.monotonic() < t_end, r.text
        time.sleep(0.5)
    assert words(_create(client, CLIP.read_bytes()).text) == CLIP_WORDS


# ----------------------------------------------------------------------------- without a cluster
def test_router_keeps_a_session_on_its_replica():
    from flashasr.serve.ray_router import StreamAffinityRouter

    router = StreamAffinityRouter.__new__(StreamAffinityRouter)  # the routing state alone
    router.initialize_state(ttl_s=600)
    reps = [SimpleNamespace(replica_id=f"r{k}") for k in range(4)]

    def route(key):
        pending = SimpleNamespace(kwargs={"affinity": key} if key else {})
        (rank,) = asyncio.run(router.choose_replicas(reps, pending))
        chosen = rank[0]
        router.on_request_routed(pending, chosen.replica_id, None)
        return rank

    first = route("session-1")
    assert 1 <= len(first) <= 2  # a new session: the less loaded of two random replicas
    home = router.sticky["session-1"][0]
    assert all(route("session-1") == [r] for r in reps if r.replica_id == home for _ in range(20))
    reps[:] = [r for r in reps if r.replica_id != home]  # its replica is gone: the session moves once
    moved = route("session-1")
    assert moved[0].replica_id != home and route("session-1") == [moved[0]]
    assert {len(route(None)) for _ in range(10)} == {2}  # uploads: power of two choices


def test_replica_metrics_add_up():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    texts = []
    for k in (1, 2):
        r = CollectorRegistry()
        Counter("a_seconds", "audio", ["kind"], registry=r).labels("offline").inc(k)
        Gauge("q", "queue", registry=r).set(10 * k)
        Histogram("lat", "latency", buckets=(1, 2), registry=r).observe(k)
        texts.append(generate_latest(r).decode())
    got = {s.name + str(sorted(s.labels.items())): s.value
           for f in text_string_to_metric_families(merge_metrics(texts).decode()) for s in f.samples}
    assert got["a_seconds_total[('kind', 'offline')]"] == 3 and got["q[]"] == 30
    assert got["lat_count[]"] == 2 and got["lat_sum[]"] == 3 and got["lat_bucket[('le', '1.0')]"] == 1
    assert merge_metrics([]) == b""
