"""Response renderers (OpenAI transcription response shapes) on a constructed transcript."""

import json

import pytest

from flashasr.errors import FlashASRError
from flashasr.formats import render
from flashasr.types import Segment, Transcript, Word


def _t(lang="en"):
    segs = [Segment(0, 0.0, 1.5, " Hello there."), Segment(1, 1.5, 3661.2345, " General Kenobi!")]
    words = [Word(" Hello", 0.0, 0.5), Word(" there.", 0.5, 1.5)]
    return Transcript(" Hello there. General Kenobi!", lang, 3700.0, segs, words)


def test_text_and_json():
    assert render(_t(), "text") == "Hello there. General Kenobi!\n"
    assert json.loads(render(_t(), "json")) == {"text": "Hello there. General Kenobi!"}


def test_verbose_json_names_language_and_words():
    d = json.loads(render(_t(), "verbose_json"))
    assert d["language"] == "english" and d["duration"] == 3700.0 and d["task"] == "transcribe"
    assert [s["id"] for s in d["segments"]] == [0, 1] and d["words"][1] == {"word": "there.", "start": 0.5, "end": 1.5}
    assert json.loads(render(_t("pt"), "verbose_json"))["language"] == "portuguese"
    assert json.loads(render(_t(None), "verbose_json"))["language"] is None
    assert "words" not in json.loads(render(_t(), "verbose_json", words=False))


def test_srt_and_vtt_timestamps():
    srt = render(_t(), "srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n")
    assert "2\n00:00:01,500 --> 01:01:01,234\nGeneral Kenobi!" in srt
    vtt = render(_t(), "vtt")
    assert vtt.startswith("WEBVTT\n") and "00:00:01.500 --> 01:01:01.234\nGeneral Kenobi!" in vtt


def test_unknown_format_is_a_clear_error():
    with pytest.raises(FlashASRError) as e:
        render(_t(), "docx")
    assert e.value.code == "unsupported_response_format" and e.value.status == 400 and "docx" in str(e.value)
