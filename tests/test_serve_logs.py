"""What `flashasr serve` tells its operator and its clients about rough requests, through real
clients against real servers (single mode, and multi mode with two front ends on a port the
server picked): a client leaving mid-upload is one INFO line (no traceback) and the server stays
healthy; one access-log line per HTTP request, on by default and off with ``--no-access-log``; a
WebSocket with a bad API key is closed 1008 with a reason a client can read, a WebSocket to a
wrong path gets HTTP 404; ``--help`` states every option's default and bad values exit 2 naming
the option.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from test_serve_util import CLIP, CLIP_WORDS, Server, words

KEY = "log-key"
GONE = re.compile(r"INFO:flashasr\.serve:client 127\.0\.0\.1:(\d+) disconnected during upload \((\d+) bytes received\)")


@pytest.fixture(scope="module", params=["single", "multi"])
def server(request, tmp_path_factory):
    """Single mode, or multi mode with two front ends sharing a port the server picked (--port 0)."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "single":
        s = Server(tmp, "--api-key", KEY, "--no-warmup")
    else:
        s = Server(tmp, "--api-key", KEY, "--no-warmup", "--mode", "multi", "--workers", "2", port=0)
    yield s
    s.stop()


def _log_since(server: Server, offset: int) -> str:
    return server.log_path.read_bytes()[offset:].decode(errors="replace")


def _wait_for(server: Server, offset: int, pattern: re.Pattern | str, timeout: float = 30.0) -> str:
    """The log written since ``offset`` once it holds ``pattern``."""
    t_end = time.monotonic() + timeout
    while True:
        text = _log_since(server, offset)
        if re.search(pattern, text):
            return text
        assert time.monotonic() < t_end, f"no {pattern!r} in the server log:\n{text}"
        time.sleep(0.1)


def _raw_get(server: Server, target: str) -> tuple[int, bytes]:
    """``GET target`` over a raw socket: (the client's local port, the reply)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        return s.getsockname()[1], reply


def _transcribe(server: Server) -> str:
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    return client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", CLIP.read_bytes())).text


# ------------------------------------------------------------------ 1. client gone mid-upload
def test_client_leaving_mid_upload_is_one_info_line(server):
    offset = server.log_path.stat().st_size
    part = b'--b0und\r\nContent-Disposition: form-data; name="file"; filename="x.wav"\r\n\r\n'
    data = CLIP.read_bytes()
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: multipart/form-data; boundary=b0und\r\nContent-Length: {len(part) + len(data) + 100}"
            "\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(head + part + data[:20000])
    port = s.getsockname()[1]
    time.sleep(0.3)  # the body is being read
    s.close()
    text = _wait_for(server, offset, rf'127\.0\.0\.1:{port} "POST /v1/audio/transcriptions" 499 ')
    gone = [m for m in GONE.finditer(text) if int(m.group(1)) == port]
    assert len(gone) == 1 and 0 < int(gone[0].group(2)) <= len(part) + 20000, text
    assert words(_transcribe(server)) == CLIP_WORDS  # the server stays healthy
    assert httpx.get(server.base + "/health").status_code == 200
    text = _log_since(server, offset)
    assert "Traceback" not in text and "ERROR" not in text, text


# ------------------------------------------------------------------------- 2. access log
def test_access_log_one_line_per_http_request(server):
    offset = server.log_path.stat().st_size
    port, reply = _raw_get(server, "/health?api_key=do-not-log-me")
    assert reply.startswith(b"HTTP/1.1 200")
    text = _wait_for(server, offset, rf"127\.0\.0\.1:{port} ")
    line = [ln for ln in text.splitlines() if f"127.0.0.1:{port} " in ln]
    assert len(line) == 1 and re.fullmatch(
        rf'INFO:flashasr\.serve\.access:127\.0\.0\.1:{port} "GET /health" 200 \d+\.\d ms', line[0]), text
    assert "do-not-log-me" not in text  # the path is logged without its query
    port, reply = _raw_get(server, "/v1/nothing-here")
    assert reply.startswith(b"HTTP/1.1 404")
    _wait_for(server, offset, rf'127\.0\.0\.1:{port} "GET /v1/nothing-here" 404 \d+\.\d ms')
    _transcribe(server)
    text = _wait_for(server, offset, r'"POST /v1/audio/transcriptions" 200 (\d+\.\d) ms')
    ms = float(re.search(r'"POST /v1/audio/transcriptions" 200 (\d+\.\d) ms', text).group(1))
    assert ms > 1.0  # the time to the end of the response, with the model call in it


def test_access_log_at_the_default_log_level_and_off_with_no_access_log(tmp_path):
    on = Server(tmp_path, "--no-warmup", "--log-level", "warning")  # the default level: no other INFO line
    off = Server(tmp_path, "--no-warmup", "--log-level", "info", "--no-access-log")
    try:
        for s in (on, off):
            port, reply = _raw_get(s, "/health")
            assert reply.startswith(b"HTTP/1.1 200")
        _wait_for(on, 0, rf'INFO:flashasr\.serve\.access:127\.0\.0\.1:\d+ "GET /health" 200 ')
        time.sleep(0.5)
        assert "flashasr.serve.access" not in _log_since(off, 0)
        assert "GET /health" not in _log_since(off, 0)
    finally:
        on.stop()
        off.stop()


def test_multi_front_ends_share_the_port_the_server_picked(server):
    """--port 0 in multi mode: the second front end listens on the port the first one got."""
    if server.info["mode"] != "multi":
        pytest.skip("multi mode only")
    pids, t_end = set(), time.monotonic() + 90
    while len(pids) < 2 and time.monotonic() < t_end:
        r = httpx.get(server.base + "/ready")  # a new connection each time: SO_REUSEPORT spreads them
        if r.status_code == 200:
            pids.add(r.json()["frontend_pid"])
        time.sleep(0.05)
    assert len(pids) == 2


# ------------------------------------------------------------------------ 3. WebSockets
def _ws(server, path: str) -> str:
    return f"ws://127.0.0.1:{server.port}{path}"


async def _refused(url: str, headers: dict) -> tuple[dict, int, str]:
    """Connect, read the first event, then the close: (event, close code, close reason)."""
    async with connect(url, additional_headers=headers) as ws:
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    return first, closed.value.rcvd.code, closed.value.rcvd.reason


@pytest.mark.parametrize("path", ["/v1/realtime", "/v1/stream?sample_rate=16000"])
def test_websocket_bad_key_is_closed_with_a_reason(server, path):
    offset = server.log_path.stat().st_size
    for headers in ({"Authorization": "Bearer wrong"}, {}):
        first, code, reason = asyncio.run(_refused(_ws(server, path), headers))
        assert first["type"] == "error" and first["error"]["code"] == "invalid_api_key"
        assert (code, reason) == (1008, "invalid API key")

    async def good():  # the right key still opens a session
        async with connect(_ws(server, path), additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 10))["type"]

    assert asyncio.run(good()) in ("transcription_session.created", "session.created")
    assert "ERROR" not in _log_since(server, offset)


def test_a_key_in_the_query_string_stays_out_of_the_log(server):
    """Found by a new user: at --log-level info uvicorn's handshake line carried `?api_key=<the key>`."""
    offset = server.log_path.stat().st_size

    async def go():
        async with connect(_ws(server, f"/v1/realtime?intent=transcription&api_key={KEY}")) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 10))["type"]

    assert asyncio.run(go()) in ("transcription_session.created", "session.created")
    text = _wait_for(server, offset, r"api_key=\*\*\*")
    assert KEY not in text, text


@pytest.mark.parametrize("path", ["/v1/realtime", "/v1/stream?sample_rate=16000"])
def test_a_text_frame_that_is_not_utf8_is_closed_1007_and_logged_in_one_line(server, path):
    """Found by a new user: uvicorn logged an ERROR with a traceback for every such frame (a client
    could flood the log with them). Now one INFO line per connection; the close code is 1007."""
    import base64

    offset = server.log_path.stat().st_size
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 101"), reply
        payload, mask = b"\xff\xfe\xfd", os.urandom(4)
        s.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        data, code = reply.split(b"\r\n\r\n", 1)[1], None
        t_end = time.monotonic() + 10
        while code is None and time.monotonic() < t_end:  # the server's frames (unmasked) until its close
            while len(data) >= 2:
                n, head = data[1] & 0x7F, 2
                if n >= 126:
                    head = 4 if n == 126 else 10
                    n = int.from_bytes(data[2:head], "big") if len(data) >= head else 1 << 62
                if len(data) < head + n:
                    break
                if data[0] & 0x0F == 8:
                    code = int.from_bytes(data[head: head + 2], "big")
                    break
                data = data[head + n:]
            if code is None:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        assert code == 1007, data
    text = _wait_for(server, offset, "not UTF-8")
    assert "Traceback" not in text and "ERROR" not in text, text
    assert text.count("the client sent a text frame that is not UTF-8") == 1, text
    assert httpx.get(server.base + "/health").status_code == 200


def test_openai_realtime_client_reads_the_bad_key(server):
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with bad.realtime.connect(model="whisper-1", extra_query={"intent": "transcription"}) as conn:
        ev = conn.recv()
        assert ev.type == "error" and ev.error.code == "invalid_api_key"


@pytest.mark.parametrize("path", ["/v1/realtimes", "/nope", "/v1/audio/transcriptions"])
def test_websocket_wrong_path_is_404(server, path):
    offset = server.log_path.stat().st_size

    async def go():
        async with connect(_ws(server, path), additional_headers={"Authorization": f"Bearer {KEY}"}):
            pass

    with pytest.raises(InvalidStatus) as e:
        asyncio.run(go())
    assert e.value.response.status_code == 404
    assert json.loads(bytes(e.value.response.body))["error"]["code"] == "not_found"
    time.sleep(0.3)
    assert "ERROR" not in _log_since(server, offset)  # uvicorn's "returned without completing handshake"


# ------------------------------------------------------------------------ 4. the options
def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashasr", "serve", *args], capture_output=True, text=True,
                          timeout=60, env=None if env is None else {**os.environ, **env})


def test_help_states_every_option_and_its_default():
    from flashasr.serve.config import build_parser

    r = _serve("--help")
    assert r.returncode == 0, r.stderr
    shown = " ".join(r.stdout.split())
    parser = build_parser()
    fmt = parser._get_formatter()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 20
    for a in options:
        assert a.help and a.help.strip(), a.option_strings
        text = " ".join(fmt._expand_help(a).split())
        assert "default" in text, (a.option_strings, text)
        assert a.option_strings[0] in shown and text in shown, (a.option_strings, text)
    for default in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 1024.0)", "(default: single)",
                    "(default: warning)", "(default: 500.0)", "(default: 900.0)"):
        assert default in shown, default


@pytest.mark.parametrize("args, option", [
    (["--port", "70000"], "--port"), (["--port", "-1"], "--port"), (["--port", "http"], "--port"),
    (["--max-upload-mb", "0"], "--max-upload-mb"), (["--max-upload-mb", "nan"], "--max-upload-mb"),
    (["--max-audio-s", "-5"], "--max-audio-s"), (["--body-timeout-s", "0"], "--body-timeout-s"),
    (["--ws-idle-timeout-s", "inf"], "--ws-idle-timeout-s"), (["--max-utterance-s", "0"], "--max-utterance-s"),
    (["--partial-interval-ms", "-1"], "--partial-interval-ms"), (["--batch-wait-ms", "-0.5"], "--batch-wait-ms"),
    (["--max-batch", "0"], "--max-batch"), (["--workers", "0"], "--workers"),
    (["--workers", "2"], "--workers"),  # more than one needs --mode multi
    (["--cpu-threads", "0"], "--cpu-threads"), (["--shm-threshold-kb", "-1"], "--shm-threshold-kb"),
    (["--mode", "both"], "--mode"), (["--engine", "fast"], "--engine"), (["--device", "gpu"], "--device"),
    (["--dtype", "int8"], "--dtype"), (["--log-level", "loud"], "--log-level"),
    (["--engine-socket", "/tmp/" + "s" * 200], "--engine-socket"),
    (["--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile"),
    (["--ssl-certfile", __file__], "--ssl-certfile"),  # not a certificate: refused while parsing, not at start-up
    (["--ssl-keyfile", __file__], "--ssl-keyfile"),    # a key without its certificate
])
def test_bad_values_exit_2_naming_the_option(args, option):
    r = _serve(*args)
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    assert f"argument {option}:" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_a_port_in_use_or_a_bad_host_exits_2_naming_the_option(mode):
    """Found by a new user: a busy port or an unresolvable host gave a Python traceback (exit 1)."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    try:
        port = held.getsockname()[1]
        r = _serve("--port", str(port), "--mode", mode)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"argument --port: 127.0.0.1:{port} is already in use" in r.stderr, r.stderr
    finally:
        held.close()
    r = _serve("--host", "999.1.1.1", "--port", "0", "--mode", mode)
    assert r.returncode == 2 and "argument --host:" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_an_unusable_device_stops_before_listening(mode):
    """Found by a new user: `serve --device cuda` without CUDA announced "listening on ..." first (and in
    multi mode the engine process then failed to load)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here")
    r = _serve("--device", "cuda", "--port", "0", "--mode", mode)
    assert r.returncode == 2 and "argument --device:" in r.stderr and "no CUDA" in r.stderr, r.stderr
    assert "listening on" not in r.stderr + r.stdout and "Traceback" not in r.stderr, r.stderr
    r = _serve("--device", "gpu", "--port", "0", "--mode", mode)
    assert r.returncode == 2 and "argument --device: must be cpu, cuda or cuda:N, got 'gpu'" in r.stderr, r.stderr


def test_edge_values_are_accepted():
    from flashasr.serve.config import parse_args

    cfg = parse_args(["--port", "0", "--batch-wait-ms", "0", "--partial-interval-ms", "0", "--shm-threshold-kb", "0",
                      "--max-batch", "1", "--log-level", "DEBUG", "--mode", "multi", "--workers", "3",
                      "--device", "cuda:1", "--no-access-log"])
    assert (cfg.port, cfg.batch_wait_ms, cfg.partial_interval_ms, cfg.shm_threshold_bytes, cfg.max_batch) == \
        (0, 0.0, 0.0, 0, 1)
    assert (cfg.log_level, cfg.workers, cfg.device, cfg.access_log) == ("debug", 3, "cuda:1", False)
    assert parse_args(["--port", "65535"]).access_log is True


def test_multi_mode_stops_once_when_the_model_cannot_load(tmp_path):
    """Found by a new user: `serve --mode multi --model <bad>` printed "engine process N exited (code
    None); restarting" 0-6 times (the supervisor read the exit code before the process was reaped)
    and gave up after 5-33 s. One load error, no restart, exit 2."""
    from conftest import write_nemo_without_model

    bad = write_nemo_without_model(tmp_path / "model.nemo")  # passes the check, fails to load
    for _ in range(2):
        r = _serve("--mode", "multi", "--model", str(bad), "--port", "0", "--no-warmup")
        assert r.returncode == 2, r.stderr
        assert "restarting" not in r.stderr and "code None" not in r.stderr, r.stderr
        assert r.stderr.count("could not load the model") == 1, r.stderr


# names the loader refuses here, and what its message says (the Hugging Face cache is an empty one, offline)
REFUSED = (("large-v3", "is not embedded here"), ("whisper-tiny", "is not embedded here"),
           ("nope.nemo", "no such file"), ("mymodels/typo", "hub ids of Parakeet"),
           ("parakeet-tdt-0.6b-v3", "a Parakeet hub id has its owner: nvidia/parakeet-tdt-0.6b-v3"),
           ("openai/whisper-tiny", "not in the Hugging Face cache"),
           ("nvidia/parakeet-tdt-0.6b-v3", "no .nemo file in the Hugging Face cache"),
           ("damaged.nemo", "is not a .nemo archive"))  # a text file named .nemo (a new user's run)


def _empty_hub(tmp_path) -> dict:
    return {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_a_model_that_is_not_here_stops_before_listening(mode, tmp_path):
    """Found by a new user: `serve --model large-v3` (not embedded) said "listening on ..." and then
    failed to load; a mistyped path too; so did a hub id neither cached nor downloadable
    (`openai/whisper-tiny` without a network). Each stops first, exit 2, naming the option."""
    (tmp_path / "damaged.nemo").write_text("hello")
    for spec, says in REFUSED:
        spec = str(tmp_path / spec) if spec.endswith(".nemo") else spec
        r = _serve("--model", spec, "--port", "0", "--mode", mode, env=_empty_hub(tmp_path))
        assert r.returncode == 2 and "argument --model:" in r.stderr and says in r.stderr, r.stderr
        assert "listening on" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_transcribe_refuses_the_same_names_with_the_same_message(tmp_path, monkeypatch, capsys):
    """One rule (:func:`flashasr.models.registry.locate_model`) for both doors: `flashasr transcribe
    --model X` exits 2 with the message `serve` stops with; the embedded names pass the check and are
    the embedded loader's names."""
    from flashasr.cli import main
    from flashasr.models.catalog import EMBEDDED_SPECS
    from flashasr.models.registry import missing_model
    from flashasr.models.whisper.packages import EMBEDDED_NAMES

    for k, v in _empty_hub(tmp_path).items():
        monkeypatch.setenv(k, v)
    (tmp_path / "damaged.nemo").write_text("hello")
    for spec, says in REFUSED:
        spec = str(tmp_path / spec) if spec.endswith(".nemo") else spec
        why = missing_model(spec)
        assert why and says in why, (spec, why)
        assert main(["transcribe", str(CLIP), "--model", spec]) == 2
        assert why in capsys.readouterr().err, spec
    assert set(EMBEDDED_SPECS) == set(EMBEDDED_NAMES)
    assert [s for s in (None, *EMBEDDED_SPECS, "random:tiny") if missing_model(s)] == []


def test_a_cached_hub_id_passes_the_check_and_loads(tmp_path, monkeypatch):
    """A hub id in the Hugging Face cache (offline) is accepted before listening and loads: the
    cache holds openai/whisper-tiny.en as the embedded tiny.en's files."""
    from flashasr.models.registry import load_model, missing_model
    from flashasr.models.whisper.packages import model_files

    snap = tmp_path / "hub" / "models--openai--whisper-tiny.en" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0123abcd")
    for name, f in model_files("tiny.en").items():
        (snap / name).symlink_to(f)
    for k, v in _empty_hub(tmp_path).items():
        monkeypatch.setenv(k, v)
    assert missing_model("openai/whisper-tiny.en") is None
    assert load_model("openai/whisper-tiny.en").capabilities.languages == {"en"}


@pytest.mark.parametrize("mode", ["single", "multi"])
def test_ctrl_c_stops_the_server_quietly_with_status_0(tmp_path, mode):
    """Ctrl-C (SIGINT) is the documented way to stop: the server shuts down gracefully and exits 0.
    uvicorn raised the signal again after its shutdown, which cancelled Starlette's lifespan: an
    ERROR traceback (KeyboardInterrupt, then CancelledError) on every Ctrl-C, and exit status 1."""
    import signal

    s = Server(tmp_path, "--mode", mode)
    try:
        s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(30)
    finally:
        s.stop()
    log = s.log()
    assert rc == 0, log
    assert "Traceback" not in log and "ERROR" not in log, log


def test_ctrl_c_while_the_model_loads_waits_for_it_and_exits_0():
    """Ctrl-C a second after "listening on", while the model loads in the CPU pool: the load finishes,
    then the server exits 0. With daemon pool threads the interpreter's exit cut the load short inside
    native code and the process aborted ("terminate called without an active exception", SIGABRT)."""
    import signal

    from conftest import sigint_default

    p = subprocess.Popen([sys.executable, "-m", "flashasr", "serve", "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, preexec_fn=sigint_default)
    try:
        first = p.stdout.readline()
        assert "listening on" in first, first
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, first + out
    assert "terminate called" not in out and "Traceback" not in out, out
