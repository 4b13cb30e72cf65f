"""Job runner tests: input expansion and output naming, merging, resume journal, cross-file
batching routes results back correctly (batched == per-file), bad inputs are reported.

These use a deterministic stand-in model (its text is a hash of the waveform it gets) so
they test the plumbing fast and exactly; tests/test_cli.py runs the real tiny.en model.
"""

from __future__ import annotations

import json
import os
import sys
import time
import wave
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import AUDIO
from flashasr.jobs import InputError, Summary, atomic_write_text, expand_inputs, read_manifest, run_job
from flashasr.models.base import ASRModel
from flashasr.options import TranscribeOptions
from flashasr.pipeline import merge_pieces
from flashasr.types import Segment, Transcript, Word

SR = 16000


class HashModel(ASRModel):
    """Text = hash of the waveform + its length: any mis-routed piece changes a file's text."""

    name = "hash-model"
    family = "whisper"
    max_segment_seconds = 30.0

    def __init__(self, fail_len: int | None = None):
        self.batches: list[int] = []
        self.fail_len = fail_len

    def _one(self, w, options: TranscribeOptions) -> Transcript:
        if self.fail_len is not None and len(w) == self.fail_len:
            raise RuntimeError("boom")
        d = len(w) / SR
        h = zlib.crc32(np.asarray(w, np.float32).tobytes()) % 100000
        txt = f" h{h} n{len(w)}"
        words = [Word(" h", 0.0, d / 2), Word(" n", d / 2, d)] if options.word_timestamps else None
        return Transcript(text=txt, language=options.language or "en", duration=d,
                          segments=[Segment(0, 0.0, d, txt)], words=words)

    def _transcribe(self, ws, options):
        self.batches.append(len(ws))
        return [self._one(w, options) for w in ws]


def fixed_split(samples, sr, max_s, method):
    n = int(max_s * sr)
    return [(a, min(a + n, len(samples))) for a in range(0, len(samples), n)]


def _write_wav(path: Path, x: np.ndarray, sr: int = SR) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


# ------------------------------------------------------------------ inputs and naming

def test_expand_inputs_dirs_globs_files_and_unique_keys(tmp_path):
    for rel in ("a/clip.wav", "b/clip.wav", "b/deeper/x.flac", "c/notes.txt", "c/y.MP3"):
        p = tmp_path / "in" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    items = expand_inputs([tmp_path / "in"])
    keys = {it.key for it in items}
    assert keys == {"a/clip", "b/clip", "b/deeper/x", "c/y"}  # .txt not picked from a folder
    # the same base name given as two files -> hashed, distinct keys
    two = expand_inputs([tmp_path / "in/a/clip.wav", tmp_path / "in/b/clip.wav"])
    assert len({t.key for t in two}) == 2 and all(t.key.startswith("clip-") for t in two)
    # deterministic
    assert [t.key for t in two] == [t.key for t in expand_inputs([tmp_path / "in/a/clip.wav",
                                                                   tmp_path / "in/b/clip.wav"])]
    # glob: relative to the non-wildcard prefix; a file named directly is kept whatever its extension
    g = expand_inputs([str(tmp_path / "in" / "*" / "*.wav"), tmp_path / "in/c/notes.txt"])
    assert [t.key for t in g] == ["a/clip", "b/clip", "notes"]
    # the same file twice is kept once
    assert len(expand_inputs([tmp_path / "in/a/clip.wav", tmp_path / "in/a"])) == 1
    with pytest.raises(InputError) as e:
        expand_inputs([tmp_path / "nope.wav"])
    assert e.value.code == "input_not_found"
    with pytest.raises(InputError):
        expand_inputs([str(tmp_path / "in" / "*.nothing")])
    missing: list = []  # collect instead of raising: the other inputs still expand
    got = expand_inputs([tmp_path / "nope.wav", tmp_path / "in/a/clip.wav", str(tmp_path / "*.nothing")],
                        missing=missing)
    assert [t.path.name for t in got] == ["clip.wav"]
    assert [e.code for e in missing] == ["input_not_found"] * 2 and "nope.wav" in str(missing[0])


def test_folder_walk_equals_the_pathlib_reference(tmp_path, monkeypatch):
    """A folder's files are listed with string operations (no pathlib object per file, for folders
    of many thousands); paths, keys and the names shown equal what pathlib gives, for awkward
    names, hidden files, several dots, upper-case suffixes, spaces and non-ASCII, and for the
    folder given as ".", "./x", "x/", relative and absolute."""
    from flashasr.jobs.inputs import AUDIO_EXTENSIONS, _safe_key, _strip_ext

    names = ["a.wav", "B.MP3", ".hidden.flac", "two.dots.ogg", "no_suffix", "trailing.", ".wav",
             "sp ace.m4a", "ünï.opus", "notes.txt", "x.wav.txt", "deep/er/z.WAV", "deep/.d/y.mp3",
             "d.ir/v.wav", "..triple.wav", "..wav", "...wav", "deep/..wav"]
    root = tmp_path / "in"
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(b"x")

    def reference(p: Path) -> list[tuple]:
        out = []
        for r, dirs, files in os.walk(p):
            dirs.sort()
            for f in sorted(files):
                q = Path(r) / f
                if q.suffix.lower() in AUDIO_EXTENSIONS:  # the pathlib code this replaced
                    key = _safe_key(_strip_ext(q.relative_to(p).as_posix()))
                    out.append((Path(os.path.abspath(q)), key, str(q)))
        return out

    monkeypatch.chdir(tmp_path)
    for given in (root, str(root) + "/", "in", "./in", "in/"):
        got = [(it.path, it.key, it.display) for it in expand_inputs([given])]
        assert got == reference(Path(given).expanduser()), given
        assert len(got) == 13
    monkeypatch.chdir(root)
    got = [(it.path, it.key, it.display) for it in expand_inputs(["."])]
    assert got == reference(Path(".")) and ("ünï", "ünï.opus") in [(k, d) for _, k, d in got]
    keys = {d: k for _, k, d in got}  # a stem of dots takes the key rule's: "." dropped, ".." -> "__"
    assert (keys["..wav"], keys["...wav"], keys["deep/..wav"]) == ("audio", "__", "deep")


def test_manifest_relative_paths_resolve_against_its_folder(tmp_path):
    sub = tmp_path / "data"
    sub.mkdir()
    (sub / "m.jsonl").write_text(
        json.dumps({"audio_filepath": "x/one.wav", "language": "de"}) + "\n\n"
        + json.dumps({"path": str(AUDIO / "en/en-jfk-inaugural.wav")}) + "\n")
    items = read_manifest(sub / "m.jsonl")
    assert items[0].path == sub / "x/one.wav" and items[0].language == "de" and items[0].key == "x/one"
    assert items[1].path == AUDIO / "en/en-jfk-inaugural.wav" and items[1].key == "en-jfk-inaugural"
    (sub / "bad.jsonl").write_text('{"text": "no path"}\n')
    with pytest.raises(InputError) as e:
        read_manifest(sub / "bad.jsonl")
    assert e.value.code == "invalid_manifest" and "line 1" in str(e.value)


# ------------------------------------------------------------------ merge

def test_merge_offsets_clip_and_join():
    a = Transcript(" Hello there.", "en", 2.0, [Segment(0, 0.0, 1.5, " Hello there.")],
                   words=[Word(" Hello", 0.1, 0.5), Word(" there.", 0.6, 1.4)])
    b = Transcript(" General Kenobi.", "en", 2.0, [Segment(0, 0.2, 2.5, " General Kenobi.")],
                   words=[Word(" General", 0.2, 0.9)])
    empty = Transcript("", None, 1.0, [])
    t = merge_pieces([(0.0, a), (3.0, empty), (10.0, b)], duration=12.0,
                     options=TranscribeOptions(word_timestamps=True))
    assert t.text == "Hello there. General Kenobi."
    assert [s.id for s in t.segments] == [0, 1]
    assert t.segments[1].start == pytest.approx(10.2) and t.segments[1].end == 12.0  # clipped to duration
    assert [w.start for w in t.words] == pytest.approx([0.1, 0.6, 10.2])
    assert t.language == "en" and t.duration == 12.0


# ------------------------------------------------------------------ journal

def test_atomic_write_and_summary_resume_rules(tmp_path):
    src = tmp_path / "in.wav"
    src.write_bytes(b"abc")
    out = tmp_path / "out"
    n = atomic_write_text(out / "x.txt", "héllo\n")
    assert (out / "x.txt").read_text() == "héllo\n" and n == len("héllo\n".encode())
    assert not [p for p in out.iterdir() if "tmp" in p.name]
    s = Summary(out)
    st = src.stat()
    rec = {"path": str(src), "status": "ok", "output": "x.txt", "output_bytes": n, "input_size": st.st_size,
           "input_mtime_ns": st.st_mtime_ns, "format": "text", "model": "m", "options": {"a": 1}}
    s.append(rec)
    with open(out / "summary.jsonl", "a") as f:
        f.write('{"path": "/half-writ')  # a line cut by a crash is ignored
    s2 = Summary(out)
    s2.load()
    assert s2.is_complete(src, fmt="text", model="m", options={"a": 1}) is not None
    assert s2.is_complete(src, fmt="srt", model="m", options={"a": 1}) is None       # other format
    assert s2.is_complete(src, fmt="text", model="m2", options={"a": 1}) is None     # other model
    (out / "x.txt").write_text("truncated")                                           # output changed
    assert s2.is_complete(src, fmt="text", model="m", options={"a": 1}) is None
    atomic_write_text(out / "x.txt", "héllo\n")
    src.write_bytes(b"abcd")                                                          # input changed
    assert s2.is_complete(src, fmt="text", model="m", options={"a": 1}) is None


# ------------------------------------------------------------------ runner

@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    """Eight files of 1-75 s (noise bursts), some sharing base names in different folders."""
    d = tmp_path_factory.mktemp("synth")
    rng = np.random.default_rng(0)
    for k, secs in enumerate([1.0, 75.0, 3.5, 31.0, 12.0, 0.5, 44.0, 7.0]):
        x = (0.1 * rng.standard_normal(int(secs * SR))).astype(np.float32)
        _write_wav(d / f"f{k % 2}" / f"clip{k // 2}.wav", x)
    return d


def _outputs(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.rglob("*.json"))}


def test_batched_equals_per_file(synth_dir, tmp_path):
    m1, m8 = HashModel(), HashModel()
    r1 = run_job([synth_dir], m1, tmp_path / "o1", "verbose_json", batch_size=1, split_fn=fixed_split,
                 max_segment_s=10, workers=2)
    r8 = run_job([synth_dir], m8, tmp_path / "o8", "verbose_json", batch_size=8, split_fn=fixed_split,
                 max_segment_s=10, workers=2)
    assert r1.exit_code == 0 and r8.exit_code == 0 and len(r8.ok) == 8
    assert set(m1.batches) == {1} and max(m8.batches) == 8  # it really batched across files
    o1, o8 = _outputs(tmp_path / "o1"), _outputs(tmp_path / "o8")
    assert len(o1) == 8 and o1 == o8
    # and equals transcribing each file's pieces directly, with global offsets
    for r in r8.ok:
        from flashasr.audio import load_audio

        x = load_audio(str(r.item.path)).samples
        pieces = fixed_split(x, SR, 10, "fixed")
        want = " ".join(HashModel().transcribe_waveform(x[a:b]).text.strip() for a, b in pieces)
        assert r.transcript.text == want
        assert [s.start for s in r.transcript.segments] == pytest.approx([a / SR for a, _ in pieces])
        assert r.transcript.duration == pytest.approx(len(x) / SR)


def test_model_failure_is_isolated_to_its_file(synth_dir, tmp_path):
    m = HashModel(fail_len=int(3.5 * SR))  # the 3.5 s file fails inside a batch
    r = run_job([synth_dir], m, tmp_path / "o", "text", batch_size=8, split_fn=fixed_split, max_segment_s=10)
    assert r.exit_code == 1 and len(r.failed) == 1 and len(r.ok) == 7
    assert r.failed[0].item.key == "f0/clip1" and "boom" in r.failed[0].error_message
    lines = [json.loads(l) for l in (tmp_path / "o/summary.jsonl").read_text().splitlines()]
    assert sorted(l["status"] for l in lines) == ["failed"] + ["ok"] * 7


def test_resume_skips_done_and_redoes_changed(synth_dir, tmp_path):
    out = tmp_path / "o"
    m = HashModel()
    run_job([synth_dir], m, out, "srt", split_fn=fixed_split)
    first = {p: (out / p).read_text() for p in ("f0/clip0.srt", "f1/clip3.srt")}
    m2 = HashModel()
    r = run_job([synth_dir], m2, out, "srt", split_fn=fixed_split)
    assert len(r.skipped) == 8 and m2.batches == []
    os.unlink(out / "f0/clip0.srt")  # a missing output is redone
    m3 = HashModel()
    r = run_job([synth_dir], m3, out, "srt", split_fn=fixed_split)
    assert len(r.skipped) == 7 and len(r.ok) == 1 and r.ok[0].item.key == "f0/clip0"
    assert (out / "f0/clip0.srt").read_text() == first["f0/clip0.srt"]
    r = run_job([synth_dir], HashModel(), out, "srt", split_fn=fixed_split, resume=False)
    assert len(r.ok) == 8
    lines = (out / "summary.jsonl").read_text().splitlines()
    assert len(lines) == 8  # compacted: one line per input


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file names as bytes (Linux filesystems)")
def test_a_file_name_that_is_not_utf8_is_recorded_and_resumed(tmp_path):
    """A name whose bytes are not UTF-8 (Python gives them as surrogates): its output and its journal
    line are written, the other files' lines too, and a re-run skips every file (a trial found the
    journal line crashing the job, so each re-run redid everything)."""
    d, out = tmp_path / "in", tmp_path / "o"
    rng = np.random.default_rng(5)
    for name in (b"bad\xffname.wav", b"good.wav"):
        _write_wav(Path(os.fsdecode(os.path.join(os.fsencode(d), name))), (0.1 * rng.standard_normal(SR)).astype(np.float32))
    r = run_job([d], HashModel(), out, "json", split_fn=fixed_split)
    assert len(r.ok) == 2 and not r.failed
    assert len((out / "summary.jsonl").read_bytes().decode("utf-8").splitlines()) == 2
    r = run_job([d], HashModel(), out, "json", split_fn=fixed_split)
    assert len(r.skipped) == 2 and not r.ok


@pytest.mark.parametrize("stop", [ValueError, KeyboardInterrupt])
def test_on_result_raising_mid_group_leaves_no_output_without_its_journal_line(tmp_path, stop):
    """on_result raises (an error, a Ctrl-C) on the first of six outputs the writer wrote as one group:
    the other five, complete on disk, still get their journal lines and results; ``audio_s`` counts
    exactly the recorded ok results (not every merged file); a re-run redoes only what is unrecorded."""
    import time

    d, out = tmp_path / "in", tmp_path / "o"
    for k in range(7):
        _write_wav(d / f"c{k}.wav", 0.1 * np.random.default_rng(k).standard_normal(SR + 800 * k))
    kw = dict(batch_size=6, split_fn=fixed_split, max_segment_s=30, workers=2, batch_wait_s=10, progress=False)
    run_job([d / "c6.wav"], HashModel(), out, "text", **kw)  # done before: skipped, emitted first
    m, calls = HashModel(), []

    def on_result(res):
        calls.append(res.item.key)
        if res.status == "skipped":  # hold the writer: the six files' model call, then their hand-over
            while not m.batches:
                time.sleep(0.01)
            time.sleep(0.5)
        else:
            raise stop("stop")

    if stop is ValueError:
        with pytest.raises(ValueError):
            run_job([d], m, out, "text", on_result=on_result, **kw)
        r = None
    else:
        r = run_job([d], m, out, "text", on_result=on_result, **kw)
        assert r.interrupted
    assert m.batches == [6] and len(calls) == 2 and calls[0] == "c6"  # none after the one that raised
    journal = {Path(j["path"]).stem: j for j in map(json.loads, (out / "summary.jsonl").read_text().splitlines())}
    written = sorted(p.stem for p in out.glob("*.txt"))
    assert written == [f"c{k}" for k in range(7)]
    assert all(journal[k]["status"] == "ok" and journal[k]["output"] == f"{k}.txt" for k in written)
    if r is not None:
        assert sorted(x.item.key for x in r.ok) == written[:6] and len(r.skipped) == 1
        assert r.audio_s == pytest.approx(sum(x.duration for x in r.ok))
    again = run_job([d], HashModel(), out, "text", **kw)
    assert sorted(x.item.key for x in again.skipped) == written and again.audio_s == 0.0


def test_bad_inputs_are_reported_and_others_finish(tmp_path):
    d = tmp_path / "in"
    _write_wav(d / "good.wav", 0.1 * np.sin(np.arange(SR) * 0.05).astype(np.float32))
    _write_wav(d / "empty.wav", np.zeros(0, np.float32))
    (d / "zero.flac").write_bytes(b"")
    (d / "text.mp3").write_text("this is not audio\n")
    (d / "garbage.ogg").write_bytes(np.random.default_rng(1).bytes(4000))
    r = run_job([d], HashModel(), tmp_path / "o", "json", split_fn=fixed_split)
    status = {x.item.key: (x.status, x.error_code) for x in r.results}
    assert status["good"] == ("ok", None)
    for k in ("empty", "zero", "text", "garbage"):
        assert status[k][0] == "failed" and status[k][1], k
    assert r.exit_code == 1
    for x in r.failed:
        assert x.item.path.name in x.error_message  # the message names the file
    assert json.loads((tmp_path / "o/good.json").read_text())["text"].startswith("h")


def test_bad_arguments_raise_clear_errors(synth_dir):
    from flashasr.errors import FlashASRError

    for kw in ({"fmt": "doc"}, {"segmentation": "smart"}, {"batch_size": 0}, {"workers": 0},
               {"max_segment_s": -1}, {"max_segment_s": float("nan")}, {"max_buffered_audio_s": 0},
               {"cpu_pool": "fibers"}):
        with pytest.raises(FlashASRError) as e:
            run_job([synth_dir], HashModel(), None, **({"fmt": "text"} | kw))
        assert e.value.code == "invalid_request"


def test_real_model_batched_equals_per_file(tmp_path):
    """tiny.en: three clips in one cross-file batch give the same outputs as one by one."""
    from flashasr.pipeline import cached_model

    m = cached_model(None, "cpu")
    clips = [AUDIO / "en/en-ls-61-70968-0002.wav", AUDIO / "hard/hard-short-cards-ten-of-clubs.wav",
             AUDIO / "en/en-vctk-p225-001.wav"]
    r1 = run_job(clips, m, tmp_path / "one", "verbose_json", batch_size=1)
    r3 = run_job(clips, m, tmp_path / "three", "verbose_json", batch_size=3, batch_wait_s=30)
    assert r1.n_batches == 3 and r3.n_batches == 1
    o1, o3 = _outputs(tmp_path / "one"), _outputs(tmp_path / "three")
    assert len(o1) == 3 and o1.keys() == o3.keys()
    # the model contract: same text and tokens, times within one 20 ms frame (log-probs
    # may differ in the last float bits between batch shapes)
    for k in o1:
        a, b = json.loads(o1[k]), json.loads(o3[k])
        assert a["text"] == b["text"] and a["duration"] == b["duration"]
        assert [s["tokens"] for s in a["segments"]] == [s["tokens"] for s in b["segments"]]
        for sa, sb in zip(a["segments"], b["segments"]):
            assert abs(sa["start"] - sb["start"]) <= 0.02 and abs(sa["end"] - sb["end"]) <= 0.02
    assert "golden fortune" in json.loads(o1["en-ls-61-70968-0002.verbose.json"])["text"].lower()


def test_parakeet_fixture_batched_equals_per_file(tmp_path):
    """Parakeet-TDT (the tiny NeMo fixture): pieces of different lengths padded in one batch
    give the same tokens and times as one by one."""
    from conftest import PARAKEET_FIXTURES
    from flashasr.pipeline import cached_model

    nemo = PARAKEET_FIXTURES / "tiny-tdt/model.nemo"
    if not nemo.exists():
        pytest.skip("Parakeet fixture missing")
    m = cached_model(str(nemo), "cpu")
    assert m.family == "parakeet" and m.max_segment_seconds > 30
    clips = [AUDIO / "en/en-ls-61-70968-0002.wav", AUDIO / "en/en-vctk-p225-001.wav",
             AUDIO / "hard/hard-short-cards-ten-of-clubs.wav"]
    r1 = run_job(clips, m, tmp_path / "one", "verbose_json", batch_size=1, progress=False)
    r3 = run_job(clips, m, tmp_path / "three", "verbose_json", batch_size=3, batch_wait_s=30, progress=False)
    assert r1.n_batches == 3 and r3.n_batches == 1 and r3.exit_code == 0
    o1, o3 = _outputs(tmp_path / "one"), _outputs(tmp_path / "three")
    assert len(o1) == 3 and o1.keys() == o3.keys()
    for k in o1:
        a, b = json.loads(o1[k]), json.loads(o3[k])
        assert a["text"] == b["text"] and a["text"]
        assert [s["tokens"] for s in a["segments"]] == [s["tokens"] for s in b["segments"]]
        for sa, sb in zip(a["segments"], b["segments"]):
            assert abs(sa["start"] - sb["start"]) <= 0.08 and abs(sa["end"] - sb["end"]) <= 0.08


def test_summary_compact_never_drops_a_line_on_disk(tmp_path):
    """A line that reached summary.jsonl survives compact() even when memory never saw it
    (a Ctrl-C can land between the write and the bookkeeping); memory wins for the same path."""
    s = Summary(tmp_path)
    s.append({"path": "/a.wav", "status": "ok", "output": "a.txt"})
    with open(s.path, "a", encoding="utf-8") as f:  # written, but not recorded in memory
        f.write(json.dumps({"path": "/b.wav", "status": "ok", "output": "b.txt"}) + "\n")
        f.write('{"path": "/c.wav", "sta')  # a line cut by a crash: ignored
    s.append({"path": "/a.wav", "status": "failed", "output": None})  # newer record for /a.wav
    s.compact(["/a.wav", "/b.wav"])
    recs = [json.loads(l) for l in s.path.read_text().splitlines()]
    assert [(r["path"], r["status"]) for r in recs] == [("/a.wav", "failed"), ("/b.wav", "ok")]


def test_process_pool_equals_thread_pool_and_reports_bad_files(synth_dir, tmp_path):
    """cpu_pool="process" (decode + VAD in worker processes, the CUDA default): same outputs as
    threads, per-file errors (named) cross the process boundary, a missing file is one failure."""
    d = tmp_path / "in"
    import shutil

    shutil.copytree(synth_dir, d)
    (d / "bad").mkdir()
    (d / "bad" / "zero.flac").write_bytes(b"")
    (d / "bad" / "text.mp3").write_text("this is not audio\n")
    gone = d / "bad" / "gone.wav"
    _write_wav(gone, np.zeros(100, np.float32))
    from flashasr.jobs.inputs import expand_inputs

    items = expand_inputs([d])
    gone.unlink()  # listed, then deleted before its decode
    rt = run_job(items, HashModel(), tmp_path / "ot", "verbose_json", batch_size=4, workers=2, cpu_pool="thread")
    rp = run_job(items, HashModel(), tmp_path / "op", "verbose_json", batch_size=4, workers=2, cpu_pool="process")
    assert rt.cpu_pool == "thread" and rp.cpu_pool == "process"
    assert _outputs(tmp_path / "ot") == _outputs(tmp_path / "op") and len(rp.ok) == 8
    ft = {x.item.key: x.error_code for x in rt.failed}
    fp = {x.item.key: x.error_code for x in rp.failed}
    assert ft == fp and set(fp) == {"bad/zero", "bad/text", "bad/gone"}
    for x in rp.failed:
        assert x.item.path.name in x.error_message
    assert rp.decode_cpu_s > 0 and rp.to_dict()["cpu_pool"] == "process"
    import signal

    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # Ctrl-C held only while forking
    from flashasr.errors import FlashASRError

    with pytest.raises(FlashASRError, match="cpu_pool"):
        run_job(items, HashModel(), None, cpu_pool="fibers")


def test_one_decode_pool_serves_several_jobs(synth_dir, tmp_path, monkeypatch):
    """start_decode_pool(): worker processes forked once (before a model would be loaded) serve
    consecutive jobs with the outputs of a pool of their own; a worker that dies in one job is
    replaced, its file fails alone, and the pool goes on serving the next job; a closed pool is
    not used (the job forks its own)."""
    from flashasr.jobs import start_decode_pool

    d = tmp_path / "in"
    import shutil

    shutil.copytree(synth_dir, d)
    _write_wav(d / "boom.wav", np.zeros(SR, np.float32))
    _decode_kills_worker_on(monkeypatch, "boom.wav")  # before the fork: the workers inherit it
    assert start_decode_pool("cpu", workers=2) is None  # a CPU job decodes in threads
    pool = start_decode_pool("cpu", workers=2, cpu_pool="process")
    try:
        r1 = run_job([d], HashModel(), tmp_path / "o1", "json", workers=2, cpu_pool="process", worker_pool=pool)
        assert {x.item.key for x in r1.failed} == {"boom"} and r1.failed[0].error_code == "decode_worker_died"
        assert r1.workers == 2 and pool.deaths == 2 and not pool.closed
        (d / "boom.wav").unlink()
        r2 = run_job([d], HashModel(), tmp_path / "o2", "json", cpu_pool="process", worker_pool=pool)
        own = run_job([d], HashModel(), tmp_path / "o3", "json", workers=2, cpu_pool="process")
        assert r2.exit_code == 0 and len(r2.ok) == len(own.ok) == 8 and pool.deaths == 2
        assert _outputs(tmp_path / "o2") == _outputs(tmp_path / "o3")
        assert _outputs(tmp_path / "o1") == {k: v for k, v in _outputs(tmp_path / "o3").items()}
    finally:
        pool.close()
    assert pool.closed
    r4 = run_job([d], HashModel(), tmp_path / "o4", "json", workers=2, cpu_pool="process", worker_pool=pool)
    assert r4.exit_code == 0 and _outputs(tmp_path / "o4") == _outputs(tmp_path / "o3")


def test_batches_fill_up_beyond_the_decode_prefetch(tmp_path):
    """Batches are not capped by the number of files being decoded (2 x workers): decoded files
    wait (within max_buffered_audio_s) until a full batch is ready."""
    d = tmp_path / "in"
    rng = np.random.default_rng(3)
    for k in range(40):
        _write_wav(d / f"c{k:02d}.wav", (0.1 * rng.standard_normal(SR // 2)).astype(np.float32))
    import time
    from types import SimpleNamespace

    class SlowModel(HashModel):  # the model is the slow stage, decoding is instant
        def _transcribe(self, ws, options):
            time.sleep(0.05)
            return super()._transcribe(ws, options)

    def instant_decode(path, sr):
        return SimpleNamespace(samples=np.full(SR // 2, 0.01, np.float32))

    m = SlowModel()
    r = run_job([d], m, None, batch_size=16, workers=2, split_fn=fixed_split, decode_fn=instant_decode)
    assert r.exit_code == 0 and len(r.ok) == 40
    assert m.batches[:2] == [16, 16] and sum(m.batches) == 40, m.batches


def _decode_kills_worker_on(monkeypatch, suffix: str) -> None:
    """Make the job's decode SIGKILL its own (forked worker) process for files ending in
    ``suffix``, as an out-of-memory kill or a native crash would."""
    import signal

    from flashasr.jobs import feeder

    real = feeder.default_decode

    def killer(path, sr):  # inherited by the forked workers
        if path.endswith(suffix):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, sr)

    monkeypatch.setattr(feeder, "default_decode", killer)


def test_a_dying_decode_worker_fails_only_its_file(tmp_path, monkeypatch):
    """A decode worker process that dies (SIGKILL, as an out-of-memory kill would) breaks the
    process pool: the files in flight get one more try in a fresh pool, the file that kills its
    worker twice is reported as decode_worker_died, every other file completes, nothing hangs."""
    d = tmp_path / "in"
    rng = np.random.default_rng(5)
    for k in range(6):
        _write_wav(d / f"ok{k}.wav", (0.1 * rng.standard_normal(SR)).astype(np.float32))
    _write_wav(d / "boom.wav", np.zeros(SR, np.float32))
    _decode_kills_worker_on(monkeypatch, "boom.wav")
    r = run_job([d], HashModel(), tmp_path / "o", "text", workers=2, cpu_pool="process", split_fn=None)
    status = {x.item.key: (x.status, x.error_code) for x in r.results}
    assert status.pop("boom") == ("failed", "decode_worker_died")
    assert all(v == ("ok", None) for v in status.values()) and len(status) == 6, status
    assert r.cpu_pool == "process"
    assert "boom.wav" in r.failed[0].error_message


def test_unreadable_folders_are_reported_not_fatal(tmp_path, monkeypatch):
    """A subfolder that cannot be listed and an input behind a folder that cannot be searched
    (simulated: the tests may run as root) are reported as unreadable_input; the rest expands."""
    d = tmp_path / "in"
    _write_wav(d / "a.wav", np.zeros(800, np.float32))
    _write_wav(d / "locked" / "b.wav", np.zeros(800, np.float32))
    real_scandir, real_stat = os.scandir, os.stat

    def scandir(path="."):
        if os.fspath(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    def stat(path, *a, **kw):
        if "/hidden/" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "stat", stat)
    missing: list = []
    items = expand_inputs([d, str(tmp_path / "hidden" / "x.wav")], missing=missing)
    assert [it.key for it in items] == ["a"]
    assert sorted(e.code for e in missing) == ["unreadable_input", "unreadable_input"]
    assert any("locked" in str(e) for e in missing) and any("hidden" in str(e) for e in missing)
    with pytest.raises(InputError, match="permission denied"):
        expand_inputs([str(tmp_path / "hidden" / "x.wav")])


def test_two_formats_in_one_folder_keep_their_own_resume_records(synth_dir, tmp_path):
    """A json run after a text run into the same folder does not make the next text run redo
    everything: the journal keeps one record per (input, format)."""
    out = tmp_path / "o"
    run_job([synth_dir], HashModel(), out, "text", split_fn=fixed_split)
    run_job([synth_dir], HashModel(), out, "json", split_fn=fixed_split)
    m = HashModel()
    r = run_job([synth_dir], m, out, "text", split_fn=fixed_split)
    assert len(r.skipped) == 8 and m.batches == []
    lines = [json.loads(l) for l in (out / "summary.jsonl").read_text().splitlines()]
    assert sorted({l["format"] for l in lines}) == ["json", "text"] and len(lines) == 16


def test_translate_task_reaches_the_model_and_is_checked_up_front(synth_dir, tmp_path):
    """run_job(task="translate"): the task is passed to every model call and the results say
    language "en"; a model that cannot translate is refused before any file is read."""
    from flashasr.errors import UnsupportedTaskError

    class Translator(HashModel):
        translates = True

        def __init__(self):
            super().__init__()
            self.tasks = []

        def _transcribe(self, ws, options):
            task = options.task
            self.tasks.append(task)
            return [Transcript(text=f" {task} n{len(w)}", language="de", duration=len(w) / SR,
                               segments=[Segment(0, 0.0, len(w) / SR, f" {task}")]) for w in ws]

    m = Translator()
    r = run_job([synth_dir], m, None, "json", batch_size=4, split_fn=fixed_split, max_segment_s=10, workers=1,
                task="translate")
    assert r.exit_code == 0 and m.tasks and set(m.tasks) == {"translate"}
    assert all(x.transcript.language == "en" and x.transcript.task == "translate"
               and "translate" in x.transcript.text for x in r.ok)
    m2 = HashModel()  # no `translates`: refused up front, no model call
    with pytest.raises(UnsupportedTaskError, match="cannot translate"):
        run_job([synth_dir], m2, None, "json", task="translate")
    assert m2.batches == []
    plain = Translator()
    run_job([synth_dir], plain, None, "json", batch_size=4, split_fn=fixed_split, max_segment_s=10, workers=1)
    assert set(plain.tasks) == {"transcribe"}  # the default passes no task: models without one still work


def _sleepy_task(path):  # a decode pool task: "slow" files take far longer than the test waits
    if path == "slow":
        time.sleep(30)
    return path


def test_decode_pool_close_reports_the_files_its_workers_held_while_the_reader_was_busy():
    """close(kill=True) while the pool's reader is inside a callback: the killed workers' files still
    reach on_death (the reader reads what is ready beside its wake-up before it ends; a review found
    a version that dropped them)."""
    import threading

    from flashasr.jobs.procpool import ForkedWorkers

    gate, entered, deaths = threading.Event(), threading.Event(), []

    def on_result(i, r):  # the reader is busy here while close() runs
        entered.set()
        gate.wait(10)

    pool = ForkedWorkers(3)
    pool.attach(_sleepy_task, (), on_result=on_result, on_death=lambda held, closing: deaths.append((held, closing)))
    assert pool.submit(0, "fast") and pool.submit(1, "slow") and pool.submit(2, "slow")
    assert entered.wait(10)
    closer = threading.Thread(target=pool.close, kwargs=dict(kill=True, timeout=3))
    closer.start()
    time.sleep(0.5)
    gate.set()
    closer.join(15)
    assert not closer.is_alive() and sorted(deaths) == [([1], True), ([2], True)]


def test_worker_deaths_never_fail_an_innocent_file(tmp_path, monkeypatch):
    """Two files that kill their worker among twelve good ones, three workers: the files in flight
    at a death are retried one at a time, so only the two culprits fail (before: a good file in
    flight at both deaths was reported as decode_worker_died too; seen in CI under load)."""
    d = tmp_path / "in"
    rng = np.random.default_rng(6)
    for k in range(12):
        _write_wav(d / f"ok{k:02d}.wav", (0.1 * rng.standard_normal(SR // 2)).astype(np.float32))
    for k in (3, 8):
        _write_wav(d / f"ok{k:02d}boom.wav", np.zeros(SR // 2, np.float32))
    _decode_kills_worker_on(monkeypatch, "boom.wav")
    r = run_job([d], HashModel(), tmp_path / "o", "text", workers=3, cpu_pool="process", split_fn=None)
    status = {x.item.key: (x.status, x.error_code) for x in r.results}
    bad = {k for k, v in status.items() if v != ("ok", None)}
    assert bad == {"ok03boom", "ok08boom"}, status
    assert all(status[k] == ("failed", "decode_worker_died") for k in bad) and len(status) == 14
    assert r.cpu_pool == "process"  # deaths explained by culprit files do not push the job onto threads


class Recorder(HashModel):
    """Records the options object of every call; ``langs``: the codes it takes (None: any)."""

    def __init__(self, langs=None):
        super().__init__()
        self.langs = langs
        self.seen: list[tuple[TranscribeOptions, int]] = []

    def languages(self):
        return self.langs

    def _transcribe(self, ws, options):
        self.seen.append((options, len(ws)))
        return super()._transcribe(ws, options)


def test_a_manifest_language_the_model_cannot_take_fails_only_its_file(synth_dir, tmp_path):
    """Per-file options (a manifest's language) are checked against the model per file: a language
    the model refuses (or one that is no language code) fails that file with its error code, before
    any decode; the others finish; a job-level language wins over the manifest's."""
    items = expand_inputs([synth_dir])
    items[1].language, items[2].language, items[3].language = "de", "xx", "EN"
    m = Recorder(frozenset({"en"}))
    r = run_job(items, m, tmp_path / "o", "json", batch_size=4, split_fn=fixed_split, max_segment_s=10, workers=1)
    status = {x.item.key: (x.status, x.error_code) for x in r.results}
    assert status[items[1].key] == ("failed", "unsupported_language")
    assert status[items[2].key] == ("failed", "invalid_request")
    assert sum(v == ("ok", None) for v in status.values()) == len(items) - 2 and r.exit_code == 1
    assert "English-only" in r.failed[0].error_message and items[1].display in r.failed[0].error_message
    assert {o.language for o, _ in m.seen} == {None, "en"}  # "EN" normalised; "de" never reached the model
    lines = [json.loads(l) for l in (tmp_path / "o/summary.jsonl").read_text().splitlines()]
    assert sorted(l["status"] for l in lines) == ["failed"] * 2 + ["ok"] * (len(items) - 2)
    m2 = Recorder(frozenset({"en"}))  # the job's language overrides every manifest's: nothing is refused
    r2 = run_job(items, m2, None, "json", split_fn=fixed_split, language="en")
    assert r2.exit_code == 0 and {o.language for o, _ in m2.seen} == {"en"}
    from flashasr.errors import UnsupportedLanguageError

    with pytest.raises(UnsupportedLanguageError):  # a job-level language the model refuses: up front
        run_job(items, Recorder(frozenset({"en"})), None, "json", language="de")


def test_options_reach_the_model_as_one_object(synth_dir, tmp_path):
    """run_job(options=..., **changes): the resolved TranscribeOptions reach every model call whole,
    the journal records every field (max_segment_s resolved), and resume matches on it."""
    base = TranscribeOptions(language="de", segmentation="fixed")
    m = Recorder()  # any language
    out = tmp_path / "o"
    r = run_job([synth_dir], m, out, "json", options=base, word_timestamps=True, max_segment_s=10,
                split_fn=fixed_split, batch_size=4, workers=1)
    want = TranscribeOptions(language="de", word_timestamps=True, segmentation="fixed", max_segment_s=10.0)
    assert r.exit_code == 0 and m.seen and {o for o, _ in m.seen} == {want}
    assert all(isinstance(o, TranscribeOptions) for o, _ in m.seen)
    assert all(x.transcript.language == "de" and x.transcript.words is not None for x in r.ok)
    rec = json.loads((out / "summary.jsonl").read_text().splitlines()[0])
    assert rec["options"] == want.to_dict() and set(rec["options"]) == {
        "language", "task", "word_timestamps", "segmentation", "max_segment_s", "prompt", "temperature"}
    r2 = run_job([synth_dir], HashModel(), out, "json", split_fn=fixed_split, options=want)
    assert len(r2.skipped) == 8
    # a journal written before prompt/temperature existed: the missing fields are their defaults
    summary = out / "summary.jsonl"
    old = []
    for line in summary.read_text().splitlines():
        r_ = json.loads(line)
        if isinstance(r_.get("options"), dict):
            r_["options"].pop("prompt", None), r_["options"].pop("temperature", None)
        old.append(json.dumps(r_))
    summary.write_text("\n".join(old) + "\n")
    assert len(run_job([synth_dir], HashModel(), out, "json", split_fn=fixed_split, options=want).skipped) == 8
    # a different prompt is a different job: everything runs again
    r_p = run_job([synth_dir], HashModel(), out, "json", split_fn=fixed_split, options=TranscribeOptions.build(want, prompt="x"))
    assert not r_p.skipped and r_p.exit_code == 0
    d = TranscribeOptions().to_dict()  # max_segment_s None resolves to the model's window
    r3 = run_job([synth_dir], HashModel(), tmp_path / "o3", "json", split_fn=fixed_split)
    assert r3.exit_code == 0
    rec3 = json.loads((tmp_path / "o3/summary.jsonl").read_text().splitlines()[0])
    assert rec3["options"] == d | {"max_segment_s": HashModel.max_segment_seconds}


def test_batches_never_mix_decoding_options(synth_dir, tmp_path):
    """Pieces share a model call only with pieces of equal options.decoding (here: manifest
    languages), however many are pending."""
    items = expand_inputs([synth_dir])
    for k, it in enumerate(items):
        it.language = ("de", "fr", None)[k % 3]
    m = Recorder()
    r = run_job(items, m, None, "json", batch_size=16, split_fn=fixed_split, max_segment_s=10, workers=2,
                batch_wait_s=5)
    assert r.exit_code == 0 and sum(n for _, n in m.seen) == r.n_pieces
    per_lang: dict = {}
    for o, n in m.seen:
        per_lang[o.language] = per_lang.get(o.language, 0) + n
    want: dict = {}
    for x in r.ok:
        want[x.item.language] = want.get(x.item.language, 0) + x.n_pieces
        assert x.transcript.language == (x.item.language or "en")
    assert per_lang == want and len(per_lang) == 3


def test_vad_in_the_main_process_gives_the_workers_pieces(tmp_path, monkeypatch):
    """The GPU path of the CPU stage: workers only decode, the main process plans many files at
    once with the batched PyTorch Silero VAD (here on the CPU, as it runs on CUDA). Same pieces,
    hence the same outputs, as the ONNX VAD in the workers; files without speech get no model call;
    the model thread and the writer thread keep every file's result in place."""
    import flashasr.audio.silero_torch as st
    from flashasr.jobs import runner

    d = tmp_path / "in"
    clips = [AUDIO / "long" / "long-silero-test-60s.wav", AUDIO / "en" / "en-ls-61-70968-0002.wav",
             AUDIO / "hard" / "hard-noise-no-speech-8s.wav", AUDIO / "en" / "en-jfk-inaugural.wav",
             AUDIO / "hard" / "hard-music-vibe-ace.ogg"]
    clips = [c for c in clips if c.exists()]
    d.mkdir()
    for k, c in enumerate(clips):
        (d / f"{k}-{c.name}").symlink_to(c)
    (d / "silence.wav").write_bytes(b"")
    _write_wav(d / "zeros.wav", np.zeros(5 * SR, np.float32))
    calls = []
    real = st.speech_probabilities_batch

    def on_cpu(signals, **kw):
        calls.append(len(signals))
        return real(signals, **dict(kw, device="cpu"))

    a, b = HashModel(), HashModel()
    run_job([d], a, tmp_path / "w", "verbose_json", batch_size=4, workers=2, vad_device="cpu")
    monkeypatch.setattr(st, "speech_probabilities_batch", on_cpu)
    monkeypatch.setattr(runner, "_vad_device", lambda *a_: "cuda")
    r_main = run_job([d], b, tmp_path / "m", "verbose_json", batch_size=4, workers=2)
    assert calls and sum(calls) == len(r_main.ok)  # every decoded file's VAD ran in the main process, batched
    assert _outputs(tmp_path / "w") == _outputs(tmp_path / "m") and len(r_main.ok) == len(clips) + 1
    assert sum(a.batches) == sum(b.batches)  # the same pieces reached the model
    zeros = next(r for r in r_main.ok if r.item.path.name == "zeros.wav")
    assert zeros.transcript.text == "" and zeros.n_pieces == 0  # no speech: no piece, no model call
    assert [r.error_code for r in r_main.failed] == ["empty_audio"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_decode_workers_can_keep_the_first_cores_free():
    """FLASHASR_DECODE_RESERVED_CPUS=n: a decode worker leaves the n lowest cores of its affinity set
    to the main process; with too few cores to leave one it stays as it is."""
    import multiprocessing as mp

    from flashasr.jobs.feeder import keep_cores_free

    cpus = sorted(os.sched_getaffinity(0))

    def child(n, q):
        keep_cores_free(n)
        q.put(sorted(os.sched_getaffinity(0)))

    ctx = mp.get_context("fork")
    for n, want in ((0, cpus), (1, cpus[1:] if len(cpus) > 1 else cpus), (len(cpus), cpus)):
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(n, q))
        p.start()
        got = q.get(timeout=30)
        p.join(30)
        assert got == want, (n, got, want)
    assert sorted(os.sched_getaffinity(0)) == cpus  # this process untouched
