"""A live session's server VAD off the receive loop (serve/stream.py): a VAD that falls behind
never blocks the socket for long, and the utterances come out as if every packet had been handled
on arrival."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
from conftest import AUDIO

from flashasr.audio import load_audio
from flashasr.serve import stream as stream_mod
from flashasr.serve.stream import LazyVad, StreamSession, VadBatcher

TD = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}


class _Backend:
    """Finals name the audio they were given (its length and a checksum)."""

    async def transcribe(self, samples, options, **kw):
        return SimpleNamespace(text=f"{len(samples)}:{float(np.sum(samples)):.4f}")


def _speech() -> np.ndarray:
    a = load_audio(AUDIO / "en/en-jfk-inaugural.wav").samples[: 16000 * 6]
    b = load_audio(AUDIO / "en/en-ls-1272-141231-0002.wav").samples[: 16000 * 5]
    gap = np.zeros(16000 * 2, np.float32)
    return np.concatenate([gap, a, gap, b, gap, a, gap])


def _run(x: np.ndarray, vad_delay_s: float, keep_up: bool = False) -> tuple[list, float, int]:
    real_feed = VadBatcher.feed
    calls = [0]

    async def slow_feed(self, vad, chunk):
        calls[0] += 1
        await asyncio.sleep(vad_delay_s)
        return await real_feed(self, vad, chunk)

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        VadBatcher.feed = slow_feed
        try:
            s = StreamSession(_Backend(), emit, input_rate=16000, vad=LazyVad(TD), partial_interval_ms=0)
            pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
            t0 = time.perf_counter()
            for off in range(0, len(pcm), 640):  # 20 ms packets, as fast as the session takes them
                await s.append_pcm16(pcm[off:off + 640])
                if keep_up:  # each packet through the VAD before the next one arrives
                    await s.vad_settled()
            took = time.perf_counter() - t0
            await s.drain(60)
        finally:
            VadBatcher.feed = real_feed
        return events, took

    events, took = asyncio.run(go())
    keep = ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed", "conversation.item.input_audio_transcription.completed")
    by_type = {t: [{k: v for k, v in e.items() if k not in ("item_id", "previous_item_id", "event_id")}
                   for e in events if e["type"] == t] for t in keep}  # finals may interleave otherwise
    return by_type, took, calls[0]


def test_a_slow_server_vad_does_not_block_the_stream_and_changes_no_utterance(monkeypatch):
    x = _speech()
    packets = -(-len(x) // 320)
    ref, _, ref_calls = _run(x, 0.0, keep_up=True)
    assert ref_calls == packets  # a VAD that keeps up: one VAD call per packet
    assert len(ref["conversation.item.input_audio_transcription.completed"]) >= 3
    got, took, calls = _run(x, 0.05)  # a VAD 2.5x slower than real time per packet
    assert got == ref  # same speech starts and stops, same utterance audio in every final
    assert calls < packets / 20  # the packets that arrived meanwhile went through together
    assert took < packets * 0.05 / 10  # the receive loop was not held once per packet

    monkeypatch.setattr(stream_mod, "VAD_BACKLOG_S", 0.5)  # the backlog bound holds the loop back
    got, took, calls = _run(x, 0.05)
    assert got == ref
    assert calls >= len(x) / 16000 / 0.5 * 0.9


class _StuckBackend(_Backend):
    """Every second final never comes (a model that the stop leaves no time), the others at once."""

    def __init__(self):
        self.calls = 0

    async def transcribe(self, samples, options, **kw):
        self.calls += 1
        if self.calls % 2 == 0:
            await asyncio.Event().wait()
        return await super().transcribe(samples, options, **kw)


def test_finish_delivers_committed_finals_and_fails_the_late_ones_naming_the_shutdown():
    """``StreamSession.finish`` (the server is stopping): a committed final that comes in time goes
    out, also one made in time behind one that is not; one still being made when the time is up gets
    ``...failed`` with 503 'the server is shutting down'; every committed item gets exactly one of
    the two, in commit order; nothing after."""

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        s = StreamSession(_StuckBackend(), emit, input_rate=16000, partial_interval_ms=0)
        items = []
        for _ in range(4):
            await s.append_pcm16(np.full(1600, 1000, "<i2").tobytes())
            items.append(await s.commit())
        t0 = time.perf_counter()
        await s.finish(0.3)
        took = time.perf_counter() - t0
        await s.close()
        await asyncio.sleep(0.05)  # nothing comes after the stop
        return items, events, took

    items, events, took = asyncio.run(go())
    ends = [e for e in events if e["type"].endswith(("_transcription.completed", "_transcription.failed"))]
    assert [(e["item_id"], e["type"].rsplit(".", 1)[1]) for e in ends] == \
        [(items[0], "completed"), (items[1], "failed"), (items[2], "completed"), (items[3], "failed")], ends
    assert ends[1]["error"] == {"message": "the server is shutting down", "type": "server_error", "param": None,
                                "code": "engine_unavailable"}
    assert took < 5  # bounded by the time given, not by the stuck model
