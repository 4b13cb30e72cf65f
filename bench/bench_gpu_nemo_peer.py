"""Peer benchmark: NVIDIA NeMo's own Parakeet-TDT inference vs our engine, SAME random weights.

Builds NeMo's ``EncDecRNNTBPEModel`` (nemo-toolkit 3.0.0, carried to the GPU machine as wheels:
``scripts/gpu_bench_nemo_peer.sh``) from the parakeet-tdt-0.6b-v3 architecture config
(``fixtures/parakeet/parakeet-tdt-0.6b-v3.yaml``) with an 8192-piece SentencePiece BPE stand-in
tokenizer (trained here in < 1 s on seeded synthetic text: texts are meaningless, token ids are
what is compared). Weights: our seeded random init (:func:`flashasr.models.parakeet.model.random_init`),
the joint calibrated to ~3.5 tokens per audio second on real speech (bench_gpu_common.calibrate_joint
through our bf16 engine on a copy of the model on the GPU, shape_random_joint + calibrate_random_joint
on CPU), then copied into NeMo's model with
``ours_to_nemo`` + ``load_state_dict(strict=True)``: both engines hold identical tensors.

Phases (each writes the partial JSON, so a run cut by ``--time-budget`` or an error still reports):

1. ``check_fp32``: one batch of real speech, float32, TF32 off: NeMo ``forward`` (preprocessor +
   encoder) vs our ``ParakeetASR.encode`` (max abs difference on valid frames), and NeMo's greedy
   TDT decoding (its default ``greedy_batch`` label-looping decoder) vs our label-looping decoder
   (token ids identical per input).
2. ``nemo_transcribe``: ``model.transcribe(list_of_numpy_arrays, batch_size=B, return_hypotheses=True)``
   (NeMo's public API; its dataloader pads each batch in input order) under bf16 autocast
   (``torch.autocast('cuda', bfloat16)``, as NeMo's transcribe_speech.py ``amp`` option does).
3. ``nemo_forward_sorted``: NeMo's modules called directly on length-sorted padded batches
   (``model.forward`` + ``model.decoding.rnnt_decoder_predictions_tensor``), bf16 autocast: NeMo's
   compute without its dataloader, batched like our engine (fairest compute-only peer).
4. ``ours``: :class:`flashasr.engine.offline.OfflineParakeetEngine` (bf16 encoder, CUDA-graph
   profiles, full-graph TDT decoder), pipelined and sequential.

Reported: speed factor (audio seconds / wall seconds) of each, speed-up of ours over each NeMo
path, token agreement (fraction of inputs with identical token ids) between every pair, NeMo's
decoder CUDA-graph mode, peak GPU memory. Inputs shorter than 1.0 s are zero-padded to 1.0 s
(half left, half right) for BOTH engines first, as NeMo's transcribe() does, so the outputs are
comparable.

Run (device): ``bash scripts/gpu_bench_nemo_peer.sh``; CPU smoke test (tiny config, needs nemo installed):
``PYTHONPATH=src:bench python bench/bench_gpu_nemo_peer.py --smoke``.
Writes bench/results/gpu_<name>.json (also copied to $OUT).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import math
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from bench_gpu_common import REPO, TUNE, V3_YAML_CANDIDATES, env_record, write_result

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# stand-in tokenizer
def train_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> Path:
    """Train a SentencePiece BPE model with exactly ``vocab_size`` pieces on seeded synthetic text
    (Zipf-distributed pseudo-words of consonant-vowel syllables; < 1 s for 8192 pieces).

    Piece 0 is ``<unk>``; no BOS/EOS pieces (NeMo's ``create_spt_model`` defaults for ASR).
    Returns the path of ``tokenizer.model`` in ``out_dir`` (NeMo's ``tokenizer.dir`` layout;
    ``vocab.txt`` written too).
    """
    import sentencepiece as spm

    rng = random.Random(seed)
    cons, vow = "bcdfghjklmnprstvwz", "aeiou"
    syl = [c + v for c in cons for v in vow] + [c + v + e for c in cons[:8] for v in vow for e in "nrst"]
    n_words = max(2000, vocab_size * 4)
    words = ["".join(rng.choice(syl) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(n_words)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    lines = [" ".join(rng.choices(words, weights, k=12)) for _ in range(max(5000, vocab_size * 8))]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0,
                                   num_threads=min(8, os.cpu_count() or 1), minloglevel=2)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    if sp.get_piece_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {sp.get_piece_size()} pieces, wanted {vocab_size}")
    (out_dir / "vocab.txt").write_text("".join(sp.id_to_piece(i) + "\n" for i in range(vocab_size)))
    return path


# ---------------------------------------------------------------------------------------------
# configs
def smoke_overrides(cfg: dict) -> dict:
    """Shrink the v3 config to a CPU-sized model with the same module types (2 layers, d_model 64,
    4 heads, 128-piece vocabulary, LSTM 2 x 64, joint 64)."""
    cfg = copy.deepcopy(cfg)
    cfg["model_defaults"].update(enc_hidden=64, pred_hidden=64, joint_hidden=64)
    cfg["encoder"].update(n_layers=2, d_model=64, n_heads=4, subsampling_conv_channels=16)
    cfg["decoder"]["prednet"].update(pred_hidden=64)
    cfg["decoder"]["vocab_size"] = 128
    cfg["joint"]["num_classes"] = 128
    cfg["joint"]["jointnet"].update(joint_hidden=64, encoder_hidden=64, pred_hidden=64)
    return cfg


def load_v3_config(path: Path | None) -> dict:
    from flashasr.models.parakeet.config import load_yaml_config

    p = path or next((c for c in V3_YAML_CANDIDATES if c.exists()), None)
    if p is None:
        raise FileNotFoundError(f"parakeet-tdt-0.6b-v3.yaml not found in {[str(c) for c in V3_YAML_CANDIDATES]}")
    return load_yaml_config(p)


def nemo_cfg(cfg: dict, tok_dir: Path):
    """NeMo DictConfig for EncDecRNNTBPEModel: our config dict with tokenizer.dir set."""
    from omegaconf import OmegaConf

    c = copy.deepcopy(cfg)
    c["tokenizer"] = {"dir": str(tok_dir), "type": "bpe"}
    for k in ("train_ds", "validation_ds", "test_ds"):
        c.pop(k, None)
    return OmegaConf.create(c)


# ---------------------------------------------------------------------------------------------
# data
def load_pieces(args) -> list[np.ndarray]:
    """Real speech pieces (float32 16 kHz); pieces < 1.0 s zero-padded to 1.0 s half left / half
    right (NeMo transcribe()'s pad_min_duration), the same arrays for both engines."""
    if args.speech and Path(args.speech).exists():
        from bench_gpu_common import load_speech

        pieces = load_speech(args.speech)
    else:  # fallback (smoke without speech file): clips from the shared audio folder
        from flashasr.audio.decode import load_audio

        audio = REPO.parent / "shared" / "audio"
        files = sorted((audio / "en").glob("*.wav"))[: args.max_pieces or 8]
        if not files:
            raise FileNotFoundError(f"no speech: {args.speech} missing and no wavs under {audio}/en")
        pieces = []
        for f in files:
            a = load_audio(str(f))
            a = np.asarray(getattr(a, "samples", a), dtype=np.float32).reshape(-1)
            pieces.append(a[: 20 * 16000])
    if args.max_pieces:
        pieces = pieces[: args.max_pieces]
    out = []
    for p in pieces:
        if len(p) < 16000:
            left = (16000 - len(p)) // 2
            p = np.pad(p, (left, 16000 - len(p) - left))
        out.append(np.ascontiguousarray(p, dtype=np.float32))
    return out


# ---------------------------------------------------------------------------------------------
# NeMo helpers
def hyp_ids(h) -> list[int]:
    """Token ids of a NeMo Hypothesis (y_sequence tensor or list)."""
    y = h.y_sequence
    return [int(t) for t in (y.tolist() if torch.is_tensor(y) else y)]


def flatten_hyps(res) -> list:
    """NeMo's transcribe()/decoding return shapes across versions -> flat list of Hypothesis."""
    if isinstance(res, tuple):  # (best, all) in older versions
        res = res[0]
    return list(res)


def nemo_graph_mode(model) -> str:
    """The CUDA-graph mode NeMo's TDT label-looping decoder ended up in (FULL_GRAPH, NO_WHILE_LOOPS,
    NO_GRAPHS) or a note why it could not be read."""
    try:
        comp = model.decoding.decoding.decoding_computer
        return str(getattr(comp, "cuda_graphs_mode", None))
    except AttributeError as e:
        return f"unknown ({e})"


def nemo_forward_decode(model, waves: list[np.ndarray], device: str, amp: bool) -> list[list[int]]:
    """NeMo modules on one padded batch: preprocessor + encoder (model.forward) + greedy TDT
    decoding (model.decoding.rnnt_decoder_predictions_tensor), eval mode. Returns token ids per input."""
    lens = torch.tensor([len(w) for w in waves], dtype=torch.long)
    x = torch.zeros(len(waves), int(lens.max()))
    for i, w in enumerate(waves):
        x[i, : len(w)] = torch.from_numpy(w)
    x, lens = x.to(device), lens.to(device)
    # NeMo 3.0.0 pitfall: transcribe() ends with encoder/decoder/joint .unfreeze(partial=True),
    # which calls .train() on them (dropout on) while model.training stays False
    model.eval()
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        enc, enc_len = model.forward(input_signal=x, input_signal_length=lens)
        hyps = model.decoding.rnnt_decoder_predictions_tensor(encoder_output=enc, encoded_lengths=enc_len,
                                                              return_hypotheses=True)
    return [hyp_ids(h) for h in flatten_hyps(hyps)]


def sorted_batches(lengths: list[int], max_batch: int, max_seconds: float) -> list[list[int]]:
    """Indices sorted longest first, cut into batches of <= max_batch rows and <= max_seconds of
    padded audio (rows x longest)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) >= max_batch or (len(cur) + 1) * lengths[cur[0]] > max_seconds * 16000):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Fraction of inputs whose token ids are identical, and of matching token positions."""
    n = min(len(a), len(b))
    same = sum(1 for i in range(n) if a[i] == b[i])
    tok_same = sum(sum(1 for x, y in zip(a[i], b[i]) if x == y) for i in range(n))
    tok_all = sum(max(len(a[i]), len(b[i])) for i in range(n))
    return {"inputs": n, "identical_inputs": same, "identical_fraction": same / max(1, n),
            "token_position_match": tok_same / max(1, tok_all),
            "tokens_a": sum(map(len, a[:n])), "tokens_b": sum(map(len, b[:n]))}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (wiring test)")
    ap.add_argument("--device", default=None, help="cuda (default if available) or cpu")
    ap.add_argument("--config", type=Path, default=None, help="NeMo-layout model config (default v3 yaml)")
    ap.add_argument("--speech", default=str(REPO / ".devdata" / "speech16k.npz"))
    ap.add_argument("--max-pieces", type=int, default=0, help="use only this many distinct pieces")
    ap.add_argument("--minutes", type=float, default=120.0, help="timed audio (distinct pieces repeated)")
    ap.add_argument("--nemo-batch", type=int, default=32, help="NeMo transcribe()/forward batch size")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=420.0, help="seconds; later phases are skipped")
    ap.add_argument("--name", default="nemo_peer")
    a = ap.parse_args(argv)

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if a.smoke:
        a.max_pieces = a.max_pieces or 6
        a.minutes = min(a.minutes, 0.5)
        a.runs = 1
        a.nemo_batch = min(a.nemo_batch, 4)
    name = a.name + ("_cpu_smoke" if not cuda else "")
    result: dict = {"benchmark": "NeMo's own Parakeet-TDT inference vs flashasr, same random 0.6B-v3 weights",
                    "status": "started", "env": env_record(), "args": vars(a) | {"config": str(a.config)},
                    "phases": {}}

    def save(status=None):
        if status:
            result["status"] = status
        result["elapsed_s"] = time.perf_counter() - T0
        return write_result(name, result)

    def left() -> float:
        return a.time_budget - (time.perf_counter() - T0)

    try:
        run(a, device, result, save, left)
        save("ok")
    except Exception as e:  # noqa: BLE001  (one unattended run: report, never lose the JSON)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        log(f"FAILED: {result['error']}")
        print(result["traceback"], flush=True)
        save("failed")
        return 1
    print_table(result)
    return 0


def run(a, device, result, save, left) -> None:
    cuda = device == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    log(f"device {device}; importing NeMo")
    t = time.perf_counter()
    import logging as _logging

    try:
        import nemo
    except ModuleNotFoundError as e:
        raise SystemExit(f"NeMo is not installed ({e}): on the GPU machine run scripts/gpu_bench_nemo_peer.sh, which "
                         f"installs the wheel set of docs/NEMO_PEER.md; here: pip install nemo-toolkit==3.0.0 "
                         f"plus that set") from None
    from nemo.collections.asr.models import EncDecRNNTBPEModel
    from nemo.utils import logging as nemo_logging

    nemo_logging.setLevel(_logging.ERROR)
    vers = {"nemo": nemo.__version__}
    for mod in ("lightning", "omegaconf", "hydra", "lhotse", "librosa", "numba", "transformers", "cuda.bindings"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            vers[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            vers[mod] = f"unavailable: {type(e).__name__}"
    result["versions"] = vers
    result["nemo_import_s"] = time.perf_counter() - t
    log(f"NeMo {vers['nemo']} imported in {result['nemo_import_s']:.1f} s ({vers})")

    from flashasr.models.parakeet.config import ParakeetConfig
    from flashasr.models.parakeet.model import ParakeetASR
    from flashasr.models.parakeet.nemo_format import ours_to_nemo

    cfg = load_v3_config(a.config)
    if a.smoke:
        cfg = smoke_overrides(cfg)
    pc = ParakeetConfig.from_dict(cfg)
    tmp = Path(tempfile.mkdtemp(prefix="nemo_peer_"))
    t = time.perf_counter()
    train_tokenizer(tmp / "tok", pc.vocab_size, seed=a.seed)
    log(f"tokenizer with {pc.vocab_size} pieces trained in {time.perf_counter() - t:.1f} s")

    pieces = load_pieces(a)
    distinct_s = sum(map(len, pieces)) / 16000
    log(f"{len(pieces)} distinct speech pieces, {distinct_s / 60:.1f} min")

    # -- our model (random weights) + joint calibration ------------------------------------------
    t = time.perf_counter()
    ours = ParakeetASR.from_config(cfg, tokenizer=None, device=device, dtype="float32", seed=a.seed,
                                   name="parakeet-tdt-0.6b-v3-random")
    calib = calibrate(ours, pieces, device, a.smoke)
    result["calibration"] = {"blank_bias": calib[0], "tokens_per_audio_s": calib[1]}
    log(f"our model built + joint calibrated in {time.perf_counter() - t:.1f} s: blank bias {calib[0]:.3f}, "
        f"{calib[1]:.2f} tokens/s")

    # -- NeMo model, same tensors ------------------------------------------------------------------
    t = time.perf_counter()
    torch.manual_seed(a.seed)
    try:  # NeMo's own init of 0.6B parameters takes minutes on a few CPU cores: run it on the GPU
        with torch.device(device):
            nemo_model = EncDecRNNTBPEModel(cfg=nemo_cfg(cfg, tmp / "tok"), trainer=None)
        built_on = device
    except Exception as e:  # noqa: BLE001
        log(f"building NeMo's model under torch.device({device!r}) failed ({type(e).__name__}: {e}); CPU")
        nemo_model = EncDecRNNTBPEModel(cfg=nemo_cfg(cfg, tmp / "tok"), trainer=None)
        built_on = "cpu"
    state = ours_to_nemo({k: v.detach().float() for k, v in ours.net.state_dict().items()}, pc.joint_out_index)
    missing, unexpected = nemo_model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not fit NeMo's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    nemo_model = nemo_model.to(device).eval()
    n_params = sum(p.numel() for p in nemo_model.parameters())
    result["model"] = {"nemo_class": type(nemo_model).__name__, "nemo_parameters": n_params,
                       "ours_parameters": ours.num_parameters(), "vocab": pc.vocab_size,
                       "encoder_layers": pc.encoder.n_layers, "d_model": pc.encoder.d_model,
                       "nemo_decoding": str(nemo_model.cfg.decoding.get("strategy")),
                       "nemo_built_on": built_on, "nemo_build_s": time.perf_counter() - t}
    log(f"NeMo model built and loaded with our weights in {time.perf_counter() - t:.1f} s ({n_params / 1e6:.1f} M params)")
    save()

    # -- phase 1: float32 correctness --------------------------------------------------------------
    chk = pieces[: min(32 if cuda else 8, len(pieces))]
    t = time.perf_counter()
    audio = torch.zeros(len(chk), max(map(len, chk)))
    for i, w in enumerate(chk):
        audio[i, : len(w)] = torch.from_numpy(w)
    alen = torch.tensor([len(w) for w in chk])
    with torch.inference_mode():
        ne, nlen = nemo_model.forward(input_signal=audio.to(device), input_signal_length=alen.to(device))
        oe, olen = ours.encode(audio, alen)
    ne = ne.transpose(1, 2).float()  # NeMo [B, d, T] -> [B, T, d]
    lens_equal = bool(torch.equal(nlen.cpu(), olen.cpu()))
    diffs = [float((ne[b, : nlen[b]] - oe[b, : nlen[b]].float()).abs().max()) for b in range(len(chk))]
    scale = float(ne.abs().max())
    nemo_ids = nemo_forward_decode(nemo_model, chk, device, amp=False)
    ours_ids = [h.token_ids for h in ours.decode(oe, olen)]
    ours_on_nemo_enc = [h.token_ids for h in ours.decode(ne.to(oe.dtype), nlen)]
    result["phases"]["check_fp32"] = {
        "inputs": len(chk), "encoded_lengths_equal": lens_equal, "encoder_max_abs_diff": max(diffs),
        "encoder_output_max_abs": scale,
        "decode_nemo_vs_ours": agreement(nemo_ids, ours_ids),
        "decode_nemo_vs_ours_on_nemo_encoder_output": agreement(nemo_ids, ours_on_nemo_enc),
        "nemo_decoder_graph_mode": nemo_graph_mode(nemo_model), "s": time.perf_counter() - t}
    log(f"fp32 check: lengths equal {lens_equal}, encoder max |diff| {max(diffs):.2e} (max |x| {scale:.2f}), "
        f"decode identical {result['phases']['check_fp32']['decode_nemo_vs_ours']['identical_inputs']}/{len(chk)}")
    del ne, oe
    save()

    # -- timed workload ----------------------------------------------------------------------------
    reps = max(1, math.ceil(a.minutes * 60 / distinct_s))
    waves = pieces * reps
    audio_s = sum(map(len, waves)) / 16000
    result["conditions"] = {
        "model": f"parakeet-tdt-0.6b-v3 shapes{' (SMOKE: tiny)' if a.smoke else ''}, random weights, identical in both",
        "audio_s": audio_s, "distinct_pieces": len(pieces), "distinct_audio_s": distinct_s, "repeats": reps,
        "inputs": len(waves), "nemo_batch": a.nemo_batch, "runs": a.runs,
        "nemo_precision": "bf16 autocast (weights float32)" if cuda else "float32",
        "ours_precision": "bf16 encoder weights, float32 norms/log-mel/decoder" if cuda else "float32",
        "inputs_under_1s": "zero-padded to 1.0 s (both engines)", "tf32": True,
        "ours_engine_settings": TUNE,
        "excluded": "audio decoding/resampling (arrays in memory), model construction, warm-up"}
    log(f"timed workload: {len(waves)} inputs, {audio_s / 60:.1f} min of audio")
    torch.backends.cuda.matmul.allow_tf32 = True  # timed phases: as bench_gpu_e2e.py, for both engines
    torch.backends.cudnn.allow_tf32 = True
    amp = cuda
    ref_ids: dict[str, list[list[int]]] = {}

    # -- phase 2: NeMo transcribe() -----------------------------------------------------------------
    if left() > 60 or a.smoke:
        ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp else contextlib.nullcontext

        def nemo_transcribe(ws):
            with ctx():
                return flatten_hyps(nemo_model.transcribe(ws, batch_size=a.nemo_batch, return_hypotheses=True,
                                                          verbose=False, num_workers=0))
        t = time.perf_counter()
        nemo_transcribe(pieces[: a.nemo_batch * 2])  # warm-up: cuda graphs, cudnn, allocator
        warm = time.perf_counter() - t
        runs = []
        for r in range(a.runs):
            if r and left() < 30 and not a.smoke:
                break
            sync(device)
            t = time.perf_counter()
            hyps = nemo_transcribe(waves)
            sync(device)
            runs.append(time.perf_counter() - t)
            log(f"nemo transcribe run {r}: {runs[-1]:.2f} s, speed factor {audio_s / runs[-1]:.0f}")
        ref_ids["nemo_transcribe"] = [hyp_ids(h) for h in hyps]
        result["phases"]["nemo_transcribe"] = {
            "warmup_s": warm, "wall_s": runs, "speed_factor_best": audio_s / min(runs),
            "tokens_per_audio_s": sum(map(len, ref_ids["nemo_transcribe"])) / audio_s,
            "decoder_graph_mode": nemo_graph_mode(nemo_model),
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        save()
    else:
        result["phases"]["nemo_transcribe"] = {"skipped": f"time budget ({left():.0f} s left)"}

    # -- phase 3: NeMo modules, length-sorted batches ------------------------------------------------
    if left() > 45 or a.smoke:
        lens = [len(w) for w in waves]
        plan = sorted_batches(lens, a.nemo_batch, max_seconds=a.nemo_batch * 30.0)

        def nemo_sorted():
            ids: list = [None] * len(waves)
            for idx in plan:
                for i, tok in zip(idx, nemo_forward_decode(nemo_model, [waves[i] for i in idx], device, amp)):
                    ids[i] = tok
            return ids
        t = time.perf_counter()
        nemo_forward_decode(nemo_model, pieces[: a.nemo_batch], device, amp)
        warm = time.perf_counter() - t
        runs = []
        for r in range(a.runs):
            if r and left() < 25 and not a.smoke:
                break
            sync(device)
            t = time.perf_counter()
            ids = nemo_sorted()
            sync(device)
            runs.append(time.perf_counter() - t)
            log(f"nemo forward (sorted batches) run {r}: {runs[-1]:.2f} s, speed factor {audio_s / runs[-1]:.0f}")
        ref_ids["nemo_forward_sorted"] = ids
        result["phases"]["nemo_forward_sorted"] = {
            "warmup_s": warm, "wall_s": runs, "speed_factor_best": audio_s / min(runs), "batches": len(plan),
            "tokens_per_audio_s": sum(map(len, ids)) / audio_s,
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        save()
    else:
        result["phases"]["nemo_forward_sorted"] = {"skipped": f"time budget ({left():.0f} s left)"}

    # -- phase 4: our engine ---------------------------------------------------------------------------
    nemo_model = None  # free its GPU memory before our engine captures its graphs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    from flashasr.engine.offline import OfflineParakeetEngine
    from flashasr.engine.profiles import choose_profiles

    t = time.perf_counter()
    eng = OfflineParakeetEngine(ours, profiles=choose_profiles(), with_text=False, **TUNE)
    lens = [len(w) for w in waves]
    eng.warmup(lens)
    eng.transcribe_arrays(pieces)
    warm = time.perf_counter() - t
    variants = ("pipelined", "sequential") if cuda else ("sequential",)
    for v in variants:
        runs = []
        for r in range(a.runs):
            if r and left() < 10 and not a.smoke:
                break
            out = eng.transcribe_arrays(waves, pipelined=(v == "pipelined"))
            runs.append(out.timings["total"])
            log(f"ours {v} run {r}: {runs[-1]:.2f} s, speed factor {audio_s / runs[-1]:.0f}")
        ref_ids[f"ours_{v}"] = [list(it.token_ids) for it in out.items]
        result["phases"][f"ours_{v}"] = {
            "warmup_s": warm, "wall_s": runs, "speed_factor_best": audio_s / min(runs),
            "timings_last_s": out.timings, "decoder_modes": out.decoder_modes,
            "tokens_per_audio_s": sum(map(len, ref_ids[f"ours_{v}"])) / audio_s,
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
        save()

    # -- comparisons -----------------------------------------------------------------------------------
    n = len(pieces)  # distinct inputs (repeats give the same tokens)
    keys = list(ref_ids)
    result["agreement_distinct_inputs"] = {f"{x}__vs__{y}": agreement(ref_ids[x][:n], ref_ids[y][:n])
                                           for i, x in enumerate(keys) for y in keys[i + 1:]}
    ph = result["phases"]
    best_ours = max((ph[k]["speed_factor_best"] for k in ph if k.startswith("ours_")), default=None)
    result["speedup_ours_over"] = {k: best_ours / ph[k]["speed_factor_best"] for k in ("nemo_transcribe", "nemo_forward_sorted")
                                   if best_ours and "speed_factor_best" in ph.get(k, {})}


def calibrate(ours, pieces, device, smoke) -> tuple[float, float]:
    """Joint output statistics like real speech (~3.5 tokens per audio second); see module doc."""
    if device == "cuda":
        from bench_gpu_common import calibrate_joint
        from flashasr.engine.offline import OfflineParakeetEngine
        from flashasr.engine.profiles import choose_profiles

        # the engine fuses and casts the encoder in place: calibrate on a copy (bf16 engine, as
        # bench_gpu_e2e.py does), then take over only the calibrated joint
        twin = copy.deepcopy(ours)
        eng = OfflineParakeetEngine(twin, profiles=choose_profiles()[:1], with_text=False, use_graphs=False)
        audio, alen = eng.uploader.upload(pieces[:64])
        f, flen = eng.encoder.forward_eager(audio, alen)
        res = calibrate_joint(twin, f.float(), flen)
        ours.joint.load_state_dict(twin.joint.state_dict())
        del eng, twin, f
        torch.cuda.empty_cache()
        return res
    from flashasr.random_models import calibrate_random_joint, shape_random_joint

    shape_random_joint(ours)
    return calibrate_random_joint(ours, pieces[:4], iters=6 if smoke else 10)


def print_table(result: dict) -> None:
    ph = result.get("phases", {})
    print("\n path                    speed factor   wall s (runs)          tokens/s")
    for k, v in ph.items():
        if "speed_factor_best" in v:
            print(f" {k:22s} {v['speed_factor_best']:12.0f}   {', '.join(f'{x:.2f}' for x in v['wall_s']):22s} "
                  f"{v['tokens_per_audio_s']:6.2f}")
    for k, v in result.get("speedup_ours_over", {}).items():
        print(f" ours / {k}: {v:.2f}x")
    for k, v in result.get("agreement_distinct_inputs", {}).items():
        print(f" agreement {k}: {v['identical_inputs']}/{v['inputs']} identical inputs, "
              f"{v['token_position_match']:.3f} token positions")
    c = ph.get("check_fp32", {})
    if c:
        print(f" fp32 check: encoder max |diff| {c['encoder_max_abs_diff']:.2e}, decode identical "
              f"{c['decode_nemo_vs_ours']['identical_inputs']}/{c['inputs']}, NeMo graph mode {c['nemo_decoder_graph_mode']}")


if __name__ == "__main__":
    sys.exit(main())
