"""Cost per stream is flat in utterance length: encoder frames COUNTED per second of audio streamed.

A :class:`~flashasr.serve.stream.StreamSession` on the real single-mode backend (its scheduler, the
model thread, the NeMo-made tiny Parakeet-TDT) streams 5, 30 and 120 s utterances of real speech
in 20 ms packets with a partial every 500 ms of audio, then commits; the server keeps up (each
partial finishes before the next packet). Counted: encoder frames through the Conformer layers,
by the streamer (chunked partials) and by the model's offline encoder (re-encoded partials and
every final). Today's re-encoded partials grow with the utterance (each re-encodes it so far);
chunked partials encode each frame once, so partials + final stay within the issue's budget of
2 audio-seconds of encoder work per audio-second streamed, for every length.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import AUDIO, PARAKEET_FIXTURES
from flashasr.models.parakeet.model import load_parakeet
from flashasr.serve.backend import LocalBackend
from flashasr.serve.config import ServeConfig
from flashasr.serve.stream import StreamSession

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py
BUDGET = 2.0  # audio-seconds of encoder work per audio-second streamed, the final included (issue 13)


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """Real English speech (LibriSpeech / LibriVox WAVs of the shared audio), joined, >= 120 s."""
    import wave

    parts, n = [], 0
    for f in sorted((AUDIO / "en").glob("*.wav")):
        with wave.open(str(f)) as w:
            if w.getframerate() != 16000 or w.getnchannels() != 1:
                continue
            x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
        parts.append(x)
        n += x.size
        if n >= 121 * 16000:
            break
    a = np.concatenate(parts)
    while a.size < 121 * 16000:
        a = np.concatenate([a, a])
    return a


def _pcm(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2")


def stream_cost(partials: str, audio: np.ndarray) -> dict:
    """Stream ``audio`` through one session (no VAD, commit at the end); encoder frames counted."""
    model = load_parakeet(PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo")
    cfg = ServeConfig(model="tiny", stream_partials=partials, partial_interval_ms=500, max_utterance_s=130,
                      gc_freeze=False, warmup=False)
    events = []

    async def emit(ev):
        events.append(ev)

    async def go():
        backend = LocalBackend(cfg, pool=None, model=model)
        await backend.start()
        assert await backend.wait_ready(30)
        s = StreamSession(backend, emit, input_rate=16000, partial_interval_ms=500, max_utterance_s=130,
                          chunked=backend.info["stream_partials"] == "chunked")
        pcm = _pcm(audio).tobytes()
        for off in range(0, len(pcm), 640):  # 20 ms packets
            await s.append_pcm16(pcm[off:off + 640])
            while s._partial_task is not None and not s._partial_task.done():  # the server keeps up
                await s._partial_task
        await s.commit()
        await s.drain(120)
        streamer = backend.scheduler.streamer
        await backend.stop()
        return streamer

    streamer = asyncio.run(go())
    audio_s = len(audio) / 16000
    partial_frames = streamer.counters["encoder_frames"] if streamer else 0
    offline_frames = model.work["encoder_frames"]  # re-encoded partials and the final
    final_frames = model.encoder_frames_of(len(audio))
    n_partials = sum(1 for e in events if e["type"].endswith(".delta")) if streamer else None
    assert events[-1]["type"] == "conversation.item.input_audio_transcription.completed"
    return {"audio_s": audio_s, "work": (partial_frames + offline_frames) * model.frame_seconds / audio_s,
            "partial_work": (partial_frames + offline_frames - final_frames) * model.frame_seconds / audio_s,
            "final_frames": final_frames, "offline_calls": model.work["encoder_calls"], "deltas": n_partials,
            "final": events[-1]["transcript"], "streamer": dict(streamer.counters) if streamer else None}


def test_chunked_partials_cost_is_flat_and_within_budget(speech):
    got = {sec: stream_cost("chunked", speech[: sec * 16000]) for sec in (5, 30, 120)}
    for sec, r in got.items():
        print(f"chunked {sec:3d} s: {r['work']:.3f} audio-s of encoder work per audio-s "
              f"(partials {r['partial_work']:.3f}), offline encoder calls {r['offline_calls']}, {r['streamer']}")
        assert r["offline_calls"] == 1  # the final only: partials never re-encode
        assert 0.8 <= r["partial_work"] <= 1.0  # each frame once (the tail after the last partial: the final's)
        assert r["work"] <= BUDGET
        c = r["streamer"]
        assert c["subsampling_frames"] <= 1.2 * c["encoder_frames"]  # one overlap frame per chunk of ~6
    works = [r["work"] for r in got.values()]
    assert max(works) - min(works) <= 0.1  # flat in utterance length
    # the final is the offline transcript of the same audio, whatever the partials did
    model = load_parakeet(PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo")
    sent = _pcm(speech[: 30 * 16000]).astype(np.float32) / 32768  # exactly the samples the session got
    assert got[30]["final"] == model.transcribe_waveform(sent).text.strip()


def test_reencoded_partials_cost_grows_with_utterance_length(speech):
    """Today's path (``--stream-partials reencode``, still Whisper's): each partial re-encodes the
    utterance so far. 120 s is left out here (about 240 partials re-encoding 60 s on average:
    minutes on the CI machine); the growth shows between 5 and 30 s."""
    r5, r30 = stream_cost("reencode", speech[: 5 * 16000]), stream_cost("reencode", speech[: 30 * 16000])
    print(f"reencode   5 s: {r5['work']:.2f} audio-s per audio-s ({r5['offline_calls']} encoder calls)")
    print(f"reencode  30 s: {r30['work']:.2f} audio-s per audio-s ({r30['offline_calls']} encoder calls)")
    assert r5["work"] > BUDGET and r30["work"] > 4 * r5["work"]
    assert r30["offline_calls"] >= 55  # a partial every 500 ms, and the final
