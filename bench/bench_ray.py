"""Ray against local on one machine: the Ray Data job against the local job, ``serve --ray`` against
``serve --mode multi``, as ratios measured in the same run (issue #14's one-GPU benchmark).

* **jobs**: the same inputs (a corpus of compressed files on disk, each listed ``--reps`` times
  under ``repNNN/`` folders of symlinks, as ``bench_offline_e2e.py`` does) through
  :func:`flashasr.jobs.run_job` (the model loaded here first; default workers) and then through
  :func:`flashasr.jobs.ray_job.run_ray_job` on a Ray instance started by this process (the whole
  machine: its CPUs and GPUs; the capabilities of the model loaded here, so no probe). Outputs
  JSON to temporary folders. Reported per job: wall, speed factor; for Ray also the time to its
  first output (actor start, model load and engine build, first batch) and the steady speed
  factor after it (audio finished after the first output / the time after it); the ratios
  ``ray / local`` of both; the share of inputs whose texts are equal in both.
* **serve**: ``flashasr serve --mode multi --workers W`` and then ``flashasr serve --ray=local
  --workers W`` (W ingress replicas, one model replica), each with the same ``--offline-requests``
  uploads at ``--offline-concurrency`` and ``--streams`` binary streams at real-time pace
  (``bench_serve.py``'s load generators): upload speed factor, request latency, time to final;
  the ratios ``ray / multi`` (throughput) and ``multi / ray`` (latency: above 1 means Ray is faster).

    python bench/bench_ray.py --smoke                      # CPU, tiny.en, a few clips (~3 min here)
    # H200: scripts/gpu_bench_ray.sh (Parakeet-shaped model on CUDA)

Writes ``bench/results/<name>.json`` (machine, versions, conditions, every figure; a copy under
``$OUT`` when set) after each part, and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

SHARED = Path(os.environ.get("FLASHASR_SHARED", REPO.parent / "shared"))
SMOKE_CLIPS = ["en/en-ls-61-70968-0002.wav", "en/en-fleurs-003.ogg", "en/en-ls-2412-153948-0000.flac",
               "en/en-picovoice-numbers.wav", "en/en-vctk-p226-003.wav"]


def log(msg: str) -> None:
    print(f"[bench_ray {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _corpus(a) -> list[dict]:
    from bench_offline_e2e import read_corpus

    if a.corpus:
        return read_corpus(Path(a.corpus))
    return [{"path": c, "abspath": str((SHARED / "audio" / c).resolve())} for c in SMOKE_CLIPS]


def _texts(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): json.loads(p.read_text())["text"] for p in out.rglob("*.json")
            if p.name != "summary.jsonl"}


def run_jobs(a, result: dict, save) -> None:
    """Local job, then the Ray job, on the same inputs (see the module docstring)."""
    from bench_offline_e2e import build_inputs

    from flashasr.jobs import run_job
    from flashasr.jobs.ray_job import run_ray_job
    from flashasr.pipeline import load_model
    from flashasr.ray_cluster import connect

    files = _corpus(a)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    try:
        inputs = build_inputs(files, tmp / "in", a.reps)
        log(f"jobs: {len(inputs)} inputs ({len(files)} files x {a.reps}); loading {a.model} on {a.device}")
        t0 = time.perf_counter()
        model = load_model(a.model, device=a.device)
        load_s = time.perf_counter() - t0
        local = run_job([tmp / "in"], model, tmp / "local", "json", progress=False, keep_transcripts=False,
                        batch_size=a.batch_size)
        log(f"local job: {local.audio_s:.0f} s of audio in {local.wall_s:.2f} s ({local.speed_factor:.1f}x)")
        caps = model.capabilities
        del model
        if a.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        resources = connect("local")
        firsts: list[float] = []
        t_start = time.perf_counter()

        def first(res):
            firsts.append(time.perf_counter())
            first.audio.append((time.perf_counter(), res.duration or 0.0))

        first.audio = []
        ray_rep = run_ray_job([tmp / "in"], a.model, tmp / "ray", "json", device=a.device, capabilities=caps,
                              progress=False, keep_transcripts=False, on_result=first, batch_size=a.batch_size,
                              decode_cpus=a.decode_cpus)
        t_first = (firsts[0] - t_start) if firsts else None
        after = sum(d for t, d in first.audio[1:])
        # after the first output (start-up paid); only meaningful when most of the audio came after it
        steady = (after / (ray_rep.wall_s - t_first) if t_first is not None and len(first.audio) > 5
                  and after >= 0.5 * ray_rep.audio_s and ray_rep.wall_s > t_first + 1.0 else None)
        log(f"ray job: {ray_rep.audio_s:.0f} s in {ray_rep.wall_s:.2f} s ({ray_rep.speed_factor:.1f}x), "
            f"first output after {t_first:.1f} s, then {steady}x")
        tl, tr = _texts(tmp / "local"), _texts(tmp / "ray")
        same = sum(1 for k, v in tl.items() if tr.get(k) == v)
        result["jobs"] = {
            "inputs": len(inputs), "corpus_files": len(files), "reps": a.reps, "audio_s": round(local.audio_s, 1),
            "model_load_s_local": round(load_s, 2), "ray_resources": {k: resources.get(k) for k in ("CPU", "GPU")},
            "local": _job(local), "ray": {**_job(ray_rep), "first_output_s": None if t_first is None else
                                          round(t_first, 2), "steady_speed_factor": None if steady is None else
                                          round(steady, 1)},
            "ratio_speed_factor": round(ray_rep.speed_factor / local.speed_factor, 3) if local.speed_factor else None,
            "ratio_steady_speed_factor": round(steady / local.speed_factor, 3) if steady and local.speed_factor
            else None,
            # what a user waits for from the command: the local job's model load + its run against the whole
            # Ray job (its actor loads the same model inside the job's wall time)
            "local_with_load_wall_s": round(load_s + local.wall_s, 2),
            "ratio_speed_factor_with_load": round((load_s + local.wall_s) / ray_rep.wall_s, 3) if ray_rep.wall_s
            else None,
            "texts_equal": f"{same}/{len(tl)}", "files_failed": [len(local.failed), len(ray_rep.failed)],
        }
        save()
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _job(rep) -> dict:
    return {"wall_s": round(rep.wall_s, 3), "speed_factor": round(rep.speed_factor, 1), "files_ok": len(rep.ok),
            "batches": rep.n_batches, "pieces": rep.n_pieces,
            "mean_batch": round(rep.n_pieces / rep.n_batches, 1) if rep.n_batches else None,
            "model_busy_fraction": round(rep.model_busy_fraction, 3), "cpu_pool": rep.cpu_pool,
            "workers": rep.workers}


def run_serve(a, result: dict, save) -> None:
    """``serve --mode multi``, then ``serve --ray=local``, under the same load."""
    from bench_serve import Server, _read_clips, run_offline, run_streams

    clips = _read_clips(Path(a.clips), a.clip_min_s, a.clip_max_s, a.max_clips)
    pcms = [p for _n, p in clips]
    load = SimpleNamespace(client_procs=a.client_procs, offline_requests=a.offline_requests,
                           offline_concurrency=a.offline_concurrency, partial_ms=a.partial_ms, ramp_s=1.0,
                           final_timeout_s=60.0)
    base = [*(["--model", a.model] if a.model else []), "--device", a.device, "--workers", str(a.workers),
            "--max-batch", str(a.max_batch), "--log-level", "warning", "--no-access-log"]
    out = {"clips": len(clips), "load": vars(load), "streams": a.streams}
    for name, extra in (("multi", ["--mode", "multi"]), ("ray", ["--ray=local"])):
        log(f"serve {name}: starting")
        s = Server(base + extra, Path(tempfile.mkstemp(prefix=f"serve-{name}-", suffix=".log")[1]),
                   ready_timeout=a.ready_timeout_s)
        try:
            row = {"ready_s": round(s.ready_s, 1), "offline": run_offline(s, clips, load)}
            if a.streams:
                row["streams"] = run_streams(s, pcms, a.streams, 20, load)
        finally:
            s.stop()
        log(f"serve {name}: uploads {row['offline']['speed_factor']}x, p50 {row['offline']['latency'].get('p50_ms')} ms")
        out[name] = row
        result["serve"] = out
        save()
    m, r = out["multi"], out["ray"]
    out["ratio_upload_speed_factor"] = round(r["offline"]["speed_factor"] / m["offline"]["speed_factor"], 3)
    out["ratio_upload_p50_latency_multi_over_ray"] = _ratio(m["offline"]["latency"], r["offline"]["latency"], "p50_ms")
    if a.streams:
        out["ratio_final_p50_multi_over_ray"] = _ratio(m["streams"]["time_to_final"], r["streams"]["time_to_final"],
                                                       "p50_ms")
    save()


def _ratio(num: dict, den: dict, key: str):
    return round(num[key] / den[key], 3) if num.get(key) and den.get(key) else None


def _table(result: dict) -> str:
    rows = []
    j = result.get("jobs")
    if j:
        rows.append(f"job    local {j['local']['speed_factor']}x   ray {j['ray']['speed_factor']}x "
                    f"(steady {j['ray']['steady_speed_factor']}x after {j['ray']['first_output_s']} s)   "
                    f"ratio {j['ratio_speed_factor']} (steady {j['ratio_steady_speed_factor']}, with the local "
                    f"model load {j.get('ratio_speed_factor_with_load')})   "
                    f"texts equal {j['texts_equal']}")
    s = result.get("serve")
    if s and "ratio_upload_speed_factor" in s:
        rows.append(f"serve  uploads multi {s['multi']['offline']['speed_factor']}x   ray "
                    f"{s['ray']['offline']['speed_factor']}x   ratio {s['ratio_upload_speed_factor']}   p50 latency "
                    f"multi/ray {s['ratio_upload_p50_latency_multi_over_ray']}"
                    + (f"   final p50 multi/ray {s.get('ratio_final_p50_multi_over_ray')}" if s.get("streams") else ""))
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny.en, a few real clips, small loads")
    ap.add_argument("--parts", default="jobs,serve")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--corpus", default=None, help="bench_offline_e2e.py prepare's folder (default: a few clips)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--decode-cpus", type=float, default=0.5)
    ap.add_argument("--clips", default=str(SHARED / "audio" / "en"))
    ap.add_argument("--clip-min-s", type=float, default=2.0)
    ap.add_argument("--clip-max-s", type=float, default=12.0)
    ap.add_argument("--max-clips", type=int, default=16)
    ap.add_argument("--workers", type=int, default=1, help="front ends (multi) = ingress replicas (ray)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--offline-requests", type=int, default=64)
    ap.add_argument("--offline-concurrency", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--partial-ms", type=int, default=500)
    ap.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 2) // 4))
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.model, a.device = a.model or "tiny.en", "cpu"
        a.reps, a.offline_requests, a.offline_concurrency, a.streams = 2, 12, 4, 2
        a.max_clips, a.client_procs = 6, 1
    a.model = a.model or "tiny.en"
    name = a.name or ("ray_cpu_smoke" if a.smoke else f"ray_{'gpu' if a.device.startswith('cuda') else 'cpu'}")
    from bench_offline_e2e import environment

    import ray

    result = {"benchmark": "bench_ray", "env": {**environment(a.device), "ray": ray.__version__},
              "conditions": {"model": a.model, "device": a.device, "smoke": a.smoke, "batch_size": a.batch_size,
                             "decode_cpus": a.decode_cpus, "max_batch": a.max_batch, "workers": a.workers,
                             "order": "local first, then Ray (each part)", "outputs": "json to a temporary folder"}}
    out_path = REPO / "bench" / "results" / f"{name}.json"

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], out_path.name).write_text(out_path.read_text())

    parts = [p for p in a.parts.split(",") if p]
    if "jobs" in parts:
        run_jobs(a, result, save)
    if "serve" in parts:
        run_serve(a, result, save)
    print(_table(result))
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
