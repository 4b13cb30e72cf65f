"""Parakeet-TDT model: modules, ``.nemo`` loading and transcription (our own PyTorch code).

Pipeline (NeMo ``EncDecRNNTBPEModel`` with TDT greedy decoding):
waveform ``[N]`` float32 16 kHz -> :class:`MelPreprocessor` ``[B, n_mels, T_feat]`` ->
:class:`ConformerEncoder` ``[B, T_enc, d]`` (80 ms frames for v2/v3) -> batched label-looping
greedy TDT (:func:`greedy_tdt_label_looping`) -> token ids, frames, durations ->
SentencePiece text and timestamps (:mod:`.timestamps`).

Long recordings: inputs longer than ``max_segment_seconds`` are cut at pauses (VAD) into
pieces of at most that length (``flashasr.audio.vad.split_for_asr``; a built-in low-energy
cut is used when that module is unavailable), decoded as one batch, and their timestamps
shifted to global time. See docs/PARAKEET.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ...errors import ModelLoadError, check_task
from ...types import Transcript
from ..base import ASRModel, as_waveform
from .config import ParakeetConfig
from .decoder import Hypothesis, TDTJoint, TDTPredictor, greedy_tdt_label_looping, greedy_tdt_reference
from .encoder import ConformerEncoder
from .preprocessor import MelPreprocessor
from .timestamps import build_segments, group_words, token_times
from .tokenizer import DummyTokenizer, SentencePieceTokenizer

_DTYPES = {None: torch.float32, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    """``None``/"float32"/"bfloat16"/"float16" (or a torch.dtype) -> torch.dtype.

    Raises:
        ModelLoadError (code ``invalid_dtype``) for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
    elif dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ModelLoadError(f"dtype {dtype!r} is not supported (float32, bfloat16, float16)", code="invalid_dtype")


class ParakeetModule(nn.Module):
    """All weights: ``preprocessor`` (float32 buffers), ``encoder``, ``predictor``, ``joint``."""

    def __init__(self, cfg: ParakeetConfig):
        super().__init__()
        self.preprocessor = MelPreprocessor(cfg.preprocessor)
        self.encoder = ConformerEncoder(cfg.encoder)
        self.predictor = TDTPredictor(cfg.vocab_size, cfg.pred_hidden, cfg.pred_rnn_layers)
        d_out = cfg.encoder.feat_out if cfg.encoder.feat_out and cfg.encoder.feat_out > 0 else cfg.encoder.d_model
        self.joint = TDTJoint(d_out, cfg.pred_hidden, cfg.joint_hidden, cfg.vocab_size, cfg.durations,
                              cfg.joint_activation, cfg.max_symbols)


@torch.no_grad()
def random_init(net: "ParakeetModule", seed: int = 0) -> None:
    """Fill every parameter/buffer in place (on its device and dtype) with a seeded random init.

    Weights of Linear/Conv/LSTM/Embedding: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PyTorch's
    default bound); biases the same bound; norm weights 1 + small noise, norm biases small noise;
    ``pos_bias_u/v`` small noise; BatchNorm running mean 0 / var 1; the blank embedding row 0.
    """
    dev = next(net.parameters()).device
    gen = torch.Generator(device=dev)
    gen.manual_seed(int(seed))
    for mod_name, mod in net.named_modules():
        if mod_name.startswith("preprocessor"):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(mod, (nn.LayerNorm, nn.BatchNorm1d, nn.GroupNorm)):
                p.uniform_(-0.1, 0.1, generator=gen)
                if pname == "weight":
                    p.add_(1.0)
            elif pname.startswith("pos_bias"):
                p.uniform_(-0.1, 0.1, generator=gen)
            else:
                if isinstance(mod, nn.LSTM):
                    fan_in = mod.hidden_size
                elif isinstance(mod, nn.Embedding):
                    fan_in = 1
                elif pname == "bias":
                    fan_in = mod.weight[0].numel()
                else:
                    fan_in = p[0].numel()
                bound = 1.0 / (fan_in ** 0.5)
                p.uniform_(-bound, bound, generator=gen)
        if isinstance(mod, nn.BatchNorm1d):
            mod.running_mean.zero_()
            mod.running_var.fill_(1.0)
            mod.num_batches_tracked.zero_()
    net.predictor.embed.weight[net.predictor.blank_id].zero_()


def _fallback_split(samples: np.ndarray, sr: int, max_s: float) -> list[tuple[int, int]]:
    """Cut into pieces <= ``max_s`` seconds at the quietest 10 ms frame of each window's last 30 %."""
    n = len(samples)
    max_n = max(int(max_s * sr), sr)
    hop = sr // 100
    out, start = [], 0
    while n - start > max_n:
        lo, hi = start + int(0.7 * max_n), start + max_n
        seg = samples[lo:hi]
        k = max(len(seg) // hop, 1)
        energy = (seg[: k * hop].astype(np.float64).reshape(k, -1) ** 2).mean(1) if len(seg) >= hop else np.zeros(1)
        cut = lo + int(np.argmin(energy)) * hop + hop // 2
        cut = min(max(cut, start + 1), hi)
        out.append((start, cut))
        start = cut
    out.append((start, n))
    return out


def split_long_audio(samples: np.ndarray, sr: int, max_s: float, method: str = "vad") -> list[tuple[int, int]]:
    """Sample ranges ``[(start, end)]`` for the ASR passes, each at most ``max_s`` seconds.

    Audio up to ``max_s`` is one range. Longer audio goes through
    ``flashasr.audio.vad.split_for_asr(samples, sr, max_segment_s=max_s, method=method)``
    (``vad``: cut at pauses, stretches without speech left out, possibly no range at all;
    ``fixed``: consecutive windows); if that module is unavailable, a built-in cut at the
    quietest 10 ms frame of each window's last 30 %.
    """
    n = len(samples)
    if n <= max_s * sr:
        return [(0, n)]
    try:
        from ...audio.vad import split_for_asr
    except ImportError:
        return _fallback_split(samples, sr, max_s)
    out = []
    for a, b in split_for_asr(samples, sr, max_segment_s=max_s, method=method):
        a, b = max(0, int(a)), min(n, int(b))
        if b > a:
            out.append((a, b))
    return out


def _looks_multilingual(tokenizer) -> bool:
    """True when >= 2 % of the pieces carry non-ASCII letters (v3's 25-language vocabulary;
    v2's English 1024-piece vocabulary does not). Parakeet never detects a language explicitly."""
    n = int(getattr(tokenizer, "vocab_size", 0) or 0)
    if n == 0 or isinstance(tokenizer, DummyTokenizer):
        return False
    hits = sum(1 for i in range(n) if any(c.isalpha() and ord(c) > 127 for c in tokenizer.piece(i)))
    return hits >= 0.02 * n


class ParakeetASR(ASRModel):
    """A loaded Parakeet-TDT model (our implementation; no NeMo needed).

    Attributes (besides :class:`~flashasr.models.base.ASRModel`'s): ``net`` (the
    :class:`ParakeetModule`), ``preprocessor``, ``encoder``, ``predictor`` (:class:`TDTPredictor`),
    ``joint`` (:class:`TDTJoint`), ``blank_id`` (= V), ``durations``, ``num_classes_with_blank``
    (= V + 1), ``max_symbols_per_step``, ``frame_seconds`` (0.08 for v2/v3), ``dtype`` (of the
    encoder; the preprocessor computes in float32, the predictor and joint are kept float32),
    ``decoding`` ("label_looping" or "reference"), ``long_audio_method`` ("vad"/"fixed"),
    ``batch_size`` (pieces per encoder batch), ``pad_min_seconds`` (default 0: pieces shorter
    than this are zero-padded half left / half right first, as NeMo ``transcribe()`` does with
    1.0 s; timestamps stay relative to the unpadded audio, clamped to it).
    """

    family = "parakeet"

    def __init__(self, cfg: ParakeetConfig, net: ParakeetModule, tokenizer, *, device: str = "cpu",
                 dtype=None, name: str = "parakeet-tdt"):
        self.cfg = cfg
        self.net = net
        self.tokenizer = tokenizer
        self.name = name
        self.dtype = parse_dtype(dtype)
        self.device = str(device)
        self.sample_rate = cfg.preprocessor.sample_rate
        self.max_segment_seconds = 60.0
        self.long_audio_method = "vad"
        self.decoding = "label_looping"
        self.batch_size = 16
        self.pad_min_seconds = 0.0
        self.blank_id = cfg.blank_id
        self.durations = list(cfg.durations)
        self.num_classes_with_blank = cfg.vocab_size + 1
        self.max_symbols_per_step = cfg.max_symbols
        self.frame_seconds = cfg.frame_seconds
        self.multilingual = _looks_multilingual(tokenizer)
        try:
            net.to(device=device)
        except (RuntimeError, AssertionError) as e:
            raise ModelLoadError(f"cannot move the model to device {device!r}: {e}", code="invalid_device") from e
        net.encoder.to(dtype=self.dtype)
        # prediction and joint networks stay float32 (small; keeps greedy decisions stable in
        # bf16/fp16 runs); the encoder output is cast to float32 before the joint projection
        net.predictor.to(dtype=torch.float32)
        net.joint.to(dtype=torch.float32)
        net.predictor.lstm.flatten_parameters()  # one contiguous weight block for cuDNN
        net.eval()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict, tokenizer=None, *, device: str = "cpu", dtype=None, seed: int = 0,
                    name: str = "parakeet-random") -> "ParakeetASR":
        """Random weights (seeded) for a NeMo-layout config dict.

        The modules are created on the meta device and filled directly on ``device`` in
        ``dtype`` (:func:`random_init`), so even the 0.6B model builds in seconds.
        ``tokenizer`` None -> a :class:`DummyTokenizer` with the config's vocabulary size.
        Same ``seed``, device and dtype -> same weights.
        """
        pc = ParakeetConfig.from_dict(cfg)
        dt = parse_dtype(dtype)
        with torch.device("meta"):
            net = ParakeetModule(pc)
        net = net.to_empty(device=device)
        net.encoder.to(dtype=dt)
        random_init(net, seed)
        net.preprocessor.load_state_dict(MelPreprocessor(pc.preprocessor).state_dict())
        if tokenizer is None:
            tokenizer = DummyTokenizer(pc.vocab_size)
        return cls(pc, net, tokenizer, device=device, dtype=dt, name=name)

    @classmethod
    def from_nemo(cls, path, *, device: str = "cpu", dtype=None) -> "ParakeetASR":
        """Load a ``.nemo`` archive; see :func:`load_parakeet`."""
        from .nemo_format import load_mapped_state, nemo_to_ours, read_nemo

        arch = read_nemo(path)
        pc = ParakeetConfig.from_dict(arch.config)
        if arch.tokenizer_model is None:
            raise ModelLoadError(f"model {str(path)!r}: config has no tokenizer.model_path (SentencePiece)")
        tok = SentencePieceTokenizer(arch.tokenizer_model, source=str(path))
        if tok.vocab_size != pc.vocab_size:
            raise ModelLoadError(f"model {str(path)!r}: tokenizer has {tok.vocab_size} pieces but the "
                                 f"decoder expects vocab_size={pc.vocab_size}")
        # build without initialising (meta), then adopt the checkpoint tensors (no copy)
        with torch.device("meta"):
            net = ParakeetModule(pc)
        net = net.to_empty(device="cpu")
        net.preprocessor.load_state_dict(MelPreprocessor(pc.preprocessor).state_dict())  # if not stored
        for m in net.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.num_batches_tracked.zero_()
        state = nemo_to_ours(arch.state_dict, pc.joint_out_index, pc.encoder.n_layers)
        load_mapped_state(net, state, str(path))
        return cls(pc, net, tok, device=device, dtype=dtype, name=Path(path).stem)

    # -- properties for the engine ---------------------------------------------------------------
    @property
    def preprocessor(self) -> MelPreprocessor:
        return self.net.preprocessor

    @property
    def encoder(self) -> ConformerEncoder:
        return self.net.encoder

    @property
    def predictor(self) -> TDTPredictor:
        return self.net.predictor

    @property
    def joint(self) -> TDTJoint:
        return self.net.joint

    def num_parameters(self) -> int:
        """Trainable parameters (BatchNorm statistics and preprocessor buffers excluded)."""
        return sum(p.numel() for p in self.net.parameters())

    # -- computation -------------------------------------------------------------------------------
    def _pad_batch(self, waveforms: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = [len(w) for w in waveforms]
        x = np.zeros((len(waveforms), max(lengths) if lengths else 0), dtype=np.float32)
        for i, w in enumerate(waveforms):
            x[i, : len(w)] = w
        return torch.from_numpy(x).to(self.device), torch.tensor(lengths, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def features(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features ``[B, n_mels, T_feat]`` float32 + lengths ``[B]`` (see MelPreprocessor)."""
        return self.net.preprocessor(audio.to(self.device), lengths.to(self.device))

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded waveforms ``[B, N]`` + lengths -> encoder output ``[B, T_enc, d]`` (model dtype) + lengths."""
        feats, flen = self.features(audio, lengths)
        return self.net.encoder(feats, flen, channels_last=True)

    @torch.inference_mode()
    def decode(self, enc: torch.Tensor, enc_lengths: torch.Tensor) -> list[Hypothesis]:
        """Greedy TDT decoding of ``[B, T_enc, d]`` (label looping by default)."""
        fn = greedy_tdt_label_looping if self.decoding == "label_looping" else greedy_tdt_reference
        enc = enc.to(self.joint.enc.weight.dtype)
        return fn(enc, enc_lengths, self.predictor, self.joint, self.durations, self.blank_id,
                  self.max_symbols_per_step)

    def _decode_pieces(self, pieces: list[np.ndarray]) -> list[Hypothesis]:
        order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i]))
        hyps: list[Hypothesis | None] = [None] * len(pieces)
        # shorter than one encoder frame (80 ms for v2/v3): nothing to decode -> empty hypothesis
        min_n = self.preprocessor.hop_length * self.cfg.encoder.subsampling_factor
        for s in range(0, len(order), self.batch_size):
            idx = order[s: s + self.batch_size]
            run = [i for i in idx if len(pieces[i]) >= min_n]
            for i in idx:
                if len(pieces[i]) < min_n:
                    hyps[i] = Hypothesis()
            if not run:
                continue
            audio, lengths = self._pad_batch([pieces[i] for i in run])
            enc, enc_len = self.encode(audio, lengths)
            for i, h in zip(run, self.decode(enc, enc_len)):
                hyps[i] = h
        return hyps  # type: ignore[return-value]

    def _check_waveform(self, w) -> np.ndarray:
        return as_waveform(w)

    def transcribe_batch(self, waveforms: Sequence[np.ndarray], *, language: str | None = None,
                         word_timestamps: bool = False, task: str = "transcribe") -> list[Transcript]:
        """Transcribe several waveforms together (pieces of all inputs share encoder batches).

        Each waveform: float32 ``[N]`` at ``sample_rate`` Hz. ``language`` does not steer
        Parakeet (v3 recognises its 25 languages implicitly); it is echoed in the result, and
        None stays None. Results equal per-input :meth:`transcribe_waveform`. Parakeet-TDT only
        transcribes: ``task="translate"`` raises :class:`~flashasr.errors.UnsupportedTaskError`.
        """
        check_task(task, translates=False, model=self.name, family="parakeet-tdt")
        waves = [self._check_waveform(w) for w in waveforms]
        sr = self.sample_rate
        spans: list[list[tuple[int, int]]] = []
        pieces: list[np.ndarray] = []
        min_len = int(round(self.pad_min_seconds * sr))
        shifts: list[int] = []
        for w in waves:
            sp = split_long_audio(w, sr, self.max_segment_seconds, self.long_audio_method)
            spans.append(sp)
            for a, b in sp:
                piece = w[a:b]
                left = 0
                if len(piece) < min_len:  # NeMo transcribe(): zero-pad short clips, half each side
                    left = (min_len - len(piece)) // 2
                    piece = np.concatenate([np.zeros(left, np.float32), piece,
                                            np.zeros(min_len - len(piece) - left, np.float32)])
                pieces.append(piece)
                shifts.append(left)
        hyps = self._decode_pieces(pieces)
        out, k = [], 0
        for w, sp in zip(waves, spans):
            parts = []
            for a, _b in sp:
                parts.append((hyps[k], (a - shifts[k]) / sr))
                k += 1
            out.append(self.build_transcript(parts, len(w) / sr, language=language,
                                             word_timestamps=word_timestamps))
        return out

    def build_transcript(self, parts: Sequence[tuple[Hypothesis, float]], duration: float, *,
                         language: str | None = None, word_timestamps: bool = False) -> Transcript:
        """A :class:`~flashasr.types.Transcript` from decoded pieces of one recording.

        Args:
            parts: ``(hypothesis, offset_seconds)`` per piece in time order (offset = the piece's
                start in the recording); hypotheses from any decoder with this model's
                vocabulary (e.g. the GPU engine's).
            duration: recording length in seconds (all times are clamped to ``[0, duration]``).
        Returns:
            text (a single piece: exactly the SentencePiece decode; several: stripped piece texts
            joined by a space), segments (with words) and, if asked, words; times global.
        """
        texts, words_all, segs = [], [], []
        for h, offset in parts:
            text = self.tokenizer.decode(h.token_ids)
            if text.strip():
                texts.append(text.strip() if len(parts) > 1 else text)
            toks = token_times(h.token_ids, h.token_frames, h.token_durations, self.frame_seconds,
                               offset=offset, duration=duration, tokenizer=self.tokenizer)
            words = group_words(toks, self.tokenizer)
            segs.extend(build_segments(words, first_id=len(segs)))
            words_all.extend(w_ for w_, _ in words)
        text = texts[0] if len(texts) == 1 else " ".join(texts)
        return Transcript(text=text, language=language, duration=duration, segments=segs,
                          words=words_all if word_timestamps else None, model=self.name)

    def transcribe_waveform(self, waveform: np.ndarray, *, language: str | None = None,
                            word_timestamps: bool = False, task: str = "transcribe") -> Transcript:
        """Transcribe one recording of any length (see :class:`~flashasr.models.base.ASRModel`).

        Audio shorter than one encoder frame (hop x subsampling = 80 ms for v2/v3) gives an empty
        transcript. Recordings longer than ``max_segment_seconds`` are cut at pauses; timestamps
        stay global.
        """
        return self.transcribe_batch([waveform], language=language, word_timestamps=word_timestamps, task=task)[0]


def load_parakeet(path: str | os.PathLike, *, device: str = "cpu", dtype=None) -> ParakeetASR:
    """Load a NeMo Parakeet-TDT ``.nemo`` file with our implementation.

    Args:
        path: the ``.nemo`` archive; device: torch device string; dtype: None/"float32",
            "bfloat16" or "float16" (the preprocessor always runs in float32).
    Raises:
        ModelLoadError: missing/truncated/corrupt archive, missing or unexpected weights,
            mismatched shapes. UnsupportedModelError: a module class or option we do not implement.
    """
    return ParakeetASR.from_nemo(path, device=device, dtype=dtype)


__all__ = ["ParakeetASR", "ParakeetModule", "load_parakeet", "parse_dtype", "split_long_audio"]
