"""``flashasr serve --ssl-certfile/--ssl-keyfile``: https:// and wss:// on the one socket (what a phone
needs for the web page's microphone), with a self-signed certificate made by the openssl command.

The API over https (an upload's transcript), the Realtime WebSocket over wss, and, where Chromium and
Playwright are installed, the web page over https reaching its server panel and opening its own
``wss://`` stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess

import httpx
import pytest
from websockets.asyncio.client import connect

from test_serve_util import CLIP, CLIP_WORDS, Server, words

if shutil.which("openssl") is None:
    pytest.skip("no openssl command to make a test certificate", allow_module_level=True)


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    crt, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True, timeout=60)
    return crt, key


@pytest.fixture(scope="module")
def server(tmp_path_factory, cert):
    s = Server(tmp_path_factory.mktemp("tls-serve"), "--no-warmup", "--ssl-certfile", str(cert[0]),
               "--ssl-keyfile", str(cert[1]))
    yield s
    s.stop()


def test_https_and_wss(server, cert):
    assert server.base.startswith("https://") and "listening on https://127.0.0.1:" in server.log()
    trust = ssl.create_default_context(cafile=str(cert[0]))
    with httpx.Client(base_url=server.base, verify=trust, timeout=60) as c:
        assert c.get("/").headers["content-type"].startswith("text/html")
        assert c.get("/status").json()["status"] == "ready"
        r = c.post("/v1/audio/transcriptions", files={"file": ("clip.wav", CLIP.read_bytes())})
        assert words(r.json()["text"]) == CLIP_WORDS
    with pytest.raises(httpx.ConnectError):  # a client that checks certificates refuses an unknown one
        httpx.get(server.base + "/health", timeout=10)

    async def session_created() -> str:
        async with connect(f"wss://127.0.0.1:{server.port}/v1/realtime?sample_rate=16000", ssl=trust) as ws:
            return json.loads(await ws.recv())["type"]

    assert asyncio.run(session_created()) == "transcription_session.created"


def test_the_web_page_over_https_streams_over_wss(server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed (dev extra)")
    chromium = os.environ.get("FLASHASR_CHROMIUM", "/usr/bin/chromium")
    if not os.path.exists(chromium):
        pytest.skip(f"no Chromium at {chromium}")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking", "--no-first-run"])
        try:
            page = b.new_context(ignore_https_errors=True).new_page()
            page.goto(server.base + "/")
            page.wait_for_selector("#srv-model")
            first = page.evaluate("""() => new Promise((resolve, reject) => {
                const { url, protocols } = flashasr.api.realtime(16000);
                const ws = new WebSocket(url, protocols);
                ws.onmessage = (m) => { resolve([url, JSON.parse(m.data).type, window.isSecureContext]); ws.close(); };
                ws.onerror = () => reject(new Error("websocket failed: " + url));
            })""")
        finally:
            b.close()
    assert first == [f"wss://127.0.0.1:{server.port}/v1/realtime?sample_rate=16000", "transcription_session.created",
                     True]
