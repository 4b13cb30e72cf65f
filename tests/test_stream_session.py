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


def _committed(x: np.ndarray, packet: int, vad, max_utterance_s: float) -> tuple[list, list]:
    """Stream ``x`` in packets of ``packet`` samples (no pacing), commit; the committed spans (ms)
    and the finals (length:checksum of the audio each was given)."""

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        s = StreamSession(_Backend(), emit, input_rate=16000, vad=vad, partial_interval_ms=0,
                          max_utterance_s=max_utterance_s)
        pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
        for off in range(0, len(pcm), 2 * packet):
            await s.append_pcm16(pcm[off:off + 2 * packet])
        await s.vad_settled()
        if s.item_id is not None:
            await s.commit()
        await s.drain(60)
        return events

    events = asyncio.run(go())
    spans = [(e["audio_start_ms"], e["audio_end_ms"]) for e in events if e["type"] == "input_audio_buffer.committed"]
    finals = [e["transcript"] for e in events if e["type"].endswith("_transcription.completed")]
    return spans, finals


def test_one_huge_packet_is_cut_at_the_utterance_cap_like_small_ones():
    """Found by a new user: one packet of 44 s went into one utterance past ``--max-utterance-s``
    (30 s), and one of 16 MB at 8 kHz into one of 1,000 s, whose final then held up every stream's.
    A packet is now fed in pieces: without VAD the utterances are exactly those of 20 ms packets
    (cut at the cap, contiguous, every sample in one final); with server VAD none is longer than
    the cap plus one piece."""
    x = _speech()[: 16000 * 9 + 1234]
    small = _committed(x, 320, None, 2.0)
    huge = _committed(x, x.size, None, 2.0)
    assert huge == small
    spans = huge[0]
    assert len(spans) == 5 and all(b - a == 2000 for a, b in spans[:4]) and spans[-1][1] == round(x.size / 16)
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert sum(int(f.split(":")[0]) for f in huge[1]) == x.size
    spans, _ = _committed(_speech(), _speech().size, LazyVad(TD), 2.0)
    assert len(spans) >= 6 and all(b - a <= 2000 + 1000 * stream_mod.FEED_PIECE_S for a, b in spans), spans


def test_a_commit_right_after_the_utterance_cap_is_no_error_and_an_empty_one_still_is():
    """Found by a new user: a client that sent exactly the cap's worth of audio (manual commits)
    and committed got ``input_audio_buffer_commit_empty``: the cap had committed it all. That commit
    is now answered without an error (the item went out at the cap); an empty commit at the start,
    a second one, or one after audio that came after the cap behave as before."""
    from flashasr.errors import FlashASRError

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        s = StreamSession(_Backend(), emit, input_rate=16000, partial_interval_ms=0, max_utterance_s=1.0)
        codes = []

        async def commit():
            try:
                return await s.commit()
            except FlashASRError as e:
                codes.append(e.code)

        await commit()  # nothing received yet
        for _ in range(50):  # exactly 1 s in 20 ms packets: cut at the cap
            await s.append_pcm16(np.full(320, 1000, "<i2").tobytes())
        got = await commit()
        await commit()  # the second time: no cap since
        await s.append_pcm16(np.full(320, 1000, "<i2").tobytes())
        tail = await commit()
        for _ in range(50):  # to the cap again, then a clear: the commit after it is an empty one
            await s.append_pcm16(np.full(320, 1000, "<i2").tobytes())
        await s.clear()
        await commit()
        await s.drain(10)
        return events, codes, got, tail

    events, codes, got, tail = asyncio.run(go())
    assert codes == ["input_audio_buffer_commit_empty"] * 3
    assert got is None and tail is not None
    spans = [(e["audio_start_ms"], e["audio_end_ms"]) for e in events if e["type"] == "input_audio_buffer.committed"]
    assert spans == [(0, 1000), (1000, 1020), (1020, 2020)]


def test_a_client_gone_while_its_final_is_sent_leaves_no_unretrieved_task_error(caplog):
    """Found by a new user: a client that left right after its commit made asyncio log "Task
    exception was never retrieved" (the final's send raised). A session task's error is now taken
    when it ends: a client going away is not logged, any other error is, as a warning."""
    import gc
    import logging

    def run(err: BaseException) -> None:
        async def go():
            async def emit(ev):
                if ev["type"].endswith("_transcription.completed"):
                    raise err

            s = StreamSession(_Backend(), emit, input_rate=16000, partial_interval_ms=0)
            await s.append_pcm16(np.full(1600, 1000, "<i2").tobytes())
            await s.commit()
            for t in list(s._tasks):
                await asyncio.wait([t])

        asyncio.run(go())
        gc.collect()

    with caplog.at_level(logging.WARNING):
        run(ConnectionResetError("peer gone"))
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        run(ValueError("a server bug"))
    msgs = [r.getMessage() for r in caplog.records]
    assert any("a server bug" in m and "_final" in m for m in msgs), msgs
    assert not any("never retrieved" in m for m in msgs), msgs


def test_json_nested_past_the_parsers_depth_is_invalid_json():
    """Found by a new user: 100,000 nested brackets ended a Realtime session with no error event
    (RecursionError); it is an ``invalid_json`` error like any malformed event."""
    import pytest

    from flashasr.serve.errors import APIError
    from flashasr.serve.websocket import parse_event

    with pytest.raises(APIError) as e:
        parse_event("[" * 100_000 + "]" * 100_000, "event")
    assert e.value.code == "invalid_json" and "nested too deeply" in e.value.message


def test_server_vad_switched_on_mid_utterance_commits_the_buffered_audio():
    """Found by a new user: manual turns, 1.25 s of speech appended, then a session update to
    server VAD: the VAD started a new utterance at its next speech start and the 1.25 s were lost
    with no event. The buffered audio is now committed when server VAD comes on (every sample
    reaches a final); switching it off leaves the utterance open for the client's commit."""
    x = _speech()
    head = x[2 * 16000: 2 * 16000 + 20000]  # 1.25 s of speech

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        s = StreamSession(_Backend(), emit, input_rate=16000, partial_interval_ms=0)
        await s.append_pcm16((head * 32767).astype("<i2").tobytes())
        await s.set_vad(LazyVad(TD), TD["prefix_padding_ms"])
        n_committed = sum(e["type"] == "input_audio_buffer.committed" for e in events)
        await s.append_pcm16((x[:16000] * 32767).astype("<i2").tobytes())
        await s.set_vad(None)
        await s.append_pcm16((head * 32767).astype("<i2").tobytes())
        open_item = s.item_id
        await s.drain(30)
        return events, n_committed, open_item

    events, n_committed, open_item = asyncio.run(go())
    com = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert n_committed == 1 and (com[0]["audio_start_ms"], com[0]["audio_end_ms"]) == (0, 1250)
    finals = [e["transcript"] for e in events if e["type"].endswith("_transcription.completed")]
    assert finals[0].startswith(f"{head.size}:")  # the buffered audio, whole
    assert open_item is not None  # server VAD off: manual mode goes on with an open utterance


def test_turn_detection_resent_or_changed_mid_turn():
    """Found by a new user: the same server VAD settings sent again mid-turn replaced the VAD with a
    fresh one, which never saw the turn start and so never ended it (silence went on into the
    item). The same settings now keep the running VAD; other settings commit the open turn first.
    At another input rate the switch's commit keeps the resampler's last milliseconds."""
    x = _speech()
    speech, silence = x[2 * 16000: 2 * 16000 + 20000], np.zeros(3 * 16000, np.float32)

    def run(update: dict | None, rate: int = 16000):
        async def go():
            events = []

            async def emit(ev):
                events.append(ev)

            s = StreamSession(_Backend(), emit, input_rate=rate, vad=LazyVad(TD), partial_interval_ms=0)
            pcm = lambda a: (np.interp(np.arange(int(a.size * rate / 16000)) * 16000 / rate, np.arange(a.size), a)
                             * 32767).astype("<i2").tobytes()  # noqa: E731
            for off in range(0, speech.size, 320):
                await s.append_pcm16(pcm(speech[off:off + 320]))
            await s.vad_settled()
            old = s.vad
            if update is not None:
                await s.set_vad(LazyVad(update), update["prefix_padding_ms"])
            for off in range(0, silence.size, 320):
                await s.append_pcm16(pcm(silence[off:off + 320]))
            await s.vad_settled()
            await s.drain(30)
            return events, s.vad is old

        events, kept = asyncio.run(go())
        return [e["type"].rsplit(".", 1)[-1] for e in events if e["type"].startswith("input_audio_buffer.")], \
            [(e["audio_start_ms"], e["audio_end_ms"]) for e in events if e["type"] == "input_audio_buffer.committed"], kept

    ref, ref_spans, _ = run(None)
    assert ref == ["speech_started", "speech_stopped", "committed"]
    again, spans, kept = run(dict(TD))
    assert kept and (again, spans) == (ref, ref_spans)  # the same settings: the turn ends at the silence
    changed, spans, kept = run({**TD, "silence_duration_ms": 700})
    assert not kept and changed == ["speech_started", "committed"] and spans[0][1] >= 1250
    _, spans, _ = run({**TD, "silence_duration_ms": 700}, rate=24000)
    assert spans[0][1] >= 1250  # the resampler's tail is in the committed audio


def test_a_commit_between_the_two_bytes_of_a_sample_keeps_the_byte_stream_aligned():
    """Found by a new user: at an input rate other than 16 kHz, a commit that came after an odd
    number of bytes dropped the held half sample, so every later sample was read one byte off
    (full-scale noise in the next utterance's final). The half sample now waits for its other byte."""
    x = _speech()[2 * 16000: 5 * 16000]

    def finals(rate_pcm: bytes, rate: int, split: int) -> list:
        async def go():
            events = []

            async def emit(ev):
                events.append(ev)

            s = StreamSession(_Backend(), emit, input_rate=rate, partial_interval_ms=0)
            await s.append_pcm16(rate_pcm[:split])
            await s.commit()
            await s.append_pcm16(rate_pcm[split:])
            await s.commit()
            await s.drain(30)
            return [e["transcript"] for e in events if e["type"].endswith("_transcription.completed")]

        return asyncio.run(go())

    rate = 8000
    down = (np.interp(np.arange(x.size // 2) * 2, np.arange(x.size), x) * 20000).astype("<i2").tobytes()
    odd, even = finals(down, rate, 16001), finals(down, rate, 16000)
    n_odd, n_even = (int(f[1].split(":")[0]) for f in (odd, even))
    sums = [float(f[1].split(":")[1]) for f in (odd, even)]
    assert abs(n_odd - n_even) <= 8 and abs(sums[0] - sums[1]) < 0.05 * abs(sums[1]) + 1.0, (odd, even)


def test_a_sample_rate_change_mid_utterance_keeps_the_old_resamplers_tail():
    """Found by a new user: a session update of the input rate mid-utterance replaced the resampler
    without its held tail (up to 58 ms lost at each change). The tail is fed first now: 1 s at
    44.1 kHz then 1 s at 16 kHz commit as 2 s."""

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        s = StreamSession(_Backend(), emit, input_rate=44100, partial_interval_ms=0)
        await s.append_pcm16(np.full(44100, 1000, "<i2").tobytes())
        await s.set_rate(16000)
        await s.append_pcm16(np.full(16000, 1000, "<i2").tobytes())
        await s.commit()
        await s.drain(30)
        return [e for e in events if e["type"] == "input_audio_buffer.committed"]

    [com] = asyncio.run(go())
    assert abs(com["audio_end_ms"] - com["audio_start_ms"] - 2000) <= 2, com


def test_server_vad_items_do_not_share_audio():
    """Found by a new user: speech resuming right after a VAD commit (which ends ``silence_duration_ms``
    past the speech) started the next item ``prefix_padding_ms`` earlier, inside the committed one:
    about 0.3 s went to both finals. The next item now starts where the last one ended, at the earliest."""
    x = _speech()
    a = x[2 * 16000: 5 * 16000]  # 3 s of speech
    b = x[int(2.45 * 16000): 5 * 16000]  # the same speech from its first word (its item starts about 180 ms)

    async def go():
        events = []

        async def emit(ev):
            events.append(ev)

        s = StreamSession(_Backend(), emit, input_rate=16000, partial_interval_ms=0, vad=LazyVad(TD),
                          prefix_padding_ms=TD["prefix_padding_ms"])

        def n_committed():
            return sum(e["type"] == "input_audio_buffer.committed" for e in events)

        async def send(y, until_commit=False):
            pcm = (y * 32767).astype("<i2").tobytes()
            for i in range(0, len(pcm), 640):  # 20 ms packets
                await s.append_pcm16(pcm[i:i + 640])
                await s.vad_settled()
                if until_commit and n_committed():
                    return True
            return False

        await send(a)
        committed = await send(np.zeros(2 * 16000, np.float32), until_commit=True)  # silence until the VAD commits
        await send(np.concatenate([b, np.zeros(2 * 16000, np.float32)]))  # ... then speech at once
        await s.drain(30)
        return events, committed

    events, committed = asyncio.run(go())
    com = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert committed and len(com) == 2, com
    assert com[1]["audio_start_ms"] >= com[0]["audio_end_ms"], com
    assert com[1]["audio_start_ms"] - com[0]["audio_end_ms"] < 300  # the second item still starts at its speech
