"""bench/bench_faithful.py: its metrics on hand-made results, the generated recording's known spans,
and its --smoke run end to end (tiny.en, CLI, server and faster-whisper on a 37 s mixture)."""

from __future__ import annotations

import json
import sys
import wave

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import bench_faithful as bf  # noqa: E402


def test_repeats_counts_runs_of_more_than_three_equal_segments():
    segs = [{"text": t} for t in ["Hello.", "thank you", "Thank you.", "thank you!", "thank you", "bye", "", "bye"]]
    assert bf.repeats(segs) == (4, 4)  # 4 x "thank you"; the empty segment does not break "bye bye" (run 2)
    assert bf.repeats([{"text": "a"}, {"text": "b"}]) == (0, 1)
    assert bf.repeats([]) == (0, 0)


def test_invented_counts_word_midpoints_inside_spans_margin_in():
    spans = [{"what": "jazz", "start": 10.0, "end": 20.0}]
    words = [{"word": " you", "start": 10.2, "end": 10.4},  # midpoint 10.3: within the margin, not counted
             {"word": " you", "start": 12.0, "end": 12.4},  # counted
             {"word": " .", "start": 15.0, "end": 15.1},  # punctuation: no word
             {"word": " end", "start": 19.0, "end": 21.0}]  # midpoint 20.0: outside
    assert bf.invented(words, spans) == {"jazz": 1}


def test_the_mix_places_non_speech_where_it_says(tmp_path):
    clips = bf.manifest()
    mix = bf.build_mix(clips, tmp_path, bf.SMOKE_SPEECH, bf.SMOKE_NON_SPEECH, name="t")
    with wave.open(mix["path"]) as w:
        n = w.getnframes()
    assert abs(n / bf.SR - mix["duration_s"]) < 0.01
    assert [s["what"] for s in mix["non_speech"]] == ["hard-music-trumpet", "digital silence 15 s"]
    silence = mix["non_speech"][1]
    assert silence["end"] - silence["start"] == pytest.approx(15.0, abs=1e-3)
    assert mix["reference"].startswith("And so my fellow Americans")


@pytest.mark.slow
def test_smoke_run_writes_every_system(tmp_path):
    out = tmp_path / "smoke.json"
    assert bf.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    systems = {(r["system"], r["tree"]) for r in res["rows"]}
    assert systems == {("faster-whisper", None), ("cli", "after"), ("server", "after")}
    for r in res["rows"]:
        assert r["invented"] == 0 and r["recall"] > 80
