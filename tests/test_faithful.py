"""Nothing invented, nothing lost, the same faithful transcript from every door (issue #17).

Doors: ``flashasr.transcribe``, the CLI (``flashasr transcribe``, in process), HTTP uploads to one
single-mode and one multi-mode server (tiny.en, started once for the module), and a stream's final
(``/v1/stream``, manual commit). Inputs: generated signals (digital silence, -60 dBFS noise, a tone,
synthetic applause) and shared clips (whale song, jazz, real speech), some built into longer
recordings here.

1. no invented text: silence, noise, tone, applause and animal sounds give empty text at every door,
   as whole files (30 s and 5 min, ``vad`` and ``none``) and between speech inside a longer file; the
   repetition guard cuts token loops inside a segment and runs of equal segments, and says so;
2. no lost speech: a piece of two utterances with a short pause, after which tiny.en's decoder
   stops, gives both (the model alone, without the VAD's spans, gives only the first);
3. language from speech: French after 30 s of silence or of noise is French (whisper base), with
   its probability in ``verbose_json``;
4. finals first: a stream's final waits for at most one step of a long upload (scheduler, fake model);
5. a long input's log-mel is computed in chunks, equal to one pass;
6. damaged input: a truncated WAV / MP3 gives the transcript of what decodes and says so
   (``verbose_json`` and ``summary.jsonl`` ``warnings``, stderr, ``X-Flashasr-Warnings``).
"""

from __future__ import annotations

import asyncio
import json
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect

import flashasr
from conftest import AUDIO, manifest
from flashasr.audio import load_audio
from flashasr.audio.encode import encode_audio
from flashasr.cli import main
from test_serve_util import Server, words

SR = 16000
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _write(path: Path, x: np.ndarray) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SR)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return path


def _clip(rel: str) -> np.ndarray:
    return load_audio(AUDIO / rel).samples


def _applause(seconds: float, rng) -> np.ndarray:
    n = int(seconds * SR)
    x = np.zeros(n + SR, np.float32)
    for t in rng.integers(0, n, size=int(seconds * 40)):
        k = int(rng.integers(80, 240))
        x[t:t + k] += rng.standard_normal(k).astype(np.float32) * np.exp(-np.arange(k) / (k / 4)) * 0.15
    return x[:n]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("faithful")
    rng = np.random.default_rng(17)
    quiet = {
        "silence30": np.zeros(30 * SR, np.float32),
        "silence300": np.zeros(300 * SR, np.float32),
        "noise30": (rng.standard_normal(30 * SR) * 10 ** (-60 / 20)).astype(np.float32),
        "tone20": (0.3 * np.sin(2 * np.pi * 440 * np.arange(20 * SR) / SR)).astype(np.float32),
        "applause10": _applause(10, rng),
    }
    out = {k: _write(d / f"{k}.wav", x) for k, x in quiet.items()}
    out["whale"] = AUDIO / "hard" / "hard-whale-humpback.ogg"
    # two utterances, a 0.8 s pause: tiny.en's decoder emits end-of-text after the first
    a, b = _clip("en/en-timit-ldc93s1.wav"), _clip("en/en-fleurs-004.ogg")
    out["pair"] = _write(d / "pair.wav", np.concatenate([a, np.zeros(int(0.8 * SR), np.float32), b]))
    # speech, 20 s of jazz, 10 s of silence, 8 s of applause, speech
    jfk, jazz = _clip("en/en-jfk-inaugural.wav"), _clip("hard/hard-music-vibe-ace.ogg")[: 20 * SR]
    parts = [jfk, jazz, np.zeros(10 * SR, np.float32), _applause(8, rng), a]
    out["mixed"] = _write(d / "mixed.wav", np.concatenate(parts))
    edges = np.cumsum([0] + [p.size for p in parts]) / SR
    out["mixed_quiet"] = (edges[1], edges[4])  # the non-speech between the two speech clips
    # truncated files: the first half of a WAV (its header still declares 11 s) and of an MP3
    raw = (AUDIO / "en" / "en-jfk-inaugural.wav").read_bytes()
    (d / "cut_wav.wav").write_bytes(raw[: len(raw) // 2])
    raw = (AUDIO / "hard" / "hard-mp3-ls-1272-141231-0002.mp3").read_bytes()
    (d / "cut_mp3.mp3").write_bytes(raw[: len(raw) // 2])
    out["cut.wav"], out["cut.mp3"] = d / "cut_wav.wav", d / "cut_mp3.mp3"
    return out


QUIET = ["silence30", "silence300", "noise30", "tone20", "applause10", "whale"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faithful-servers")
    got = {mode: Server(tmp, "--mode", mode) for mode in ("single", "multi")}
    yield got
    for s in got.values():
        s.stop()


def _http(server: Server, path: Path, **form) -> tuple[dict, httpx.Headers]:
    data = {"response_format": "verbose_json", **{k: str(v) for k, v in form.items()}}
    with open(path, "rb") as f:
        r = httpx.post(server.base + "/v1/audio/transcriptions", files={"file": (path.name, f)}, data=data,
                       timeout=300)
    assert r.status_code == 200, r.text
    return (r.json() if data["response_format"].endswith("json") else r.text), r.headers


def _cli(paths: list[Path], out: Path, *extra: str) -> dict[str, dict]:
    assert main(["transcribe", *map(str, paths), "-f", "verbose_json", "-o", str(out), "-q", "--no-resume",
                 *extra]) == 0
    return {p.name: json.loads((out / f"{p.stem}.verbose.json").read_text()) for p in paths}


def _final(server: Server, path: Path) -> str:
    """A stream's final: the first 25 s (under the utterance cap) of a 16 kHz WAV's own PCM sent at
    once on /v1/stream (no server VAD), committed."""
    with wave.open(str(path)) as w:
        pcm = w.readframes(25 * SR)

    async def go():
        url = f"ws://127.0.0.1:{server.port}/v1/stream?sample_rate=16000&partial_interval_ms=0"
        async with connect(url, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for off in range(0, len(pcm), 64000):
                await ws.send(pcm[off:off + 64000])
            await ws.send(json.dumps({"type": "commit"}))
            async for msg in ws:
                ev = json.loads(msg)
                assert not ev["type"].endswith("failed") and ev["type"] != "error", ev
                if ev["type"].endswith("transcription.completed"):
                    return ev["transcript"]

    return asyncio.run(asyncio.wait_for(go(), 120))


# ---------------------------------------------------------------------- 1. nothing invented
def test_non_speech_gives_no_text_at_every_door(files, servers, tmp_path):
    paths = [files[k] for k in QUIET]
    for seg in ("vad", "none"):
        for k in QUIET:
            t = flashasr.transcribe(files[k], segmentation=seg)
            assert (t.text, t.segments) == ("", []), (k, seg, t.text)
        for name, v in _cli(paths, tmp_path / seg, "--segmentation", seg).items():
            assert (v["text"], v["segments"]) == ("", []), (name, seg)
        for mode, server in servers.items():
            for k in QUIET:
                v, _ = _http(server, files[k], segmentation=seg)
                assert (v["text"], v["segments"]) == ("", []), (mode, k, seg, v["text"])
    for k in ("silence30", "noise30", "tone20", "applause10"):  # a stream committed over non-speech: an empty final
        assert _final(servers["single"], files[k]) == "", k


def test_no_words_between_speech_inside_a_longer_file(files, servers):
    lo, hi = files["mixed_quiet"]  # jazz, silence and applause between the two speech clips

    def check(v: dict, what) -> None:
        inside = [w for w in v.get("words") or [] if lo + 1 < w["start"] and w["end"] < hi - 1]
        assert inside == [], (what, inside)
        assert not [s for s in v["segments"] if lo + 1 < s["start"] and s["end"] < hi - 1], what
        text = " ".join(words(v["text"]))
        assert "fellow americans" in text and "greasy wash water" in text, (what, text)

    for seg in ("vad", "none"):
        check(flashasr.transcribe(files["mixed"], segmentation=seg, word_timestamps=True).to_dict(), ("api", seg))
        for mode, server in servers.items():
            check(_http(server, files["mixed"], segmentation=seg, **{"timestamp_granularities[]": "word"})[0],
                  (mode, seg))


def test_repetition_guard_cuts_loops_and_says_so():
    from flashasr.models.whisper.asr import _Job
    from flashasr.models.whisper.decoding import DecodingResult
    from flashasr.pipeline import merge_pieces
    from flashasr.repetition import cut_loops, find_loop
    from flashasr.types import Segment, Transcript

    assert find_loop("i went a little bit of a little bit of a little bit of a little bit of home".split()) == (2, 4, 4)
    assert find_loop("no no no no".split()) is None  # short repetition is speech, not a loop
    assert cut_loops(list("xabababababy"), min_items=8) == ([0, 1, 2, 11], [(1, 2, 5)])
    # Whisper: a window whose tokens loop inside one segment (what every fallback temperature gave)
    m = flashasr.load_model()
    tok = m.tokenizer
    unit = tok.encode(" a little bit of")
    toks = [tok.timestamp_begin] + tok.encode(" I went") + unit * 20 + [tok.timestamp_begin + 1400]
    r = DecodingResult(toks, [-0.1] * len(toks), "", "en", -0.2, 0.0, 0.1, 1.0, 9.0, fallback_exhausted=True)
    job = _Job(0, None, 3000, 30.0, "en", limit=3000)
    m._advance(job, 3000, r)
    assert [s.text for s in job.segments] == [" I went a little bit of"]
    assert job.warnings[0]["code"] == "repetition_removed" and job.warnings[0]["copies"] == 20
    # the merger: one sentence in 6 segments in a row is kept once (the pieces' texts follow)
    segs = [Segment(0, 2.0 * i, 2.0 * i + 1.5, " Thank you for watching.") for i in range(6)] + \
        [Segment(0, 20.0, 21.0, " Bye.")]
    t = merge_pieces([(0.0, Transcript("".join(s.text for s in segs), "en", 30.0, segs))], 30.0)
    assert t.text == "Thank you for watching. Bye." and [s.id for s in t.segments] == [0, 1]
    assert t.warnings[0]["code"] == "repetition_removed" and t.warnings[0]["copies"] == 6
    assert t.to_dict()["warnings"] == t.warnings
    # ... for a model that invents text (a speech gate: Whisper); Parakeet-TDT's blanks invent
    # nothing, so the same segments from it are speech and stay
    from flashasr.models.parakeet.model import ParakeetASR
    from flashasr.options import ModelCapabilities

    tdt = ModelCapabilities(name="p", family="parakeet", window_s=60.0, speech_gate=ParakeetASR.speech_gate)
    t = merge_pieces([(0.0, Transcript("".join(s.text for s in segs), "en", 30.0, segs))], 30.0, caps=tdt)
    assert len(t.segments) == 7 and not t.warnings


# ---------------------------------------------------------------------- 2. nothing lost
def test_speech_after_an_early_end_of_text_is_transcribed_at_every_door(files, servers, tmp_path):
    first, second = "greasy wash water", "because they have feathers and can fly"
    x = load_audio(files["pair"]).samples
    alone = " ".join(words(flashasr.load_model().transcribe_waveform(x).text))
    assert first in alone and second not in alone  # the failure: the model stops after the first

    def both(text: str, what) -> None:
        got = " ".join(words(text))
        assert first in got and second in got, (what, text)

    for seg in ("vad", "none"):
        both(flashasr.transcribe(files["pair"], segmentation=seg).text, ("api", seg))
        both(_cli([files["pair"]], tmp_path / seg, "--segmentation", seg)["pair.wav"]["text"], ("cli", seg))
        for mode, server in servers.items():
            both(_http(server, files["pair"], segmentation=seg)[0]["text"], (mode, seg))
    both(_final(servers["multi"], files["pair"]), "stream final")


def test_the_ray_jobs_rows_carry_the_speech_spans_and_the_damage(files):
    """``flashasr transcribe --ray``'s stages without a cluster: the CPU stage's rows carry each
    piece's VAD speech spans and the file's damage warnings, the model stage hands the spans to
    the model (both utterances of the pair) and the driver's collector puts the warnings in the
    file's state."""
    from flashasr.jobs.ray_job import ModelStage, _Collector, prepare_pieces
    from flashasr.pipeline import plan_pieces

    model = flashasr.load_model()
    caps, opts = model.capabilities, flashasr.TranscribeOptions().resolve(model.capabilities)
    batch = {"idx": np.array([0, 1]), "path": np.array([str(files["pair"]), str(files["cut.wav"])], dtype=object),
             "options": np.array([json.dumps(opts.to_dict())] * 2, dtype=object)}
    rows = prepare_pieces(batch, caps.to_dict())
    (pair_piece,) = plan_pieces(load_audio(files["pair"]).samples, opts, caps)
    first = [r for r in range(len(rows["idx"])) if rows["idx"][r] == 0]
    assert len(first) == 1 and json.loads(rows["speech"][first[0]]) == [list(s) for s in pair_piece.speech]
    cut = [r for r in range(len(rows["idx"])) if rows["idx"][r] == 1]
    assert all(json.loads(rows["warnings"][r])[0]["code"] == "damaged_input" for r in cut)
    assert json.loads(rows["warnings"][first[0]]) == []
    stage = ModelStage.__new__(ModelStage)  # the actor's state without Ray and without loading twice
    stage.model, stage.batch_size, stage._options, stage.cuda, stage.pid = model, 8, {}, False, 0
    out = stage(rows)
    text = " ".join(words(__import__("pickle").loads(out["result"][first[0]]).text))
    assert "greasy wash water" in text and "because they have feathers and can fly" in text, text
    st = _Collector([None, None], [opts, opts], None, None)._state(out, cut[0], 1, len(cut))
    assert st.warnings[0]["code"] == "damaged_input" and st.warnings[0]["declared_s"] == pytest.approx(11.0, abs=0.01)


# ---------------------------------------------------------------------- 3. language from speech
@pytest.fixture(scope="module")
def french(files, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("french")
    fr = _clip("multi/fr-fleurs-000.ogg")
    noise = (np.random.default_rng(3).standard_normal(30 * SR) * 10 ** (-60 / 20)).astype(np.float32)
    return {"after_silence": _write(d / "after_silence.wav", np.concatenate([np.zeros(30 * SR, np.float32), fr])),
            "after_noise": _write(d / "after_noise.wav", np.concatenate([noise, fr]))}


def test_language_is_detected_on_speech_not_on_a_quiet_start(french, tmp_path):
    """whisper base: French after 30 s of digital silence or of -60 dBFS noise (before: English and
    translated, or Welsh and a loop, with ``segmentation=none``)."""
    server = Server(tmp_path, "--model", "base")
    try:
        for seg in ("vad", "none"):
            for name, path in french.items():
                t = flashasr.transcribe(path, model="base", segmentation=seg)
                assert t.language == "fr" and t.language_probability > 0.5, (name, seg, t.language, t.text)
                assert "montagneux" in t.text and t.text.count("yw'n") == 0, (name, seg, t.text)
                v, _ = _http(server, path, segmentation=seg)
                assert v["language"] == "french" and v["language_probability"] > 0.5, (name, seg, v["text"])
            cli = _cli(list(french.values()), tmp_path / seg, "--model", "base", "--segmentation", seg)
            assert all(v["language"] == "french" and v["language_probability"] > 0.5 for v in cli.values()), seg
    finally:
        server.stop()


# ---------------------------------------------------------------------- 4. finals first
def test_a_final_waits_for_at_most_one_step_of_a_long_upload():
    """A fake model whose batches run in steps of 0.1 s (a long ``segmentation=none`` upload: 20
    steps): a final submitted meanwhile is answered after the step running, and a short upload
    after about one step more, not after the whole upload."""
    from flashasr.models.base import ASRModel, BatchRun
    from flashasr.options import TranscribeOptions
    from flashasr.serve.scheduler import FINAL, OFFLINE, BatchScheduler
    from flashasr.types import Transcript

    STEP = 0.1

    class Stepping(ASRModel):
        name, family = "stepping", "whisper"

        def _transcribe(self, waves, options):
            return [Transcript("x", "en", w.size / SR) for w in waves]

        def start_batch(self, waves, options=None, *, speech=None):
            n = max(1, int(max(w.size for w in waves) / SR / 30))  # one step per 30 s window

            class Run(BatchRun):
                def step(run):
                    time.sleep(STEP)
                    run.k = getattr(run, "k", 0) + 1
                    run.audio_s = 30.0
                    run.done = run.k >= n
                    run._out = [Transcript(f"{w.size}", "en", w.size / SR) for w in waves] if run.done else None
                    return run.done

            return Run(None)

    async def go():
        s = BatchScheduler(Stepping(), max_batch=1, batch_wait_s=0)
        s.start()
        opts = TranscribeOptions(segmentation="none")
        t0 = time.perf_counter()
        upload = asyncio.ensure_future(s.submit_pieces(np.zeros(600 * SR, np.float32), [(0, 600 * SR)], opts))
        await asyncio.sleep(3.5 * STEP)
        t1 = time.perf_counter()
        final = await s.submit(np.zeros(3 * SR, np.float32), opts, priority=FINAL)
        t_final = time.perf_counter() - t1
        t2 = time.perf_counter()
        short = await s.submit(np.zeros(3 * SR, np.float32), opts, priority=OFFLINE)
        t_short = time.perf_counter() - t2
        await upload
        total = time.perf_counter() - t0
        await s.stop()
        return final, t_final, short, t_short, total

    final, t_final, short, t_short, total = asyncio.run(go())
    assert final.text == "x" and short.text == "48000"
    assert t_final < 2 * STEP + 0.15, t_final  # the step running, then the final's own call
    assert t_short < 3 * STEP + 0.15, t_short  # the step running, maybe one more, then its own
    assert total > 20 * STEP  # the upload ran all its steps


# ---------------------------------------------------------------------- 5. bounded memory
def test_long_log_mel_is_computed_in_chunks_equal_to_one_pass(monkeypatch):
    import flashasr.models.whisper.features as features

    x = (np.random.default_rng(5).standard_normal(73 * SR + 123) * 0.1).astype(np.float32)
    whole = features.log_mel_spectrogram(x, 80, padding=30 * SR)
    monkeypatch.setattr(features, "CHUNK_FRAMES", 1234)
    chunked = features.log_mel_spectrogram(x, 80, padding=30 * SR)
    assert chunked.shape == whole.shape and bool((chunked == whole).all())
    assert bool((features.log_mel_spectrogram(x[:5000], 80) == features._log_mel_chunked(
        __import__("torch").from_numpy(x[:5000]), 80, 0)).all())


def _segments() -> set[str]:
    """Our shared-memory segments: those named by this process or one of its children (the test
    servers and their engines), not another session's on the same machine."""
    import os

    import psutil

    pids = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    parts = (n.split("_") for n in os.listdir("/dev/shm"))
    return {"_".join(p) for p in parts  # flashasr_<pid>_p<parent pid>_<n>
            if len(p) == 4 and p[0] == "flashasr" and p[1].isdigit() and int(p[1]) in pids}


def test_a_long_upload_crosses_to_the_engine_without_a_copy(files, servers, tmp_path):
    """Multi mode: a long upload decoded in processes lives in a shared-memory segment; its name is
    kept (``keep_segment``) and sent to the engine, which maps the same pages (no second 880 MB
    segment for 4 hours); no segment is left behind, and the transcript equals single mode's."""
    from flashasr.audio import load_audio_parallel
    from flashasr.serve.ipc import Flag, Frame, MsgType, pack_audio, unpack_audio

    x = np.concatenate([load_audio(files["pair"]).samples, np.zeros(50 * SR, np.float32),
                        load_audio(files["pair"]).samples])  # 70 s: decoded in time ranges
    path = tmp_path / "long.wav"  # 24-bit: FFmpeg's (a 16 kHz PCM16 WAV is read whole: sequential_suffices)
    encode_audio(np.clip(x, -1, 1), SR, path, format="wav", codec="pcm_s24le")
    before = _segments()
    plain = load_audio_parallel(path, workers=2, pool="process")
    assert plain.segment is None and _segments() == before
    wav = load_audio_parallel(path, workers=2, pool="process", keep_segment=True)
    assert wav.segment in _segments() - before and np.array_equal(wav.samples, plain.samples)
    flags, meta, payload, handle = pack_audio(wav.samples, 1024, None, segment=wav.segment)
    assert flags & Flag.SHM and not flags & Flag.SHM_POOLED and meta["shm"] == wav.segment
    assert payload == b"" and handle is None
    got = unpack_audio(Frame(MsgType.TRANSCRIBE, 1, flags, meta, b""))  # the engine's side: mapped in place
    assert np.array_equal(got, wav.samples) and _segments() == before  # ... and its name unlinked
    multi, _ = _http(servers["multi"], path)
    single, _ = _http(servers["single"], path)
    assert multi["text"] == single["text"] and "greasy wash water" in " ".join(words(multi["text"]))
    assert _segments() == before


# ---------------------------------------------------------------------- 6. damaged input
def test_a_truncated_file_gives_what_decodes_and_says_so_at_every_door(files, servers, tmp_path, capsys):
    cut = files["cut.wav"]

    def damaged(ws: list[dict], declared: float) -> None:
        (w,) = [w for w in ws if w["code"] == "damaged_input"]
        assert w["declared_s"] == pytest.approx(declared, abs=0.01) and w["decoded_s"] < 0.6 * declared, w
        assert "truncated" in w["message"]

    with pytest.warns(UserWarning, match="truncated"):
        t = flashasr.transcribe(cut)
    assert "fellow americans" in " ".join(words(t.text)) and t.duration < 6
    damaged(t.warnings, 11.0)
    with pytest.warns(UserWarning, match="truncated"):
        damaged(flashasr.transcribe(files["cut.mp3"]).warnings, 13.335)
    out = tmp_path / "cli"
    capsys.readouterr()
    got = _cli([cut, files["cut.mp3"]], out)
    damaged(got["cut_wav.wav"]["warnings"], 11.0)
    damaged(got["cut_mp3.mp3"]["warnings"], 13.335)
    err = capsys.readouterr().err
    assert "warning: " in err and "cut_wav.wav" in err and "declares 11.00 s" in err, err
    summary = [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()]
    assert all(any(w["code"] == "damaged_input" for w in r["warnings"]) for r in summary)
    for mode, server in servers.items():
        v, headers = _http(server, cut)
        assert "fellow americans" in " ".join(words(v["text"])), mode
        damaged(v["warnings"], 11.0)
        assert headers["x-flashasr-warnings"] == "damaged_input"
        text, headers = _http(server, cut, response_format="text")
        assert headers["x-flashasr-warnings"] == "damaged_input" and "fellow americans" in " ".join(words(text))
    # a whole file says nothing
    v, headers = _http(servers["single"], AUDIO / "en" / "en-jfk-inaugural.wav")
    assert "warnings" not in v and "x-flashasr-warnings" not in headers and v["language_probability"] == 1.0


# ----------------------------------------------------------------------------- 7. quiet speech between loud non-speech


def _interleaved(parts, gap_s: float = 0.5) -> tuple[np.ndarray, list, list, str]:
    """Shared clips with ``gap_s`` of digital silence between them: ``parts`` = clip paths (speech,
    whole) or (path, seconds, offset) (non-speech, looped). -> (samples, speech spans s, non-speech
    spans s, reference)."""
    ref = {c["path"]: c["reference"] for c in manifest()}
    xs, speech, other, refs, t = [], [], [], [], 0.0
    for p in parts:
        if isinstance(p, str):
            x = _clip(p)
            speech.append((t, t + x.size / SR))
            refs.append(ref[p])
        else:
            src = _clip(p[0])
            n, o = int(p[1] * SR), int(p[2] * SR)
            x = np.tile(src, -(-(n + o) // src.size))[o:o + n]
            other.append((t, t + x.size / SR))
        xs += [x, np.zeros(int(gap_s * SR), np.float32)]
        t += x.size / SR + gap_s
    return np.concatenate(xs), speech, other, " ".join(refs)


def test_quiet_sentences_between_loud_music_whale_song_and_noise_are_transcribed():
    """Issue #17's recording, shortened to 59 s: quiet FLEURS sentences (-64 to -67 dBFS) each 0.5 s
    after jazz (-19 dBFS), whale song (-9 dBFS) or noise (-26 dBFS). Silero's state, remembering the
    loud level, read the sentences at p < 0.02 (issue #17's recording lost them, and a piece that held
    a sentence's quiet end with the whale song's loud start gave the digit loop "1, 2, 4, 5, 4, 5");
    on this input tiny.en's recall was 0.43 (fleurs-004 lost). Now the VAD's input is level-normalised
    (docs/AUDIO.md section 6) and Whisper decodes each speech run as if alone (docs/WHISPER.md):
    recall 0.89 measured (0.8 asked), no number or digit, no word inside the non-speech, nothing cut.
    (With no gap at all, the first ~0.9 s of a sentence after loud audio is still missed.)"""
    from flashasr.eval import normalize, word_errors

    x, speech, other, ref = _interleaved([("hard/hard-music-vibe-ace.ogg", 12, 0), "en/en-fleurs-003.ogg",
                                          ("hard/hard-whale-humpback.ogg", 12, 0), "en/en-fleurs-007.ogg",
                                          ("hard/hard-noise-no-speech-8s.wav", 10, 0), "en/en-fleurs-004.ogg"])
    assert x.size / SR < 60
    t = flashasr.transcribe(x, sample_rate=SR, word_timestamps=True)
    e = word_errors(normalize(ref, "en"), normalize(t.text, "en"))
    recall = (e.ref_words - e.substitutions - e.deletions) / e.ref_words
    assert recall >= 0.8, t.text
    assert not any(ch.isdigit() for ch in t.text.replace("20th", "")), t.text  # "twentieth century" may be "20th"
    invented = [w.word for w in t.words if any(a + 0.5 < (w.start + w.end) / 2 < b - 0.5 for a, b in other)]
    assert invented == [], invented
    assert not t.warnings, t.warnings
