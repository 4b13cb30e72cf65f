"""The same 90 s recording through every door gives the same transcript: the CLI job
(``flashasr transcribe``), the Python API (``flashasr.transcribe``) and the HTTP server (single
mode; for Parakeet also multi mode, through the engine process). They all cut at VAD pauses,
batch and merge in the one pipeline (Whisper tiny.en and the NeMo-made Parakeet fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
import wave

import httpx
import numpy as np
import pytest

import flashasr
from conftest import AUDIO, PARAKEET_FIXTURES
from flashasr.audio import load_audio
from flashasr.cli import main
from test_serve_util import Server

PARAKEET = str(PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo")


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> str:
    """90 s of real English speech: a 69 s VoxPopuli recording, a pause, then FLEURS sentences."""
    parts = [load_audio(AUDIO / "long" / "long-en-voxpopuli-000.ogg").samples, np.zeros(16000, np.float32)]
    for name in ("en-fleurs-000.ogg", "en-fleurs-001.ogg", "en-fleurs-002.ogg"):  # 69 + 1 + 10.6 + 8.8 + 0.4 s
        parts.append(load_audio(AUDIO / "en" / name).samples)
    x = np.concatenate(parts)[: 90 * 16000]
    assert x.size == 90 * 16000
    path = tmp_path_factory.mktemp("doors") / "ninety.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return str(path)


def _view(d: dict) -> dict:
    """What must agree: the text, language, duration, every segment's times and text, the words."""
    return {"text": d["text"], "language": d["language"], "duration": d["duration"],
            "segments": [(s["start"], s["end"], s["text"]) for s in d["segments"]],
            "words": [(w["word"], w["start"], w["end"]) for w in d.get("words") or []]}


# the default options, and options through every door: word times, a language given by name, shorter pieces
VARIANTS = [{}, {"word_timestamps": True, "language": "English", "max_segment_s": 20}]


def _cli(path: str, spec: str | None, out, opts: dict) -> dict:
    args = ["transcribe", path, "-f", "verbose_json", "-o", str(out), "-q", "--no-resume"]
    args += ["--word-timestamps"] * bool(opts.get("word_timestamps"))
    args += [x for k in ("language", "max_segment_s") if k in opts for x in (f"--{k.replace('_', '-')}", str(opts[k]))]
    assert main(args + (["--model", spec] if spec else [])) == 0
    return json.loads((out / "ninety.verbose.json").read_text())


def _http(server: Server, path: str, opts: dict) -> dict:
    data = {"response_format": "verbose_json"}
    data.update({k: str(v) for k, v in opts.items() if k != "word_timestamps"})
    if opts.get("word_timestamps"):
        data["timestamp_granularities[]"] = ["word", "segment"]
    with open(path, "rb") as f:
        r = httpx.post(server.base + "/v1/audio/transcriptions", files={"file": ("ninety.wav", f)}, data=data,
                       timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("spec", [None, PARAKEET], ids=["whisper-tiny.en", "parakeet-fixture"])
def test_cli_api_and_server_give_the_same_transcript(recording, tmp_path, spec):
    servers = {mode: Server(tmp_path, *(["--model", spec] if spec else []), "--mode", mode)
               for mode in ("single", "multi")}
    try:
        for k, opts in enumerate(VARIANTS):
            cli = _view(_cli(recording, spec, tmp_path / f"cli{k}", opts))
            api = _view(flashasr.transcribe(recording, model=spec, **opts).to_dict(words=bool(opts)))
            assert api == cli, opts
            assert cli["duration"] == 90.0 and cli["segments"] and bool(cli["words"]) == bool(opts)
            if spec is None:  # real speech, real weights: words from both ends of the file, in VAD pieces
                assert "elephants" in cli["text"].lower() and "capital letter" in cli["text"].lower()
                assert len(cli["segments"]) >= 8 and cli["segments"][-1][1] > 80 and cli["language"] == "english"
            for mode, server in servers.items():
                assert _view(_http(server, recording, opts)) == cli, (mode, opts)
        if spec == PARAKEET:  # options Parakeet cannot use: accepted, and the reply says so
            with open(recording, "rb") as f:
                r = httpx.post(servers["multi"].base + "/v1/audio/transcriptions", files={"file": ("n.wav", f)},
                               data={"prompt": "Stella", "temperature": "0.4"}, timeout=300)
            assert r.status_code == 200 and r.headers["x-flashasr-ignored"] == "prompt, temperature"
            with pytest.warns(UserWarning, match="does not use prompt, temperature"):
                t = flashasr.transcribe(recording, model=spec, prompt="Stella", temperature=0.4)
            assert t.text == flashasr.transcribe(recording, model=spec).text  # they change nothing here
            proc = subprocess.run([sys.executable, "-m", "flashasr", "transcribe", str(recording), "--model", spec,
                                   "--prompt", "Stella", "-o", str(tmp_path / "ign")], capture_output=True, text=True)
            assert proc.returncode == 0 and "does not use --prompt" in proc.stderr, proc.stderr
    finally:
        for server in servers.values():
            server.stop()
