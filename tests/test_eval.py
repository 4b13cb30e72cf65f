"""WER evaluation: hand-computed WER on made-up strings, duplicate grouping on the real
manifest, and ``flashasr eval`` end to end on four real clips (with the faster-whisper peer)."""

from __future__ import annotations

import json
import random

import pytest

from conftest import AUDIO
from flashasr.eval import (corpus_wer, duplicate_groups, load_manifest, normalize, select_clips,
                           word_errors)


def _edit_distance(a: list[str], b: list[str]) -> int:
    """Plain Levenshtein distance over words (the reference the jiwer path is checked against)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def test_hand_computed_wer():
    # the cat sat on the mat -> the cat sit on mat today: 3 edits (S+D+I or 3 S), 6 words
    we = word_errors("the cat sat on the mat", "the cat sit on mat today")
    assert we.errors == 3 and we.ref_words == 6 and we.wer == pytest.approx(0.5)
    we = word_errors("one two three four five", "one three four for five six")  # D(two) S(five->for)? no:
    # one [two] three four (+for) five (+six): D1 I2 -> 3 errors / 5 words
    assert (we.substitutions, we.deletions, we.insertions) == (0, 1, 2) and we.wer == pytest.approx(3 / 5)
    assert word_errors("a b", "").wer == 1.0 and word_errors("", "").wer == 0.0
    assert word_errors("", "hallucinated words").insertions == 2
    # corpus WER pools errors: (3 + 0) / (6 + 2), not the mean of per-clip WERs
    assert corpus_wer([("the cat sat on the mat", "the cat sit on mat today"), ("hello world", "Hello, world!")]) \
        == pytest.approx(3 / 8)
    # the Whisper English normaliser: case, punctuation, spelled numbers, British spelling
    assert normalize("Mr. Smith paid Twenty-Five dollars, colour!", "en") == normalize("mister smith paid $25 color",
                                                                                      "en")
    assert normalize("Ça, c'est l'été!", "fr") == "ça c est l été"


def test_word_errors_match_levenshtein_on_random_strings():
    rnd = random.Random(1)
    vocab = "a b c d e f".split()
    for _ in range(300):
        r = [rnd.choice(vocab) for _ in range(rnd.randint(1, 9))]
        h = [rnd.choice(vocab) for _ in range(rnd.randint(0, 9))]
        assert word_errors(" ".join(r), " ".join(h)).errors == _edit_distance(r, h)


def test_duplicate_groups_on_the_manifest():
    clips = load_manifest(AUDIO / "manifest.jsonl")
    g = duplicate_groups(clips)
    assert g["hard-mp3-ls-1272-141231-0002"] == g["hard-flac-ls-1272-141231-0002"] == "en-ls-1272-141231-0002"
    assert g["hard-8k-timit"] == g["hard-stereo-44k-timit"] == "en-timit-ldc93s1"
    assert g["hard-48k-es-arenas"] == "es-picovoice-arenas"
    assert g["hard-stereo-44k-jfk"] == g["hard-m4a-44k-jfk"] == "en-jfk-inaugural"
    assert len({g[c["id"]] for c in clips if "one-two-three" in c["id"]}) == 1
    reps = {v for v in g.values()}
    assert len(reps) == len(clips) - 12  # 12 clips are another format of a recording already there
    assert g["en-fleurs-000"] == "en-fleurs-000" and g["hard-short-yes"] == "hard-short-yes"
    assert g["en-vctk-p226-001"] == "en-vctk-p226-001"  # same sentence, another speaker: not a duplicate
    sel = select_clips(clips, categories=["en_read", "hard"], language="en")
    assert all(c["reference"] is not None for c in sel)
    assert {c["category"] for c in sel} == {"en_read", "hard"}
    assert all(c["language"] == "en" or c["reference"] == "" for c in sel)
    assert sum(c["reference"] == "" for c in sel) == 8


def test_eval_cli_end_to_end_with_peer(tmp_path, capsys):
    from flashasr.cli import main

    ids = "en-ls-61-70968-0002,en-timit-ldc93s1,hard-8k-timit,hard-silence-1s"
    out = tmp_path / "wer.json"
    rc = main(["eval", "--manifest", str(AUDIO / "manifest.jsonl"), "--ids", ids, "--peer", "faster-whisper",
               "--json-out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    d = json.loads(out.read_text())
    rows = {r["id"]: r for r in d["clips"]}
    assert set(rows) == set(ids.split(","))
    assert rows["hard-8k-timit"]["duplicate_of"] == "en-timit-ldc93s1" and not rows["hard-8k-timit"]["counted"]
    assert rows["hard-silence-1s"]["reference_words"] == 0
    for system in ("ours", "peer"):
        assert rows["en-ls-61-70968-0002"][system]["wer"] == 0.0, rows["en-ls-61-70968-0002"][system]
        # recompute the aggregate independently: counted clips with speech, pooled edit distance
        errs = words = 0
        for r in d["clips"]:
            if r["counted"] and r["reference_words"]:
                ref = r["reference_normalized"].split()
                hyp = r[system]["hypothesis_normalized"].split()
                assert r[system]["errors"] == _edit_distance(ref, hyp)
                errs += _edit_distance(ref, hyp)
                words += len(ref)
        agg = d["summary"][system]
        assert agg["reference_words"] == words and agg["clips_counted"] == 2
        assert agg["wer"] == pytest.approx(round(100 * errs / words, 2))
        ns = agg["no_speech"]
        assert ns["clips"] == 1 and ns["hallucinated_words"] == rows["hard-silence-1s"][system]["hypothesis_words"]
    assert d["summary"]["conditions"]["peer_settings"]["beam_size"] == 1
    assert "faster-whisper (float32): WER" in text and "ours (whisper-tiny.en): WER" in text


@pytest.mark.parametrize("args, code", [(["--batch-size", "0"], "invalid_request"),
                                        (["--device", "cpu:1"], "invalid_device"),
                                        (["--limit", "-1"], "invalid_request"),
                                        (["--limit", "0"], "invalid_request"),
                                        (["--threads", "0"], "invalid_request"),
                                        (["--json-out", "/proc/flashasr-eval.json"], "output_invalid")])
def test_eval_refuses_bad_arguments_as_transcribe_does(capsys, args, code):
    """A job argument the runner refuses or a malformed device: `flashasr eval` says
    ``error: [code] ...`` (as `flashasr transcribe`), exit 2, no traceback (``...Error:``)."""
    from flashasr.cli import main

    rc = main(["eval", "--manifest", str(AUDIO / "manifest.jsonl"), "--ids", "en-vctk-p225-001", *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: [{code}] ") and "Error:" not in err, err


def test_eval_refuses_empty_ids(capsys):
    """``--ids ''`` names no clip: refused (it used to evaluate the whole manifest)."""
    from flashasr.cli import main

    rc = main(["eval", "--manifest", str(AUDIO / "manifest.jsonl"), "--ids", ""])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: [invalid_request] ") and "--ids" in err, err


def test_eval_warns_about_unknown_ids(capsys):
    """``--ids A,typo``: the unknown id is named on stderr (the known clip still runs)."""
    import flashasr.eval as ev

    called = {}

    def fake_select(clips, **kw):  # stop before any model work: the warning comes first
        called["ids"] = kw["ids"]
        return []

    orig = ev.select_clips
    ev.select_clips = fake_select
    try:
        from flashasr.cli import main

        rc = main(["eval", "--manifest", str(AUDIO / "manifest.jsonl"), "--ids", "en-vctk-p225-001,no-such-clip"])
    finally:
        ev.select_clips = orig
    err = capsys.readouterr().err
    assert "warning: --ids names no clip of the manifest: no-such-clip" in err, err
    assert called["ids"] == ["en-vctk-p225-001", "no-such-clip"] and rc == 2


def test_a_peer_compute_type_is_named_when_refused(capsys):
    """An unknown compute type is an argument error; one this machine cannot run is named as the
    compute type, not as the model failing to load."""
    from flashasr.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--manifest", str(AUDIO / "manifest.jsonl"), "--peer", "faster-whisper",
              "--peer-compute-type", "bogus"])
    assert "argument --peer-compute-type: invalid choice: 'bogus'" in capsys.readouterr().err
    pytest.importorskip("faster_whisper")
    import torch

    if torch.cuda.is_available():
        pytest.skip("float16 runs on a GPU")
    rc = main(["eval", "--manifest", str(AUDIO / "manifest.jsonl"), "--peer", "faster-whisper",
               "--peer-compute-type", "float16", "--limit", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: [invalid_option] --peer-compute-type float16: ")
    assert "cannot load model" not in err


def test_a_failed_clip_says_why_on_stderr(tmp_path, capsys):
    """A clip that cannot be decoded shows FAILED in the table and its reason on a `failed:` line
    (before, only the JSON had it); the others are evaluated, exit code 1."""
    from flashasr.cli import main

    good = next(c for c in load_manifest(AUDIO / "manifest.jsonl") if c["id"] == "en-ls-61-70968-0002")
    good = {k: v for k, v in good.items() if k != "abs_path"}
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF not really a wave file")
    entries = [dict(good, path=str(AUDIO / good["path"])),
               dict(good, id="junk-clip", path=str(junk), sha256=None)]
    man = tmp_path / "m.jsonl"
    man.write_text("".join(json.dumps(e) + "\n" for e in entries))
    rc = main(["eval", "--manifest", str(man)])
    cap = capsys.readouterr()
    assert rc == 1 and "FAILED" in cap.out
    fails = [l for l in cap.err.splitlines() if l.startswith("failed:")]
    assert len(fails) == 1 and fails[0].startswith("failed: junk-clip (ours): [unsupported_format] ")
    assert "not a readable audio file" in fails[0] and fails[0].count("junk-clip") == 1
