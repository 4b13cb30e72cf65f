"""TranscribeOptions and ModelCapabilities: one options object, validated once for syntax and once
against the model, the same rule at every door."""

from __future__ import annotations

import math

import pytest

from conftest import PARAKEET_FIXTURES
from flashasr.errors import InvalidRequestError, UnsupportedLanguageError, UnsupportedTaskError
from flashasr.options import ModelCapabilities, TranscribeOptions, normalize_language

ENGLISH_ONLY = ModelCapabilities(name="tiny", family="whisper", window_s=30.0, long_form=True,
                                 languages=frozenset({"en"}))
MULTI = ModelCapabilities(name="base", family="whisper", window_s=30.0, long_form=True,
                          languages=frozenset({"en", "de", "fr"}), multilingual=True, translates=True)
PARAKEET = ModelCapabilities(name="pk", family="parakeet", window_s=60.0)


@pytest.mark.parametrize("given, code", [("en", "en"), ("EN", "en"), (" de ", "de"), ("en-US", "en"),
                                         ("pt_BR", "pt"), ("German", "de"), ("haitian creole", "ht"),
                                         ("yue", "yue"), ("", None), ("  ", None), (None, None)])
def test_one_language_rule(given, code):
    assert normalize_language(given) == code
    assert TranscribeOptions(language=given).language == code


@pytest.mark.parametrize("bad", ["xx", "english!", "e", "klingon", "en-", 7, "zz-ZZ"])
def test_a_language_that_is_not_a_code_is_named(bad):
    with pytest.raises(InvalidRequestError) as e:
        TranscribeOptions(language=bad)
    assert e.value.code == "invalid_request" and e.value.status == 400 and e.value.param == "language"
    assert "language" in str(e.value) and ("ISO 639-1" in str(e.value) or "string" in str(e.value))


def test_syntax_errors_name_their_option():
    with pytest.raises(UnsupportedTaskError, match="task must be one of") as e:
        TranscribeOptions(task="summarise")
    assert e.value.code == "invalid_request" and e.value.param == "task"
    with pytest.raises(InvalidRequestError, match="segmentation") as e:
        TranscribeOptions(segmentation="silence")
    assert e.value.param == "segmentation"
    for bad in (0, 0.001, 0.999, -1.0, math.nan, math.inf, "abc", True):
        with pytest.raises(InvalidRequestError, match="max_segment_s") as e:
            TranscribeOptions(max_segment_s=bad)
        assert e.value.param == "max_segment_s"
    with pytest.raises(InvalidRequestError, match="word_timestamps"):
        TranscribeOptions(word_timestamps="yes")
    assert TranscribeOptions(max_segment_s="12.5").max_segment_s == 12.5
    assert TranscribeOptions(max_segment_s=1).max_segment_s == 1.0
    assert TranscribeOptions(segmentation=" VAD ").segmentation == "vad"  # any case, at every door
    with pytest.raises(InvalidRequestError) as e:
        TranscribeOptions(language="x" * 5000)
    assert len(str(e.value)) < 300  # errors never echo a whole payload


def test_frozen_hashable_and_round_trips():
    a = TranscribeOptions(language="DE", word_timestamps=True, segmentation="fixed", max_segment_s=20)
    b = TranscribeOptions.from_dict(a.to_dict())
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.language = "fr"  # type: ignore[misc]
    assert TranscribeOptions.build(a, task="translate").task == "translate" and a.task == "transcribe"
    assert TranscribeOptions.build(None) == TranscribeOptions()
    with pytest.raises(TypeError):
        TranscribeOptions.build(a, beam_size=5)
    with pytest.raises(InvalidRequestError, match="unknown option"):
        TranscribeOptions.from_dict({"language": "en", "beam_size": 5})
    assert TranscribeOptions.from_dict(None) == TranscribeOptions()


def test_decoding_key_ignores_the_pipelines_fields():
    a = TranscribeOptions(language="en", segmentation="vad")
    b = TranscribeOptions(language="en", segmentation="none", max_segment_s=10)
    assert a.decoding == b.decoding and a != b
    assert a.decoding != TranscribeOptions(language="en", word_timestamps=True).decoding


def test_resolve_asks_the_model():
    with pytest.raises(UnsupportedLanguageError, match="English-only") as e:
        TranscribeOptions(language="de").resolve(ENGLISH_ONLY)
    assert e.value.code == "unsupported_language" and e.value.status == 400 and e.value.param == "language"
    with pytest.raises(UnsupportedLanguageError, match="not supported by base"):
        TranscribeOptions(language="ja").resolve(MULTI)
    with pytest.raises(UnsupportedTaskError, match=r"model 'tiny' \(whisper\) cannot translate") as e:
        TranscribeOptions(task="translate").resolve(ENGLISH_ONLY)
    assert e.value.code == "unsupported_task"
    with pytest.raises(UnsupportedTaskError, match=r"\(parakeet-tdt\)"):
        TranscribeOptions(task="translate").resolve(PARAKEET)
    assert TranscribeOptions(language="de", task="translate").resolve(MULTI).task == "translate"
    assert TranscribeOptions(language="ja").resolve(PARAKEET).language == "ja"  # the hint does not steer it
    # the window: filled when unset, clamped when larger, kept when smaller; resolving twice changes nothing
    assert TranscribeOptions().resolve(PARAKEET).max_segment_s == 60.0
    assert TranscribeOptions(max_segment_s=90).resolve(ENGLISH_ONLY).max_segment_s == 30.0
    r = TranscribeOptions(max_segment_s=12).resolve(ENGLISH_ONLY)
    assert r.max_segment_s == 12.0 and r.resolve(ENGLISH_ONLY) == r
    assert r.language is None  # the options say what the caller asked; the model's own language is the merger's


def test_capabilities_round_trip_and_real_models():
    c = ModelCapabilities.from_dict(MULTI.to_dict())
    assert c == MULTI and isinstance(c.languages, frozenset)
    assert ModelCapabilities.from_dict({**PARAKEET.to_dict(), "future_field": 1}) == PARAKEET

    import flashasr

    w = flashasr.load_model("tiny.en").capabilities
    assert (w.family, w.window_s, w.long_form, w.languages, w.translates) == ("whisper", 30.0, True,
                                                                              frozenset({"en"}), False)
    p = flashasr.load_model(str(PARAKEET_FIXTURES / "tiny-tdt" / "model.nemo")).capabilities
    assert (p.family, p.long_form, p.languages, p.translates) == ("parakeet", False, None, False)
    assert p.window_s == 60.0
