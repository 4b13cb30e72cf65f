"""One long file, one request: a 1-hour mp3 and a 1-hour ogg/opus through every door, stage by stage.

Issue #12 item 4: the response for one 1-hour file in <= 1.5 s on one H200 (per-request speed
factor >= 2,400x). The files are built as ``bench_decode_parallel.py`` builds them (real speech of
../shared/audio cycled; mp3 44.1 kHz stereo 128 kb/s CBR, ogg/opus 48 kHz mono 32 kb/s), cached in
``--cache-dir``. With the model loaded once in this process (``--model``, default
``random:parakeet-tdt-0.6b-v3``: the exact 0.6B v3 shapes, random weights, behind the GPU engine on
CUDA), for each file:

* stages alone: sequential ``load_audio``; ``load_audio_parallel`` (default workers: the CPU
  count, at most 16); the VAD cut on the CPU (ONNX, one thread) and on the model's device
  (:func:`flashasr.pipeline.plan_many`); the model on the pieces (``transcribe_batch``, all
  pieces in one call, as every door hands them over) and the merge;
* ``flashasr.transcribe(path, model=m)`` (the Python API: parallel decode, VAD on the model's
  device, one batch), the same with the ranges in worker processes (``FLASHASR_DECODE_POOL=process``)
  and with ``FLASHASR_DECODE_WORKERS=1`` (sequential decode) to
  show what the parallel decode buys; whether both give the same text;
* ``run_job([path], m, out)`` in this process: what ``flashasr transcribe FILE -o OUT`` does once
  its model is loaded (one output file written);
* ``--server``: ``python -m flashasr.serve.app`` with the same model spec (single mode), the file
  POSTed to ``/v1/audio/transcriptions`` (``response_format=json``), wall time from the first
  byte sent to the reply read, over loopback;
* ``--cli``: ``python -m flashasr transcribe FILE -o DIR`` as a subprocess, wall time including
  interpreter start-up and model load (reported, not the target: a command line pays its start).

Timings are the best and median of ``--repeats`` after one untimed warm-up of each door. Prints a
table and writes ``bench/results/long_file_<gpu|cpu>.json`` (or ``--out``).
Usage (H200): ``python bench/bench_long_file.py --cache-dir /tmp/long --server --cli``;
``--doors-only`` measures the server and the CLI alone (no model in the bench's process: on an
80 GB card two copies with their graphs and workspaces do not fit);
smoke (CPU, small): ``python bench/bench_long_file.py --seconds 120 --model ../shared/fixtures/parakeet/tiny-tdt/model.nemo --device cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

import flashasr  # noqa: E402
from flashasr.audio import default_decode_workers, load_audio, load_audio_parallel  # noqa: E402
from flashasr.options import TranscribeOptions  # noqa: E402
from flashasr.pipeline import default_vad_device, merge_pieces, plan_many, plan_pieces  # noqa: E402

from bench_cpu_audio import cpu_info, versions  # noqa: E402
from bench_decode_parallel import FILES, encode_long  # noqa: E402


def timed(fn, repeats: int) -> tuple[dict, object]:
    """Best and median wall seconds of ``repeats`` calls of ``fn`` (after none untimed)."""
    walls, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t)
    return {"best_s": round(min(walls), 4), "median_s": round(statistics.median(walls), 4)}, out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def stages(path: Path, model, opts: TranscribeOptions, device: str, repeats: int) -> dict:
    """Each stage of the in-process path alone."""
    caps = model.capabilities
    rate = caps.sample_rate
    res: dict = {}
    res["decode_sequential"], wav = timed(lambda: load_audio(path, target_rate=rate), max(1, repeats - 1))
    res["decode_parallel"], wavp = timed(lambda: load_audio_parallel(path, target_rate=rate), repeats)
    x = wavp.samples
    res["decode_parallel"]["max_abs_diff_vs_sequential"] = float(abs(x - wav.samples).max()) \
        if len(x) == len(wav.samples) else None
    res["decode_parallel"]["workers"] = default_decode_workers()
    res["decode_parallel_processes"], _ = timed(lambda: load_audio_parallel(path, target_rate=rate, pool="process"),
                                                repeats + 1)  # the first call starts the forkserver
    r = opts.resolve(caps)
    res["vad_cpu"], pieces_cpu = timed(lambda: plan_pieces(x, r, caps), 1)
    vad = default_vad_device(device)
    if vad != "cpu":
        plan_many([x[: rate * 60]], r, caps, vad_device=vad)  # the VAD network's first load
        res["vad_device"], pieces = timed(lambda: plan_many([x], r, caps, vad_device=vad)[0], repeats)
        res["vad_device"]["same_pieces_as_cpu"] = pieces == pieces_cpu
    else:
        pieces = pieces_cpu
    res["pieces"] = len(pieces)

    def run_model():
        outs = model.transcribe_batch([x[a:b] for a, b in pieces], r)
        _sync(device)
        return outs

    res["model"], outs = timed(run_model, repeats)
    res["merge"], _ = timed(lambda: merge_pieces([(a / rate, t) for (a, _b), t in zip(pieces, outs)],
                                                 x.size / rate, options=r, caps=caps), repeats)
    return res


def api(path: Path, model, repeats: int) -> dict:
    """``flashasr.transcribe`` with the default (parallel) decode and with one decode worker."""
    out: dict = {}
    texts = {}
    for name, env in (("parallel_decode", {}), ("parallel_decode_processes", {"FLASHASR_DECODE_POOL": "process"}),
                      ("sequential_decode", {"FLASHASR_DECODE_WORKERS": "1"})):
        saved = {k: os.environ.get(k) for k in ("FLASHASR_DECODE_WORKERS", "FLASHASR_DECODE_POOL")}
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(env)
        try:
            flashasr.transcribe(str(path), model=model)  # warm-up
            out[name], t = timed(lambda: flashasr.transcribe(str(path), model=model), repeats)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None)
                if v is not None:
                    os.environ[k] = v
        texts[name] = t.text
        out[name]["words_in_text"] = len(t.text.split())
    out["same_text"] = texts["parallel_decode"] == texts["sequential_decode"]
    return out


def job(path: Path, model, repeats: int) -> dict:
    """``run_job`` on the one file (what the CLI does after loading its model)."""
    from flashasr.jobs import run_job

    walls, report = [], None
    for i in range(repeats + 1):
        d = Path(tempfile.mkdtemp(prefix="longjob"))
        try:
            t = time.perf_counter()
            report = run_job([str(path)], model, d, "json", progress=False)
            if i:
                walls.append(time.perf_counter() - t)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return {"best_s": round(min(walls), 4), "median_s": round(statistics.median(walls), 4),
            "exit_code": report.exit_code, "workers": report.workers, "cpu_pool": report.cpu_pool}


def server(files: list[Path], spec: str, device: str, repeats: int, log_dir: Path) -> dict:
    """POST each file to a single-mode server started with the same model spec."""
    import httpx

    from bench_serve import Server

    srv = Server(["--model", spec, "--device", device], log_dir / "long_server.log", ready_timeout=600)
    out: dict = {"ready_s": round(srv.ready_s, 1)}
    try:
        with httpx.Client(timeout=600) as c:
            for p in files:
                body = p.read_bytes()

                timings: list[str] = []

                def post():
                    r = c.post(srv.base + "/v1/audio/transcriptions", files={"file": (p.name, body)},
                               data={"model": "m", "response_format": "json"})
                    r.raise_for_status()
                    timings.append(r.headers.get("server-timing", ""))
                    return r.json()

                post()  # warm-up
                out[p.name], got = timed(post, repeats)
                out[p.name]["words_in_text"] = len(got["text"].split())
                out[p.name]["server_timing"] = timings[1:]  # the server's own split (upload, decode, plan, ...)
    finally:
        srv.stop()
    return out


def cli(files: list[Path], spec: str, device: str) -> dict:
    out = {}
    for p in files:
        d = Path(tempfile.mkdtemp(prefix="longcli"))
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "flashasr", "transcribe", str(p), "--model", spec, "--device", device,
                            "-o", str(d)], capture_output=True, text=True)
        out[p.name] = {"wall_s_including_start_and_model_load": round(time.perf_counter() - t, 2),
                       "exit_code": r.returncode, "stderr_tail": r.stderr[-400:] if r.returncode else ""}
        shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3600.0)
    ap.add_argument("--codecs", default="mp3,opus")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--model", default="random:parakeet-tdt-0.6b-v3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--server", action="store_true")
    ap.add_argument("--cli", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--doors-only", action="store_true",
                    help="only the server and CLI doors (no model in this process: on a GPU too small for two copies)")
    a = ap.parse_args()
    if a.doors_only and not (a.server or a.cli):
        ap.error("--doors-only measures the server and the CLI: add --server and/or --cli")
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")

    cache = Path(a.cache_dir or tempfile.mkdtemp(prefix="longfiles"))
    cache.mkdir(parents=True, exist_ok=True)
    files = []
    for name in a.codecs.split(","):
        fmt, ext, *_ = FILES[name]
        p = cache / f"speech_{int(a.seconds)}s_{name}.{ext}"
        if not p.exists():
            print(f"encoding {p.name} ...", flush=True)
            encode_long(p, name, a.seconds)
        files.append(p)
    rows = {}
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"long_file_{'gpu' if a.device.startswith('cuda') else 'cpu'}.json"
    load_s, model = 0.0, None
    if not a.doors_only:
        t0 = time.perf_counter()
        model = flashasr.load_model(a.model, device=a.device)
        load_s = time.perf_counter() - t0
        flashasr.transcribe(str(files[0]), model=model)  # engine warm-up (graphs, profiles)
    opts = TranscribeOptions()
    for p in files if model is not None else ():
        print(f"{p.name}: stages ...", flush=True)
        audio_s = load_audio_parallel(p).duration
        rows[p.name] = {"audio_s": round(audio_s, 2), "bytes": p.stat().st_size,
                        "stages": stages(p, model, opts, a.device, a.repeats)}
        print(f"{p.name}: API and job ...", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"partial": rows}, indent=1) + "\n")
        rows[p.name]["job_in_process"] = job(p, model, a.repeats)
        out.write_text(json.dumps({"partial": rows}, indent=1) + "\n")
        rows[p.name]["api"] = api(p, model, a.repeats)
        out.write_text(json.dumps({"partial": rows}, indent=1) + "\n")
        _table({"results": {p.name: rows[p.name]}})
    result = {"benchmark": "long_file",
              "machine": {"host": platform.node(), "cpu": cpu_info(), "cores": os.cpu_count(), "gpu": _gpu(a.device)},
              "versions": versions(),
              "conditions": {"model": a.model, "device": a.device, "model_load_s": None if a.doors_only else round(load_s, 1),
                             "repeats": a.repeats, "timing": "wall; best and median after one untimed warm-up",
                             "files": "real speech of ../shared/audio cycled; mp3 44.1 kHz stereo 128 kb/s CBR, "
                                      "ogg/opus 48 kHz mono 32 kb/s; page cache warm"},
              "results": rows}
    out = Path(a.out) if a.out else REPO / "bench" / "results" / f"long_file_{'gpu' if a.device.startswith('cuda') else 'cpu'}.json"

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    save()
    if model is not None:
        del model
        import gc

        gc.collect()
        if a.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()  # the server loads its own copy
    for p in files:
        if p.name not in rows:  # --doors-only: the files' durations for the table
            rows[p.name] = {"audio_s": round(load_audio_parallel(p).duration, 2), "bytes": p.stat().st_size}
    if a.server:
        print("server ...", flush=True)
        result["server"] = server(files, a.model, a.device, a.repeats, out.parent)
        save()
    if a.cli:
        print("cli ...", flush=True)
        result["cli"] = cli(files, a.model, a.device)
        save()
    _table(result)
    print(f"wrote {out}")
    if not a.cache_dir:
        shutil.rmtree(cache, ignore_errors=True)  # the encoded hour of audio: kept only with --cache-dir


def _gpu(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name()


def _table(result: dict) -> None:
    print(f"{'file':28} {'audio s':>8} {'door / stage':34} {'best s':>8} {'median s':>9} {'speed factor':>13}")
    for name, r in result["results"].items():
        a = r["audio_s"]
        lines = [(f"stage {k}", v) for k, v in r.get("stages", {}).items() if isinstance(v, dict)]
        lines += [(f"api {k}", v) for k, v in r.get("api", {}).items() if isinstance(v, dict)]
        lines += [("job in process", r["job_in_process"])] if "job_in_process" in r else []
        srv = result.get("server", {}).get(name)
        if srv:
            lines.append(("server POST", srv))
        for label, v in lines:
            print(f"{name:28} {a:>8.0f} {label:34} {v['best_s']:>8.3f} {v['median_s']:>9.3f} {a / max(v['median_s'], 1e-9):>12.0f}x")
        c = result.get("cli", {}).get(name)
        if c:
            print(f"{name:28} {a:>8.0f} {'cli (start + model load + job)':34} "
                  f"{c['wall_s_including_start_and_model_load']:>8.2f}")


if __name__ == "__main__":
    main()
