"""Offline jobs on Ray (``flashasr transcribe --ray``, ``flashasr.jobs.run_ray_job``) against a local
Ray cluster this module starts (2 CPUs, no dashboard) and stops: the same outputs as the local job
on real clips (text and every time), a corrupt file and duplicate names in two folders, an
interrupted CLI run resumed to the same outputs, a model actor killed mid-job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import AUDIO, sigint_default

ray = pytest.importorskip("ray")

from flashasr.jobs import run_job  # noqa: E402
from flashasr.jobs.ray_job import run_ray_job  # noqa: E402
from flashasr.pipeline import cached_model  # noqa: E402

CLIPS = {  # key in the input folder -> real clip
    "a/clip.wav": "en/en-ls-61-70968-0002.wav",
    "b/clip.wav": "en/en-vctk-p225-001.wav",  # the same name in another folder
    "a/fleurs.ogg": "en/en-fleurs-003.ogg",
    "b/numbers.wav": "en/en-picovoice-numbers.wav",
    "long.wav": "long/long-silero-test-60s.wav",  # cut at pauses into several pieces
}
FMT = "verbose_json"


@pytest.fixture(scope="module")
def cluster():
    """A private local Ray instance (its processes are this process's children; ``ray.shutdown``
    ends them), its GCS address for CLI runs."""
    tmp = tempfile.mkdtemp(prefix="fr-", dir="/tmp")  # short: Ray's socket paths live below it
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("in")
    for key, clip in CLIPS.items():
        (d / key).parent.mkdir(parents=True, exist_ok=True)
        (d / key).symlink_to(AUDIO / clip)
    (d / "b" / "corrupt.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + os.urandom(3000))
    return d


@pytest.fixture(scope="module")
def local(inputs, tmp_path_factory) -> Path:
    """The local job's outputs (the reference)."""
    out = tmp_path_factory.mktemp("local")
    rep = run_job([inputs], cached_model("tiny.en"), out, FMT, word_timestamps=True, progress=False)
    assert rep.exit_code == 1 and [r.item.key for r in rep.failed] == ["b/corrupt"]
    return out


def _transcript(path: Path) -> dict:
    """What must be equal: the text, the language, every segment's and word's text and times."""
    d = json.loads(path.read_text())
    return {"text": d["text"], "language": d["language"], "duration": d["duration"],
            "segments": [(s["start"], s["end"], s["text"]) for s in d["segments"]],
            "words": [(w["word"], w["start"], w["end"]) for w in d["words"]]}


def _records(out: Path) -> dict:
    recs = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    return {r["key"]: (r["status"], r["output"], r["error_code"], r["duration"], r["options"]) for r in recs}


def _same_outputs(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*.json"))
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*.json"))
    assert len(files_a) == len(CLIPS)
    for rel in files_a:
        assert _transcript(a / rel) == _transcript(b / rel), rel
    assert _records(a) == _records(b)
    assert not [p for p in b.rglob("*flashasr-tmp*")]


def test_ray_job_equals_the_local_job(cluster, inputs, local, tmp_path):
    out = tmp_path / "ray"
    rep = run_ray_job([inputs], "tiny.en", out, FMT, address=cluster, word_timestamps=True, progress=False)
    assert rep.exit_code == 1 and rep.cpu_pool == "ray"
    assert sorted(r.item.key for r in rep.ok) == sorted(k.rsplit(".", 1)[0] for k in CLIPS)
    (bad,) = rep.failed
    assert bad.item.key == "b/corrupt" and bad.error_code and "corrupt.wav" in bad.error_message
    assert rep.n_pieces > len(CLIPS) and rep.audio_s > 70  # the long file went as several pieces
    _same_outputs(local, out)


def _cli(inputs: Path, out: Path, address: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flashasr", "transcribe", str(inputs), "-o", str(out), "-f", FMT,
                             "--word-timestamps", "--batch-size", "2", f"--ray={address}", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)


def _interrupt_after_the_first_output(root: Path, copies: int, address: str) -> tuple[Path, Path, list, list] | None:
    """``copies`` copies of three clips (and the corrupt file) under ``root``; SIGINT once the first
    output is in place. Returns (inputs, out, names, finished keys), or None when the job finished
    before the SIGINT took effect (too short for this machine's pace now)."""
    src = root / "in"
    (src / "c").mkdir(parents=True)
    names = ["a/clip.wav", "b/clip.wav", "b/numbers.wav"]
    for k in range(copies):
        (src / "c" / f"{k:02d}.wav").symlink_to(AUDIO / CLIPS[names[k % 3]])
    (src / "corrupt.wav").write_bytes(b"RIFF" + os.urandom(2000))
    out = root / "out"
    p = _cli(src, out, address)
    t_end = time.monotonic() + 300  # Ray's workers and the model start first: > 120 s on 2 loaded cores
    summary = out / "summary.jsonl"
    while not (summary.exists() and '"ok"' in summary.read_text()):  # the first output is in place
        if p.poll() is not None:
            break
        assert time.monotonic() < t_end, "no output after 300 s"
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    done = [k for k, r in _records(out).items() if r[0] == "ok"]
    if len(done) == copies:
        return None
    assert p.returncode == 130, err
    assert "interrupted" in err and "re-run the same command to resume" in err
    assert len(done) >= 1, err
    assert len(list((out / "c").glob("*.json"))) == len(done)
    assert not list(out.rglob("*flashasr-tmp*"))  # nothing half-written
    return src, out, names, done


def test_interrupted_cli_job_resumes_to_the_same_outputs(cluster, local, tmp_path):
    """12 copies of three clips (and the corrupt file): SIGINT once the first output is in place
    (exit 130, finished outputs kept, nothing half-written), then the same command resumes: the
    finished inputs are skipped and every output equals the local job's for its clip. A job that
    finished before the SIGINT took effect proves nothing: it is redone with 24, then 48 copies, and
    the test fails if none lasts."""
    for copies in (12, 24, 48):
        got = _interrupt_after_the_first_output(tmp_path / f"x{copies}", copies, cluster)
        if got:
            break
    else:
        pytest.fail("every job (12, 24, 48 copies) finished before SIGINT took effect: nothing was left to resume")
    src, out, names, done = got
    p = _cli(src, out, cluster)
    _, err = p.communicate(timeout=600)  # a hang guard: the resume took > 180 s on 2 cores under load
    assert p.returncode == 1, err  # the corrupt file
    assert f"skipped (already done) {len(done)}" in err and "failed: " in err and "corrupt.wav" in err
    recs = _records(out)
    assert sorted(k for k, r in recs.items() if r[0] == "ok") == [f"c/{k:02d}" for k in range(copies)]
    for k in range(copies):
        want = local / (names[k % 3].rsplit(".", 1)[0] + ".verbose.json")
        assert _transcript(out / "c" / f"{k:02d}.verbose.json") == _transcript(want), k
    print(f"copies {copies}, outputs kept after the SIGINT {len(done)}", file=sys.stderr)


def _children_named(title: str) -> list[int]:
    """PIDs of this process's descendants (the Ray instance it started) whose title starts with ``title``."""
    import psutil

    pids = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.cmdline() and c.cmdline()[0].startswith(title):
                pids.append(c.pid)
        except psutil.Error:
            pass
    return pids


def test_a_killed_model_actor_is_restarted_and_its_files_retried(cluster, inputs, local, tmp_path):
    killed = []

    def kill_once(res):  # the first finished file: the model actor is busy with the next batch
        if not killed:
            pids = _children_named("ray::MapWorker(MapBatches(ModelStage))")
            assert pids
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.extend(pids)

    out = tmp_path / "ray"
    rep = run_ray_job([inputs], "tiny.en", out, FMT, address=cluster, word_timestamps=True, progress=False,
                      batch_size=1, on_result=kill_once)
    assert killed
    assert rep.exit_code == 1 and [r.item.key for r in rep.failed] == ["b/corrupt"]
    _same_outputs(local, out)
    assert threading.active_count() < 50


def test_a_file_taken_for_the_address_is_refused(capsys, tmp_path):
    """``--ray clip.wav`` (the address swallowed an input): exit 2 naming the fix, before Ray starts;
    the same for the server's option parser."""
    from flashasr.cli import main
    from flashasr.serve.config import parse_args

    clip = str(AUDIO / CLIPS["a/clip.wav"])
    assert main(["transcribe", clip, "-o", str(tmp_path), "--ray", clip]) == 2
    err = capsys.readouterr().err
    assert "--ray ADDRESS must be" in err and "--ray=ADDRESS" in err
    with pytest.raises(SystemExit) as e:
        parse_args(["--ray", "clip.wav"])
    assert e.value.code == 2
    assert parse_args(["--ray"]).mode == "ray" and parse_args(["--ray=10.0.0.1:6379", "--workers", "3"]).workers == 3
