"""Serving tests with real clients against a real `flashasr serve` (single-process mode, CPU, tiny.en).

Clients: the official ``openai`` package (every response format, stream=True), a ``websockets``
client speaking the Realtime transcription protocol and the binary mode, raw sockets for
broken clients, and 2,000 concurrent WebSockets against the one front-end process.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import resource
import socket
import struct
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from websockets.asyncio.client import connect

import flashasr.serve.web

from conftest import AUDIO
from test_serve_util import CLIP, CLIP_WORDS, Server, pcm16, silence, wav_bytes, words

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--max-upload-mb", "2", "--max-audio-s", "30",
               "--body-timeout-s", "2", "--partial-interval-ms", "500", "--ws-idle-timeout-s", "120")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline_text(client) -> str:
    """The offline transcript of CLIP (json response format)."""
    with open(CLIP, "rb") as f:
        return client.audio.transcriptions.create(model="whisper-1", file=f).text


def _create(client, data: bytes, name: str = "clip.wav", **kw):
    return client.audio.transcriptions.create(model="whisper-1", file=(name, data), **kw)


# ----------------------------------------------------------------------------- HTTP
def test_openai_every_response_format(client, offline_text):
    assert words(offline_text) == CLIP_WORDS
    data = CLIP.read_bytes()
    text = _create(client, data, response_format="text")
    assert isinstance(text, str) and text.strip() == offline_text
    srt = _create(client, data, response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and words(srt.split("\n", 2)[2]) == CLIP_WORDS
    vtt = _create(client, data, response_format="vtt")
    assert vtt.startswith("WEBVTT") and "-->" in vtt and words(vtt.split("\n", 3)[3]) == CLIP_WORDS
    v = _create(client, data, response_format="verbose_json", timestamp_granularities=["word", "segment"])
    assert v.text == offline_text and v.language == "english" and abs(v.duration - 2.97) < 0.01  # OpenAI names it
    assert v.segments and v.segments[0].start >= 0 and v.segments[-1].end <= v.duration + 1e-6
    assert [words(w.word)[0] for w in v.words] == CLIP_WORDS
    assert all(0 <= w.start <= w.end <= v.duration + 1e-6 for w in v.words)
    v2 = _create(client, data, response_format="verbose_json")  # no word granularity: no words
    assert v2.text == offline_text and not getattr(v2, "words", None)
    # the prompt conditions Whisper (title case from "Golden."); the words stay the same
    steered = _create(client, data, prompt="Golden.", temperature=0.0, language="en").text
    assert steered != offline_text and words(steered) == CLIP_WORDS


def test_openai_stream_sse(client, offline_text):
    deltas, done = [], None
    stream = _create(client, CLIP.read_bytes(), stream=True)
    for ev in stream:
        if ev.type == "transcript.text.delta":
            deltas.append(ev.delta)
        elif ev.type == "transcript.text.done":
            done = ev.text
    assert deltas and done == offline_text
    assert "".join(deltas).strip() == offline_text
    assert "".join(deltas) == done  # exactly: no leading space, nothing missing


def test_models_health_ready_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["whisper-tiny.en"]
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    r = httpx.get(server.base + "/ready").json()
    assert r["status"] == "ready" and r["mode"] == "single"
    m = httpx.get(server.base + "/metrics").text
    for name in ("flashasr_requests_total{", "flashasr_audio_seconds_total", "flashasr_engine_batch_size_bucket",
                 "flashasr_engine_queue_depth", "flashasr_stage_seconds_bucket", "flashasr_active_streams"):
        assert name in m, name
    assert server.metric("flashasr_audio_seconds_total") > 0


def test_status_json_and_server_timing(server):
    """GET /status (open, like /metrics): model, limits, recent latency percentiles, audio done; an
    upload's reply names its stages' times in Server-Timing (the web page's speed factor)."""
    r = httpx.post(server.base + "/v1/audio/transcriptions", headers={"Authorization": f"Bearer {KEY}"},
                   files={"file": ("a.wav", CLIP.read_bytes())}, data={"response_format": "verbose_json"}, timeout=60)
    assert r.status_code == 200
    timing = {name.strip(): float(dur.split("=")[1]) for name, dur in
              (part.split(";") for part in r.headers["server-timing"].split(","))}
    assert set(timing) == {"upload", "decode", "plan", "transcribe", "total"}
    assert timing["total"] == pytest.approx(timing["decode"] + timing["plan"] + timing["transcribe"], abs=0.2)
    assert min(timing.values()) >= 0 and timing["transcribe"] > 0
    s = httpx.get(server.base + "/status").json()
    assert s["status"] == "ready" and s["mode"] == "single" and s["model"]["name"] == "whisper-tiny.en"
    assert s["model"]["languages"] == ["en"] and s["model"]["device"] == "cpu" and s["gpu_memory_bytes"] is None
    assert s["limits"] == {"max_upload_mb": 2.0, "max_audio_s": 30.0, "api_key_required": True}
    req = s["latency_ms"]["request"]
    assert req["n"] >= 1 and 0 < req["p50_ms"] <= req["p95_ms"]
    assert s["audio_seconds"]["offline"] >= 2.9
    assert s["uploads_in_flight"] == 0 and s["engine"]["requests_active"] == 0


def test_status_counts_streams_and_uploads_in_flight(server):
    def status() -> dict:
        return httpx.get(server.base + "/status").json()

    before = status()
    part = b"--b0und\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.wav\"\r\n\r\n"
    slow = _raw(server, _head(len(part) + 100_000) + part + b"\0" * 1000)  # its body is still arriving
    try:
        t_end = time.monotonic() + 1.5  # (--body-timeout-s 2 ends it after 2 s)
        while status()["uploads_in_flight"] != before["uploads_in_flight"] + 1:
            assert time.monotonic() < t_end
            time.sleep(0.05)
    finally:
        slow.close()

    async def go():
        async with connect(_ws_url(server, "/v1/realtime"), additional_headers={"Authorization": f"Bearer {KEY}"}):
            await asyncio.sleep(0.2)
            return status()["streams_live"]

    assert asyncio.run(go()) == before["streams_live"] + 1
    t_end = time.monotonic() + 5
    while status()["streams_live"] != before["streams_live"]:
        assert time.monotonic() < t_end
        time.sleep(0.05)


def test_web_page_and_its_files(server):
    """GET / is the page (no key needed: it asks for one); its files under /ui/ only by name."""
    r = httpx.get(server.base + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["cache-control"] == "no-cache" and httpx.head(server.base + "/").status_code == 200
    static = Path(flashasr.serve.web.STATIC)
    refs = set(re.findall(r'(?:src|href)="(/ui/[^"]+)"', r.text))
    for p in static.glob("*.js"):
        text = p.read_text(encoding="utf-8")
        refs |= {"/ui/" + m for m in re.findall(r'from "\./([\w.-]+)"', text)}
        refs |= set(re.findall(r'"(/ui/[\w.-]+)"', text))
    assert {"/ui/app.js", "/ui/app.css", "/ui/pcm-worklet.js", "/ui/live.js"} <= refs
    for ref in sorted(refs):
        got = httpx.get(server.base + ref)
        assert got.status_code == 200, ref
        if ref.endswith(".js"):
            assert got.headers["content-type"].startswith("text/javascript"), ref
    for bad in ("/ui/nope.js", "/ui/..%2Fweb.py", "/ui/%2e%2e%2fapp.py"):
        got = httpx.get(server.base + bad)
        assert got.status_code == 404 and got.json()["error"]["code"] == "not_found", bad
    # works offline: nothing from another host (CDN, fonts, scripts)
    external = re.compile(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//|from\s+["']https?:""")
    for p in static.iterdir():
        assert not external.search(p.read_text(encoding="utf-8")), p.name


def test_latency_window_percentiles():
    from flashasr.serve.metrics import LatencyWindow

    w = LatencyWindow(size=100)
    assert w.summary() == {"n": 0, "p50_ms": None, "p95_ms": None, "last_ms": None}
    for v in range(1, 201):  # only the last 100 (0.101 .. 0.200 s) stay
        w.add(v / 1000)
    assert w.summary() == {"n": 100, "p50_ms": 150.0, "p95_ms": 195.0, "last_ms": 200.0}


def test_auth(server):
    r = httpx.post(server.base + "/v1/audio/transcriptions", files={"file": ("a.wav", CLIP.read_bytes())})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _no_audio_stream_file() -> bytes:
    import av

    buf = io.BytesIO()
    c = av.open(buf, "w", format="matroska")
    s = c.add_stream("mpeg4", rate=5)
    s.width = s.height = 16
    s.pix_fmt = "yuv420p"
    for _ in range(3):
        for p in s.encode(av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    return buf.getvalue()


def _rate_wav(rate: int, n: int = 8000) -> bytes:
    """A 16-bit mono WAV of ``n`` samples whose header claims ``rate`` Hz."""
    data = np.zeros(n, "<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, (rate * 2) & 0xFFFFFFFF, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_error_codes(client):
    cases = [
        (b"this is not audio at all, just text\n" * 10, {}, 400, "unsupported_format"),
        (b"", {}, 400, "empty_audio"),
        (_no_audio_stream_file(), {}, 400, "no_audio_stream"),
        (_rate_wav(2**31 - 1), {}, 400, "unsupported_sample_rate"),  # was 200 with an empty text
        (_rate_wav(0), {}, 400, "unsupported_sample_rate"),  # 0 and 2^32-1 Hz were FFmpeg's unsupported_format
        (_rate_wav(2**32 - 1), {}, 400, "unsupported_sample_rate"),
        (_rate_wav(0, n=131_072), {}, 400, "unsupported_sample_rate"),  # >= 256 KiB: the parallel decode's path
        ((AUDIO / "long" / "long-silero-test-60s.wav").read_bytes(), {}, 400, "audio_too_long"),
        (CLIP.read_bytes(), {"response_format": "docx"}, 400, "unsupported_response_format"),
        (CLIP.read_bytes(), {"language": "english!"}, 400, "invalid_request"),
        (CLIP.read_bytes(), {"temperature": 7}, 400, "invalid_request"),
        (CLIP.read_bytes(), {"language": "de"}, 400, "unsupported_language"),  # tiny.en is English-only
    ]
    for data, kw, status, code in cases:
        with pytest.raises(openai.APIStatusError) as ei:
            _create(client, data, **kw)
        e = ei.value
        assert e.status_code == status and e.body["code"] == code, (code, e.body)
        assert set(e.response.json()["error"]) == {"message", "type", "param", "code"}
        assert e.body["type"] == "invalid_request_error" and e.body["message"]


def test_language_jv_and_whisper_aliases_pass_the_language_rule(client):
    """ISO ``jv`` and Whisper's alias names are language codes at the HTTP door too: on the
    English-only model they are 400 ``unsupported_language`` (the model cannot take them), not
    ``invalid_request`` (not a language); Whisper's ``jw`` and ``en`` spelled as a region still work."""
    stella = (AUDIO / "en" / "en-vctk-p225-001.wav").read_bytes()
    for lang in ("jv", "jw", "castilian", "mandarin", "burmese", "flemish", "haitian", "panjabi"):
        with pytest.raises(openai.APIStatusError) as ei:
            _create(client, stella, name="s.wav", language=lang)
        assert ei.value.status_code == 400 and ei.value.body["code"] == "unsupported_language", (lang, ei.value.body)
        assert ei.value.body["param"] == "language"
    assert _create(client, stella, name="s.wav", language="en-GB").text == "Please call Stella."


def test_models_retrieve_by_id_and_unknown_id_404(server, client):
    """``models.retrieve`` answers the list's entry; another id is OpenAI's 404 ``model_not_found``."""
    listed = client.models.list().data[0]
    got = client.models.retrieve("whisper-tiny.en")
    assert got.id == "whisper-tiny.en" and got.model_dump() == listed.model_dump()
    assert got.flashasr["family"] == "whisper"
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("whisper-large-v9")
    e = ei.value
    assert e.status_code == 404 and e.body["code"] == "model_not_found" and e.body["param"] == "model"
    assert set(e.response.json()["error"]) == {"message", "type", "param", "code"}
    assert e.body["type"] == "invalid_request_error" and "whisper-large-v9" in e.body["message"]
    r = httpx.get(server.base + "/v1/models/whisper-tiny.en")  # the key is still required
    assert r.status_code == 401
    assert client.models.retrieve("tiny.en").id == "whisper-tiny.en"  # the name the server announced
    alias = client.models.retrieve("whisper-1")  # the README's client example names it
    assert alias.id == "whisper-1" and alias.served_by == "whisper-tiny.en" and alias.flashasr == got.flashasr


def test_prompt_temperature_and_granularities_as_openai(server, client):
    """prompt and temperature reach Whisper (a spelling the prompt shows is followed; the temperature
    (or a fallback above it) is recorded in the segments); timestamp_granularities with a format that cannot carry them is a
    400, as OpenAI answers; /v1/models says which request options the model uses."""
    stella = (AUDIO / "en" / "en-vctk-p225-001.wav").read_bytes()
    assert _create(client, stella, name="s.wav").text == "Please call Stella."
    assert _create(client, stella, name="s.wav", prompt="STELLA").text == "Please call STELLA."
    v = _create(client, stella, name="s.wav", response_format="verbose_json", temperature=0.6)
    # sampling starts at 0.6 and, as the reference does, falls back up the 0.2 schedule when a
    # window fails its log-probability or compression check
    assert v.segments and {s.temperature for s in v.segments} <= {0.6, 0.8, 1.0}
    for fmt in ("json", "text", "srt"):
        with pytest.raises(openai.APIStatusError) as ei:
            _create(client, stella, name="s.wav", response_format=fmt, timestamp_granularities=["word"])
        assert ei.value.status_code == 400 and ei.value.body["param"] == "timestamp_granularities[]"
    with pytest.raises(openai.APIStatusError) as ei:
        _create(client, stella, name="s.wav", temperature=1.5)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "temperature"
    m = httpx.get(server.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
    assert m["flashasr"]["prompt"] is True and m["flashasr"]["temperature"] is True
    assert m["flashasr"]["languages"] == ["en"] and m["flashasr"]["family"] == "whisper"


def test_upload_too_large_413(server, client):
    big = CLIP.read_bytes() * 40  # ~3.8 MB > --max-upload-mb 2
    with pytest.raises(openai.APIStatusError) as ei:
        _create(client, big)
    assert ei.value.status_code == 413 and ei.value.body["code"] == "file_too_large"

    # chunked body without Content-Length: rejected while streaming, the server stays healthy
    def gen():
        for _ in range(64):
            yield b"\0" * (64 << 10)

    r = httpx.post(server.base + "/v1/audio/transcriptions", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data; boundary=xyz"},
        content=(b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n" + c
                 for c in gen()), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"


def _raw(server, payload: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(payload)
    return s


def _head(length: int, boundary: str = "b0und") -> bytes:
    return (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {length}\r\n\r\n").encode()


def test_broken_clients_do_not_hurt_others(server, client, offline_text):
    part = b"--b0und\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.wav\"\r\n\r\n"
    data = CLIP.read_bytes()
    # 1) disconnect mid-upload
    s1 = _raw(server, _head(len(part) + len(data) + 100) + part + data[:20000])
    s1.close()
    # 2) disconnect after the upload, while the model works on it
    body = part + data + b"\r\n--b0und--\r\n"
    s2 = _raw(server, _head(len(body)) + body)
    time.sleep(0.2)
    s2.close()
    # 3) slow client: body stalls longer than --body-timeout-s 2 -> 408
    s3 = _raw(server, _head(len(part) + len(data) + 100) + part + data[:1000])
    s3.settimeout(10)
    reply = b""
    while b'"timeout"' not in reply:
        chunk = s3.recv(4096)
        if not chunk:
            break
        reply += chunk
    s3.close()
    assert reply.startswith(b"HTTP/1.1 408") and b'"timeout"' in reply
    # 4) malformed multipart
    bad = b"--b0und\r\nthis is not a header line\r\n\r\nxx--b0und--"
    r = httpx.post(server.base + "/v1/audio/transcriptions", content=bad, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "multipart/form-data; boundary=b0und"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(server.base + "/v1/audio/transcriptions", files={"model": (None, "x")},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    # everyone else is still served, correctly
    assert _create(client, data).text == offline_text
    assert httpx.get(server.base + "/health").status_code == 200


# ------------------------------------------------------------------------ WebSocket
def _ws_url(server, path: str) -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def _events_until(ws, want: str, timeout: float = 60.0) -> list[dict]:
    out = []
    t_end = time.monotonic() + timeout
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), max(0.1, t_end - time.monotonic())))
        out.append(ev)
        if ev["type"] == want:
            return out


def _append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


def test_realtime_final_equals_offline(server, client):
    """Manual commit, 20 ms packets at real-time pace: partial deltas, then a final equal to the
    offline transcript of exactly the audio sent."""
    pcm = pcm16()

    async def go():
        async with connect(_ws_url(server, "/v1/realtime"), additional_headers={"Authorization": f"Bearer {KEY}"},
                           subprotocols=["realtime"]) as ws:
            first = json.loads(await ws.recv())
            assert first["type"] == "transcription_session.created"
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {
                "input_audio_format": "pcm16", "input_audio_sample_rate": 16000, "turn_detection": None,
                "input_audio_transcription": {"model": "whisper-1", "language": "en"}}}))
            upd = json.loads(await ws.recv())
            assert upd["type"] == "transcription_session.updated" and upd["session"]["turn_detection"] is None
            sent, evs = bytearray(), []
            t0 = time.monotonic()
            i = 0
            # the whole clip, then silence until the first partial delta arrives (each partial re-runs
            # the utterance so far; two agreeing hypotheses release words), at most 60 s. On a fast
            # machine a partial can arrive before the clip ends: keep sending the clip regardless.
            while i * 640 < len(pcm) or not any(e["type"].endswith("transcription.delta") for e in evs):
                assert time.monotonic() - t0 < 60, evs
                chunk = pcm[i * 640:(i + 1) * 640] or silence(0.02)  # 20 ms = 640 bytes
                await ws.send(_append(chunk))
                sent += chunk
                i += 1
                await asyncio.sleep(max(0.0, t0 + i * 0.02 - time.monotonic()))
                while True:
                    try:
                        evs.append(json.loads(await asyncio.wait_for(ws.recv(), 0.001)))
                    except asyncio.TimeoutError:
                        break
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            evs += await _events_until(ws, "conversation.item.input_audio_transcription.completed")
            return evs, bytes(sent)

    evs, sent = asyncio.run(go())
    committed = [e for e in evs if e["type"] == "input_audio_buffer.committed"]
    final = evs[-1]
    assert len(committed) == 1 and final["item_id"] == committed[0]["item_id"]
    assert committed[0]["audio_start_ms"] == 0 and committed[0]["audio_end_ms"] == len(sent) // 32
    assert final["transcript"] == _create(client, wav_bytes(sent)).text
    assert words(final["transcript"]) == CLIP_WORDS
    types = [e["type"] for e in evs]
    assert types.index("conversation.item.input_audio_transcription.delta") < types.index(
        "input_audio_buffer.committed")  # a partial came before the commit
    deltas = [e["delta"] for e in evs if e["type"].endswith("transcription.delta")]
    assert words("".join(deltas)) == CLIP_WORDS  # local agreement: deltas concatenate to the transcript
    assert all(e.get("event_id") for e in evs)


def test_openai_realtime_client(client, offline_text):
    """The official openai package's Realtime client (GA event shapes) against /v1/realtime."""
    pcm = pcm16()
    with client.realtime.connect(model="whisper-1", extra_query={"intent": "transcription"}) as conn:
        assert conn.recv().type == "transcription_session.created"
        conn.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None}}})
        assert conn.recv().type == "session.updated"
        for off in range(0, len(pcm), 640):
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[off:off + 640]).decode())
        conn.input_audio_buffer.commit()
        for ev in conn:
            assert ev.type != "error", ev
            if ev.type == "conversation.item.input_audio_transcription.completed":
                break
    assert ev.transcript == offline_text


def test_realtime_server_vad(server, client):
    """Server VAD: speech_started / speech_stopped / committed / completed; each final equals the
    offline transcript of exactly the committed audio."""
    stream = silence(0.6) + pcm16() + silence(1.2)

    async def go():
        async with connect(_ws_url(server, "/v1/realtime?sample_rate=16000"),
                           additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 16000},
                          "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}}}))
            assert json.loads(await ws.recv())["type"] == "session.updated"
            for off in range(0, len(stream), 640):
                await ws.send(_append(stream[off:off + 640]))
            return await _events_until(ws, "conversation.item.input_audio_transcription.completed")

    evs = asyncio.run(go())
    types = [e["type"] for e in evs]
    assert types.index("input_audio_buffer.speech_started") < types.index("input_audio_buffer.speech_stopped") \
        < types.index("input_audio_buffer.committed") < types.index(
        "conversation.item.input_audio_transcription.completed")
    started = next(e for e in evs if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in evs if e["type"] == "input_audio_buffer.speech_stopped")
    com = next(e for e in evs if e["type"] == "input_audio_buffer.committed")
    assert 150 <= started["audio_start_ms"] <= 700 and 3000 <= stopped["audio_end_ms"] <= 3800
    assert com["audio_start_ms"] == started["audio_start_ms"] and com["audio_end_ms"] >= stopped["audio_end_ms"]
    a, b = com["audio_start_ms"] * 32, com["audio_end_ms"] * 32  # ms -> byte offsets of 16 kHz PCM16
    offline = _create(client, wav_bytes(stream[a:b])).text
    assert evs[-1]["transcript"] == offline and words(offline) == CLIP_WORDS


def test_realtime_resamples_24k(server):
    import soxr

    x = np.frombuffer(pcm16(), "<i2").astype(np.float32) / 32768
    y = np.clip(soxr.resample(x, 16000, 24000) * 32768, -32768, 32767).astype("<i2").tobytes()

    async def go():
        async with connect(_ws_url(server, "/v1/realtime"), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            s = json.loads(await ws.recv())["session"]
            assert s["input_audio_sample_rate"] == 24000  # OpenAI's pcm16 default
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {"turn_detection": None}}))
            await ws.recv()
            for off in range(0, len(y), 960):  # 20 ms at 24 kHz
                await ws.send(_append(y[off:off + 960]))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            return await _events_until(ws, "conversation.item.input_audio_transcription.completed")

    evs = asyncio.run(go())
    com = next(e for e in evs if e["type"] == "input_audio_buffer.committed")
    assert abs(com["audio_end_ms"] - 2970) <= 2  # all audio arrived (resampler flushed on commit)
    assert words(evs[-1]["transcript"]) == CLIP_WORDS


def test_binary_stream_final_equals_offline(server, offline_text):
    pcm = pcm16()

    async def go():
        async with connect(_ws_url(server, "/v1/stream?sample_rate=16000&partial_interval_ms=0"),
                           additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            off = 0
            for n in [641, 639, 1, 999] * 10000:  # odd sizes: samples split across frames
                if off >= len(pcm):
                    break
                await ws.send(pcm[off:off + n])
                off += n
            await ws.send(json.dumps({"type": "commit"}))
            evs = await _events_until(ws, "conversation.item.input_audio_transcription.completed")
            await ws.send(json.dumps({"type": "close"}))
            await asyncio.wait_for(ws.wait_closed(), 10)
            return evs

    evs = asyncio.run(go())
    assert evs[-1]["transcript"] == offline_text


def test_stream_utterance_cap_bounds_memory(server):
    """Without VAD a never-committed stream is cut at --max-utterance-s (30 s): committed + final, and
    the buffer starts again (the cost of a stream is bounded however long it lives)."""
    audio = silence(30.5)

    async def go():
        async with connect(_ws_url(server, "/v1/stream?sample_rate=16000&partial_interval_ms=0"),
                           additional_headers={"Authorization": f"Bearer {KEY}"}, max_size=None) as ws:
            await ws.recv()
            for off in range(0, len(audio), 32000):  # 1 s frames, as fast as possible
                await ws.send(audio[off:off + 32000])
            first = await _events_until(ws, "input_audio_buffer.committed")
            await ws.send(json.dumps({"type": "commit"}))
            rest = await _events_until(ws, "input_audio_buffer.committed")
            return first + rest

    evs = asyncio.run(go())
    com = [(e["audio_start_ms"], e["audio_end_ms"]) for e in evs if e["type"] == "input_audio_buffer.committed"]
    assert com == [(0, 30000), (30000, 30500)]


def test_stream_errors_keep_the_session(server):
    async def go():
        h = {"Authorization": f"Bearer {KEY}"}
        async with connect(_ws_url(server, "/v1/realtime"), additional_headers=h) as ws:
            await ws.recv()
            codes = []
            for msg in ["{not json", json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}),
                        json.dumps({"type": "bogus.event"}), json.dumps([1, 2]),
                        json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": "abc"}}),
                        json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": 1000}}),
                        json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}),
                        json.dumps({"type": "session.update", "session": {"turn_detection": {"threshold": 3}}}),
                        json.dumps({"type": "input_audio_buffer.commit"})]:
                await ws.send(msg)
                ev = json.loads(await ws.recv())
                assert ev["type"] == "error", ev
                codes.append(ev["error"]["code"])
            await ws.send(b"\x00\x01")  # binary frame on the JSON protocol
            codes.append(json.loads(await ws.recv())["error"]["code"])
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            assert json.loads(await ws.recv())["type"] == "input_audio_buffer.cleared"  # still alive
        # wrong declared sample rate on the binary endpoint: error event, then close 1008
        async with connect(_ws_url(server, "/v1/stream?sample_rate=44k"), additional_headers=h) as ws:
            ev = json.loads(await ws.recv())
            assert ev["error"]["code"] == "invalid_sample_rate"
            await asyncio.wait_for(ws.wait_closed(), 5)
            assert ws.close_code == 1008
        # no key: an error event naming it, then close 1008 with the reason
        async with connect(_ws_url(server, "/v1/stream")) as ws:
            ev = json.loads(await ws.recv())
            assert ev["error"]["code"] == "invalid_api_key"
            await asyncio.wait_for(ws.wait_closed(), 5)
            assert (ws.close_code, ws.close_reason) == (1008, "invalid API key")
        # client leaves while its final is being computed
        async with connect(_ws_url(server, "/v1/stream?sample_rate=16000"), additional_headers=h) as ws:
            await ws.recv()
            await ws.send(pcm16())
            await ws.send(json.dumps({"type": "commit"}))
        return codes

    codes = asyncio.run(go())
    assert codes == ["invalid_json", "invalid_request", "unknown_event", "invalid_request", "invalid_sample_rate",
                     "invalid_sample_rate", "unsupported_format", "invalid_request", "input_audio_buffer_commit_empty",
                     "invalid_request"]
    assert httpx.get(server.base + "/health").status_code == 200


def test_a_json_message_that_is_not_an_object_with_a_string_type_is_named_as_such(server):
    """A text message that is valid JSON but not an object with a string ``type`` (an array, a
    string, a number, null, an object without ``type``, a ``type`` that is not a string) gets an
    error event saying what every message must be and what it got, on both WebSocket protocols (the
    binary stream said "unknown control message None"); an unknown ``type`` is ``unknown_event``
    naming it; the session lives on."""
    not_objects = [([1], "a JSON array"), ("commit", "a JSON string"), (5, "a JSON number"), (None, "a JSON null"),
                   ({}, "an object without 'type'"), ({"type": 5}, "'type' 5"), ({"type": None}, "'type' null"),
                   ({"type": ["commit"]}, "'type' [\"commit\"]")]

    async def errors(path: str, unknown: str) -> list[dict]:
        async with connect(_ws_url(server, path), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            await ws.recv()  # session created
            out = []
            for msg in [m for m, _ in not_objects] + [{"type": unknown}]:
                await ws.send(json.dumps(msg))
                ev = json.loads(await ws.recv())
                assert ev["type"] == "error", ev
                out.append(ev["error"])
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            assert json.loads(await ws.recv())["type"] == "input_audio_buffer.cleared"  # still alive
            return out

    for path, what, unknown in (("/v1/stream", "control message", "bogus"),
                                ("/v1/realtime", "event", "bogus.event")):
        errs = asyncio.run(errors(path, unknown))
        for (msg, got), e in zip(not_objects, errs):
            assert (e["code"], e["param"]) == ("invalid_request", "type"), (msg, e)
            assert e["message"].startswith(f"every {what} must be a JSON object with a string 'type'"), (msg, e)
            assert e["message"].endswith(f"; got {got}"), (msg, e)
        assert (errs[-1]["code"], errs[-1]["param"]) == ("unknown_event", "type") and repr(unknown) in errs[-1]["message"]


def test_malformed_session_updates_and_stream_queries_keep_the_server_whole(server):
    """Values a careless or hostile client sends in a session update (infinite or huge numbers, a
    string where an object goes, NaN) each get an error event naming the field, and the session
    keeps working; a stream query with a non-finite or negative partial interval, or a ``partials`` or
    ``vad`` value it does not know, is refused at open (error event, close 1008) without leaving a
    stream counted as open."""
    bad = [{"partial_interval_ms": 1e308 * 10}, {"partial_interval_ms": "inf"}, {"partial_interval_ms": -5},
           {"turn_detection": {"type": "server_vad", "prefix_padding_ms": 1e400}},
           {"turn_detection": {"type": "server_vad", "threshold": "nan"}},
           {"input_audio_sample_rate": 1e400}, {"input_audio_transcription": "de"},
           {"audio": {"input": "x"}}, {"audio": {"input": {"transcription": "x"}}}, {"audio": 7}]

    async def go():
        h = {"Authorization": f"Bearer {KEY}"}
        async with connect(_ws_url(server, "/v1/realtime"), additional_headers=h) as ws:
            await ws.recv()
            errors = []
            for sess in bad:
                # json.dumps writes 1e400 as Infinity, which JSON parsers accept: the server must not overflow on it
                await ws.send(json.dumps({"type": "transcription_session.update", "session": sess}))
                ev = json.loads(await ws.recv())
                assert ev["type"] == "error", (sess, ev)
                errors.append(ev["error"])
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {"partial_interval_ms": 250}}))
            ok = json.loads(await ws.recv())
        for param, q in (("partial_interval_ms", "nan"), ("partial_interval_ms", "inf"), ("partial_interval_ms", "-5"),
                         ("partials", "bogus"), ("vad", "maybe")):
            async with connect(_ws_url(server, f"/v1/stream?{param}={q}"), additional_headers=h) as ws:
                ev = json.loads(await ws.recv())
                assert ev["type"] == "error" and ev["error"]["param"] == param, ev
                await asyncio.wait_for(ws.wait_closed(), 5)
                assert ws.close_code == 1008
        return errors, ok

    errors, ok = asyncio.run(go())
    assert all(e["code"] in ("invalid_request", "invalid_sample_rate") and e["param"] for e in errors), errors
    assert ok["type"] == "transcription_session.updated" and ok["session"]["partial_interval_ms"] == 250
    assert "ignored" not in ok["session"]["input_audio_transcription"]  # Whisper uses a prompt
    time.sleep(0.5)
    assert server.metric("flashasr_active_streams") == 0


def test_2000_websockets_constant_threads(server):
    """2,000 concurrent idle or trickling WebSockets on one front-end process: no thread per connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4500:
        pytest.skip(f"needs >= 4500 file descriptors (hard limit {hard})")
    if soft < 4500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    n = 2000
    h = {"Authorization": f"Bearer {KEY}"}
    before = server.threads()
    tick = silence(0.02)

    async def go():
        sem = asyncio.Semaphore(100)
        conns = []

        async def open_one(i):
            path = "/v1/realtime" if i % 2 else "/v1/stream?sample_rate=16000&partial_interval_ms=0"
            async with sem:
                ws = await connect(_ws_url(server, path), additional_headers=h, open_timeout=60,
                                   ping_interval=None)
                ev = json.loads(await ws.recv())
                assert ev["type"].endswith("session.created")
                conns.append((i, ws))

        await asyncio.gather(*(open_one(i) for i in range(n)))
        during = [server.threads()]
        for _ in range(3):  # the binary half trickles 20 ms of audio, the realtime half idles
            await asyncio.gather(*(ws.send(tick) for i, ws in conns if i % 2 == 0))
            await asyncio.sleep(0.3)
            during.append(server.threads())
        streams = server.metric("flashasr_active_streams")
        await asyncio.gather(*(ws.close() for _, ws in conns))
        return len(conns), during, streams

    opened, during, streams = asyncio.run(go())
    assert opened == n and streams == n
    assert max(during) == before, (before, during)
    assert httpx.get(server.base + "/health").status_code == 200


def test_translations_endpoint_refuses_an_english_only_model(client):
    """/v1/audio/translations exists (OpenAI audio.translations.create); tiny.en cannot translate:
    400 unsupported_task, named, before any decoding."""
    with pytest.raises(openai.APIStatusError) as ei:
        client.audio.translations.create(model="whisper-1", file=("clip.wav", CLIP.read_bytes()))
    e = ei.value
    assert e.status_code == 400 and e.body["code"] == "unsupported_task", e.body
    assert "cannot translate" in e.body["message"]


def test_translation_results_say_task_translate():
    """verbose_json of a translation says task "translate" (the Transcript carries its task)."""
    from flashasr.formats import render
    from flashasr.types import Transcript

    t = Transcript(text="Hello.", language="en", duration=1.0, task="translate")
    assert json.loads(render(t, "verbose_json"))["task"] == "translate"
    assert json.loads(render(Transcript(text="x", language="en", duration=1.0), "verbose_json"))["task"] == "transcribe"


def test_a_boolean_field_that_is_neither_true_nor_false_is_a_400(server):
    """Found by a new user: `stream=maybe` was read as false; now 400 naming the field (as `vad` on
    /v1/stream)."""
    import httpx

    r = httpx.post(server.base + "/v1/audio/transcriptions", files={"file": ("c.wav", CLIP.read_bytes())},
                   data={"model": "m", "stream": "maybe"}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    r = httpx.post(server.base + "/v1/audio/transcriptions", files={"file": ("c.wav", CLIP.read_bytes())},
                   data={"model": "m", "stream": "False"}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["text"]
