"""The web page at ``/`` in a real browser: Debian's headless Chromium driven by Playwright for Python
(``executable_path=/usr/bin/chromium``; no browser is ever downloaded), against one real
``flashasr serve`` (single mode, CPU, tiny.en) with an API key.

* the page loads without console errors, asks for the key once, and fetches nothing from another host;
* a real clip uploaded through the page shows the server's API transcript, its speed factor, plays a
  clicked segment with its words lit, and downloads txt/srt/vtt equal to the API's renderings;
* the result names its file; a bad file uploaded after a good one shows its error with the old result
  (transcript, stats, player, downloads) cleared;
* bad files (not audio, too large, empty) and a server that cannot be reached show messages;
* the microphone: Chromium's fake capture device plays a WAV written from a real clip
  (1 s silence + clip + 2.5 s silence; the device loops it). The page's AudioWorklet resamples it
  from the AudioContext's rate to 16 kHz and streams it over ``/v1/realtime``. What the server received
  is exactly what the page sent (the session is declared at 16 kHz: no resampling on the server), and
  the page keeps it, so each final is compared with the offline transcript (``segmentation=none``,
  the streams' option) of exactly the committed samples: ``committed.audio_start_ms/end_ms`` are whole
  samples here (server VAD decides on 32 ms frames, with 300 ms of prefix padding; the page sends 20 ms
  frames). Both the server VAD path and a manual commit after the clip's end are run; their finals also
  carry the clip's words, and what the page sent is the device's file shifted by whole samples at an SNR
  of at least 40 dB (Chromium's conversion to the capture rate, then the page's resampler back);
* a denied microphone permission shows a message.

``FLASHASR_WEB_SCREENSHOTS=DIR`` saves the File and Live screenshots there (``docs/web-*.png``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import AUDIO
from test_serve_util import Server, wav_bytes, words

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed (dev extra)")

CHROMIUM = os.environ.get("FLASHASR_CHROMIUM", "/usr/bin/chromium")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium chromium-driver; .ci/run does)",
                allow_module_level=True)

KEY = "web-test-key"
UPLOAD_CLIP = AUDIO / "en" / "en-jfk-inaugural.wav"                      # 11 s, two segments
MIC_CLIP = AUDIO / "en" / "en-librivox-sense-sensibility-0870.wav"       # 7.1 s, one sentence
LEAD_S, TAIL_S = 1.0, 2.5
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SHOTS = os.environ.get("FLASHASR_WEB_SCREENSHOTS")
FINAL = "#live-items li.final"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("web"), "--api-key", KEY, "--max-upload-mb", "1", "--max-audio-s", "60",
               "--partial-interval-ms", "500")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def transcribe(api, data: bytes, name="clip.wav", **fields) -> str:
    """The API's reply body for an upload (``response_format`` json unless told)."""
    r = api.post("/v1/audio/transcriptions", files={"file": (name, data)}, data=fields)
    assert r.status_code == 200, r.text
    return r.text


def text_of(api, data: bytes, **fields) -> str:
    return json.loads(transcribe(api, data, **fields))["text"]


@pytest.fixture(scope="module")
def fake_mic(tmp_path_factory) -> Path:
    """The fake capture device's WAV: silence, the clip, silence (Chromium loops the file)."""
    with wave.open(str(MIC_CLIP)) as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    pad = lambda s: np.zeros(int(s * rate), "<i2").tobytes()  # noqa: E731
    path = tmp_path_factory.mktemp("mic") / "mic.wav"
    path.write_bytes(wav_bytes(pad(LEAD_S) + pcm + pad(TAIL_S), rate))
    return path


@pytest.fixture(scope="module")
def playwright():
    pw = sync_api.sync_playwright().start()
    yield pw
    pw.stop()


@pytest.fixture(scope="module")
def browser(playwright, fake_mic):
    """Chromium with the fake microphone, permission granted without a prompt."""
    b = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS + [
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={fake_mic}"])
    yield b
    b.close()


class Watched:
    """A page with its console errors, uncaught exceptions and requested URLs recorded."""

    def __init__(self, context):
        self.context = context
        self.page = context.new_page()
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.urls.append(r.url))
        self.page.on("websocket", lambda ws: self.urls.append(ws.url))

    def open(self, server, tab: str = "file"):
        self.page.goto(f"{server.base}/#{tab}")
        self.page.wait_for_selector("#srv-model")  # the server panel filled from /status
        return self.page


@pytest.fixture
def watched(browser):
    """A fresh browser context that already holds the API key (as after the one prompt)."""
    ctx = browser.new_context(viewport={"width": 1060, "height": 640}, accept_downloads=True)
    ctx.add_init_script(f"localStorage.setItem('flashasr.apiKey', {KEY!r})")
    w = Watched(ctx)
    yield w
    ctx.close()


def shot(page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / name), full_page=True)


# ----------------------------------------------------------------------------- the page
def test_page_loads_without_console_errors_and_asks_for_the_key_once(browser, server):
    ctx = browser.new_context()
    try:
        w = Watched(ctx)
        page = w.open(server)
        dialog = page.locator("#key-dialog")
        dialog.wait_for(state="visible")  # the server needs a key: asked at once, before any /v1 call
        page.fill("#key-input", KEY)
        page.click("#key-form button[type=submit]")
        dialog.wait_for(state="hidden")
        page.wait_for_function("() => localStorage.getItem('flashasr.apiKey') !== null")
        assert page.inner_text("#srv-model").startswith("whisper-tiny.en")
        assert page.inner_text("#srv-device").startswith("cpu")
        assert page.inner_text("#srv-key") == "required"
        page.reload()
        page.wait_for_selector("#srv-model")
        page.wait_for_timeout(500)
        assert not dialog.is_visible()  # asked once: the key is kept
        assert page.is_hidden("#boot") and page.is_hidden("#banner")
        assert w.errors == []
        origins = {server.base, server.base.replace("http:", "ws:")}
        assert all(any(u.startswith(o) for o in origins) or u.startswith(("data:", "blob:")) for u in w.urls), w.urls
    finally:
        ctx.close()


def test_a_wrong_stored_key_is_asked_again(browser, server):
    ctx = browser.new_context()
    ctx.add_init_script("localStorage.setItem('flashasr.apiKey', 'wrong')")
    try:
        page = Watched(ctx).open(server)
        page.locator("#key-dialog").wait_for(state="visible")
        assert "did not accept" in page.inner_text("#key-why")
        page.fill("#key-input", KEY)
        page.click("#key-form button[type=submit]")
        page.wait_for_function(f"() => localStorage.getItem('flashasr.apiKey') === {KEY!r}")
    finally:
        ctx.close()


def test_upload_shows_the_api_transcript_plays_segments_and_downloads(watched, server, api, tmp_path):
    page = watched.open(server)
    page.set_input_files("#file-input", str(UPLOAD_CLIP))
    page.wait_for_selector("#file-segments li", timeout=90000)
    data = UPLOAD_CLIP.read_bytes()
    api_text = text_of(api, data)
    shown = " ".join(page.locator("#file-segments .text").all_inner_texts())
    assert " ".join(shown.split()) == " ".join(api_text.split())
    assert words(api_text)[:4] == ["and", "so", "my", "fellow"]
    assert re.fullmatch(r"\d+(\.\d)?×", page.inner_text("#file-speed .big"))
    assert page.locator("#file-segments li").count() >= 2 and page.locator(".word").count() >= 10
    assert page.inner_text("#file-name") == UPLOAD_CLIP.name  # the result names the file it belongs to

    seg = page.locator("#file-segments li").nth(1)
    start, end = float(seg.get_attribute("data-start")), float(seg.get_attribute("data-end"))
    seg.click()
    page.wait_for_selector(".word.current", timeout=10000)  # word times light the word being played
    t = page.evaluate("document.getElementById('file-audio').currentTime")
    assert start - 0.05 <= t <= end + 0.3
    shot(page, "web-file.png")
    page.wait_for_function("document.getElementById('file-audio').paused", timeout=15000)  # stops at the segment's end
    assert page.evaluate("document.getElementById('file-audio').currentTime") <= end + 0.5

    for fmt, response_format in (("txt", "text"), ("srt", "srt"), ("vtt", "vtt")):
        with page.expect_download() as dl:
            page.click(f".downloads button[data-format={fmt}]")
        got = Path(dl.value.path()).read_text(encoding="utf-8")
        assert got == transcribe(api, data, response_format=response_format), fmt
    with page.expect_download() as dl:
        page.click(".downloads button[data-format=json]")
    assert dl.value.suggested_filename == "en-jfk-inaugural.json"
    assert '"segments"' in Path(dl.value.path()).read_text(encoding="utf-8")
    assert watched.errors == []

    # a bad file after a good one: the error stands alone, the old transcript, stats, player and
    # downloads are gone (they would pass for the new file's)
    notes = tmp_path / "notes.txt"
    notes.write_text("not audio\n" * 50)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    for bad, says in ((notes, "unsupported_format"), (empty, "empty")):
        page.set_input_files("#file-input", str(bad))
        page.wait_for_function(f"document.getElementById('file-error').textContent.includes({says!r})", timeout=30000)
        assert page.is_hidden("#file-result") and page.is_hidden(".downloads button[data-format=txt]"), bad.name
        assert page.locator("#file-segments li").count() == 0 and page.inner_text("#file-name") == ""
        assert page.locator("#file-stats .cell").count() == 0
        assert page.evaluate("document.getElementById('file-audio').getAttribute('src')") is None
    # the browser logs the 400 reply of the .txt upload; nothing else went wrong on the page
    assert [e for e in watched.errors if "status of 400" not in e] == []


def test_bad_files_show_error_messages(watched, server, tmp_path):
    page = watched.open(server)
    error = page.locator("#file-error")
    notes = tmp_path / "notes.txt"
    notes.write_bytes(np.random.default_rng(0).bytes(4000))
    page.set_input_files("#file-input", str(notes))
    error.wait_for(state="visible", timeout=30000)
    assert "notes.txt" in error.inner_text() and "unsupported_format" in error.inner_text()

    posts = []
    page.on("request", lambda r: r.method == "POST" and posts.append(r.url))
    big = tmp_path / "big.wav"
    big.write_bytes(b"\0" * (1536 * 1024))  # over --max-upload-mb 1: refused before uploading
    page.set_input_files("#file-input", str(big))
    page.wait_for_function("document.getElementById('file-error').textContent.includes('too large')")
    assert "file_too_large" in error.inner_text() and posts == []

    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    page.set_input_files("#file-input", str(empty))
    page.wait_for_function("document.getElementById('file-error').textContent.includes('empty')")
    assert page.is_hidden("#file-result")


def test_a_server_that_cannot_be_reached_shows_a_banner(watched, server):
    page = watched.open(server)
    page.route("**/status", lambda route: route.abort())
    banner = page.locator("#banner")
    banner.wait_for(state="visible", timeout=10000)
    assert "cannot be reached" in banner.inner_text() and page.inner_text("#conn") == "server unreachable"
    page.unroute("**/status")
    banner.wait_for(state="hidden", timeout=10000)


# ----------------------------------------------------------------------------- the microphone
def _recording(page) -> bytes:
    return base64.b64decode(page.evaluate("flashasr.live.last.recordingBase64()"))


def _committed(page, item) -> tuple[str, int, int]:
    text = item.locator(".text").inner_text()
    return text, int(item.get_attribute("data-audio-start-ms")), int(item.get_attribute("data-audio-end-ms"))


def _offline(api, pcm: bytes, start_ms: int, end_ms: int) -> str:
    """The offline transcript of the samples [start_ms, end_ms) of 16 kHz PCM16 (streams' options)."""
    return text_of(api, wav_bytes(pcm[start_ms * 32:end_ms * 32]), segmentation="none")


@pytest.fixture(scope="module")
def clip_words(api) -> list[str]:
    return words(text_of(api, MIC_CLIP.read_bytes()))


def _block_snrs(sent: np.ndarray, played: np.ndarray, block: int = 8000) -> list[tuple[int, float]]:
    """For each ``block``-sample stretch of ``sent`` that holds speech: where it sits in the fake device's
    looped file (its shift, found by cross-correlation against two passes of ``played``) and its SNR in dB
    there. Blockwise, because a loaded machine may drop a render quantum of capture now and then (Chromium's
    fake device runs in real time): a dropped quantum shifts everything after it, which says nothing about
    the page's resampler and would spoil one SNR over the whole recording (CI measured 4.4 dB that way)."""
    loop = np.concatenate([played, played])
    n = 1 << int(np.ceil(np.log2(len(loop) + block)))
    spectrum = np.conj(np.fft.rfft(loop, n))
    energy = np.concatenate([[0.0], np.cumsum(loop * loop)])
    lags = np.arange(len(loop) - block + 1)
    window = np.sqrt(np.maximum(energy[lags + block] - energy[lags], 1e-9))  # |loop[lag:lag + block]|
    out = []
    for i in range(0, len(sent) - block + 1, block):
        a = sent[i:i + block]
        if np.sqrt(np.mean(a * a)) < 300:  # the lead-in and tail are silence: no SNR to measure there
            continue
        corr = np.fft.irfft(np.fft.rfft(a, n) * spectrum, n)  # corr[(n - lag) % n] = a . loop[lag:lag + block]
        lag = int(np.argmax(corr[(n - lags) % n] / window))  # normalised: the best match, not the loudest
        b = loop[lag:lag + block]
        out.append(((lag - i) % len(played), float(10 * np.log10((b @ b) / max((a - b) @ (a - b), 1e-9)))))
    return out


def _stop(page) -> None:
    page.click("#mic")
    page.wait_for_function("document.getElementById('mic').textContent.includes('Start')", timeout=60000)


PERIOD_MS = int((LEAD_S + 7.1 + TAIL_S) * 1000)  # the fake device's loop


def test_microphone_with_server_vad_shows_partials_then_the_offline_final(watched, server, api, clip_words, fake_mic):
    """The first utterance that got a partial before its final (the first one, unless partials lag on
    a loaded machine: the device loops the clip, so the next pass is another utterance)."""
    page = watched.open(server, "live")
    assert page.is_checked("#live-vad")  # server VAD is the default
    page.click("#mic")
    page.wait_for_function("() => [...document.querySelectorAll('#live-items li.partial .text')]"
                           ".some(e => /[a-z]/i.test(e.textContent))", timeout=30000)  # provisional text
    page.wait_for_function("""() => {
        const L = flashasr.live.latencies, had = new Set(L.filter(x => x.kind === 'partial').map(x => x.item));
        return L.some(x => x.kind === 'final' && had.has(x.item)); }""", timeout=60000)
    lat = page.evaluate("flashasr.live.latencies")
    had = {x["item"] for x in lat if x["kind"] == "partial"}
    item_id = next(x["item"] for x in lat if x["kind"] == "final" and x["item"] in had)
    assert all(x["ms"] > 0 for x in lat)
    assert int(page.get_attribute("#live-lat-partial", "data-n")) >= 1
    assert int(page.get_attribute("#live-lat-final", "data-n")) >= 1
    shot(page, "web-live.png")
    item = page.locator(f'#live-items li[data-item-id="{item_id}"]')
    assert item.get_attribute("class") == "final"
    text, a, b = _committed(page, item)
    assert 400 <= a % PERIOD_MS <= 1300  # speech starts after the lead-in (less 300 ms of prefix padding)
    pcm = _recording(page)
    _stop(page)
    assert text == _offline(api, pcm, a, b)
    assert words(text) == clip_words
    assert watched.errors == []
    # the audio path is transparent: Chromium converts the file to the capture rate (44.1 or 48 kHz), the
    # page's AudioWorklet resamples it back to 16 kHz; what it sent is the file, shifted by whole samples
    # (58 dB per block measured on an idle machine; 13-22 dB on a loaded one, where the fake device
    # drops capture quanta all along); a wrong rate or a broken resampler gives about 0 dB or less, so
    # most half-second blocks must reach 10 dB
    with wave.open(str(fake_mic)) as w:
        played = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float64)
    blocks = _block_snrs(np.frombuffer(pcm, "<i2").astype(np.float64), played)
    good = [snr for _, snr in blocks if snr >= 10]
    assert len(blocks) >= 10 and len(good) >= 0.75 * len(blocks), blocks


def test_microphone_manual_commit_after_the_clip(watched, server, api, clip_words):
    page = watched.open(server, "live")
    page.uncheck("#live-vad")
    page.click("#mic")
    end_s = LEAD_S + 7.1 + 0.9  # after the clip, before the device loops it (at 10.6 s)
    page.wait_for_function(f"() => flashasr.live.session && flashasr.live.session.sent >= {int(end_s * 16000)}",
                           timeout=30000)
    page.click("#commit")
    item = page.locator(FINAL).first
    item.wait_for(timeout=60000)
    text, a, b = _committed(page, item)
    assert a == 0 and b >= end_s * 1000  # no VAD: the item is the stream from its start to the commit
    pcm = _recording(page)
    _stop(page)
    assert text == _offline(api, pcm, a, b)
    assert words(text) == clip_words
    assert "final" in [x["kind"] for x in page.evaluate("flashasr.live.latencies")]


def test_microphone_permission_denied_shows_a_message(playwright, server):
    b = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS + ["--use-fake-device-for-media-stream"])
    try:
        ctx = b.new_context()  # no permission granted, no fake prompt: getUserMedia is refused
        ctx.add_init_script(f"localStorage.setItem('flashasr.apiKey', {KEY!r})")
        page = Watched(ctx).open(server, "live")
        page.click("#mic")
        page.locator("#live-error").wait_for(state="visible", timeout=15000)
        assert "permission denied" in page.inner_text("#live-error").lower()
        assert "Start" in page.inner_text("#mic")
    finally:
        b.close()
