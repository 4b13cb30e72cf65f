"""Parakeet-TDT model: modules, ``.nemo`` loading and transcription (our own PyTorch code).

Pipeline (NeMo ``EncDecRNNTBPEModel`` with TDT greedy decoding):
waveform ``[N]`` float32 16 kHz -> :class:`MelPreprocessor` ``[B, n_mels, T_feat]`` ->
:class:`ConformerEncoder` ``[B, T_enc, d]`` (80 ms frames for v2/v3) -> batched label-looping
greedy TDT (:func:`greedy_tdt_label_looping`) -> token ids, frames, durations ->
SentencePiece text and timestamps (:mod:`.timestamps`).

The model transcribes exactly the waveforms it is given: long recordings are cut at pauses
into pieces of at most ``max_segment_seconds`` by the pipeline (:mod:`flashasr.pipeline`),
which also merges the pieces' transcripts. See docs/PARAKEET.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ...errors import ModelLoadError
from ...options import TranscribeOptions
from ...types import Transcript
from ..base import ASRModel, model_name_from_path
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
    ``decoding`` ("label_looping" or "reference"),
    ``batch_size`` (pieces per encoder batch), ``pad_min_seconds`` (default 0: pieces shorter
    than this are zero-padded half left / half right first, as NeMo ``transcribe()`` does with
    1.0 s; timestamps stay relative to the unpadded audio, clamped to it).
    """

    family = "parakeet"
    speech_gate = False  # the TDT decoder emits blanks on non-speech: no VAD for pieces that fit (NeMo gates nothing)

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
        self.decoding = "label_looping"
        self.batch_size = 16
        self.pad_min_seconds = 0.0
        self.blank_id = cfg.blank_id
        self.durations = list(cfg.durations)
        self.num_classes_with_blank = cfg.vocab_size + 1
        self.max_symbols_per_step = cfg.max_symbols
        self.frame_seconds = cfg.frame_seconds
        self.multilingual = _looks_multilingual(tokenizer)
        self.work = {"encoder_frames": 0, "encoder_calls": 0}  # offline encoder work (see count_encoder_work)
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
        return cls(pc, net, tok, device=device, dtype=dtype, name=model_name_from_path(path))

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

    def encoder_frames_of(self, n_samples: int) -> int:
        """Encoder frames of a waveform of ``n_samples`` (host integer arithmetic, NeMo's lengths:
        ``len // 160`` feature frames, then ``floor((L - 1) / 2) + 1`` per subsampling stage)."""
        pre = self.preprocessor
        L = max(0, (int(n_samples) + 2 * (pre.n_fft // 2) - pre.n_fft) // pre.hop_length)
        for _ in range(self.encoder.pre_encode.stages):
            L = (L - 1) // 2 + 1 if L > 0 else 0
        return L

    def count_encoder_work(self, lengths) -> None:
        """Add the encoder frames of one encoder call over waveforms of ``lengths`` samples to
        :attr:`work` (``encoder_frames``: valid frames through the Conformer layers, the cost that
        grows with audio; ``encoder_calls``). Read by the streaming cost test and benchmarks."""
        self.work["encoder_frames"] += sum(self.encoder_frames_of(n) for n in lengths)
        self.work["encoder_calls"] += 1

    def make_streamer(self, config=None):
        """A :class:`~flashasr.models.parakeet.streaming.ParakeetStreamer` for chunked streaming
        partials of this model (``config``: a
        :class:`~flashasr.models.parakeet.streaming.StreamingConfig`; None: the defaults)."""
        from .streaming import ParakeetStreamer

        return ParakeetStreamer(self, config)

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
            self.count_encoder_work([len(pieces[i]) for i in run])
            enc, enc_len = self.encode(audio, lengths)
            for i, h in zip(run, self.decode(enc, enc_len)):
                hyps[i] = h
        return hyps  # type: ignore[return-value]

    def _transcribe(self, waveforms: list[np.ndarray], options: TranscribeOptions) -> list[Transcript]:
        """Transcribe each waveform as one piece (all of them share encoder batches); results equal
        per-input results. ``options.language`` does not steer Parakeet (v3 recognises its 25
        languages implicitly): it is echoed in the result, and None stays None. Audio shorter than
        one encoder frame (hop x subsampling = 80 ms for v2/v3) gives an empty transcript. A
        waveform longer than ``max_segment_seconds`` is encoded in one pass (full attention: memory
        grows with the square of its length); the pipeline cuts long recordings before this."""
        pieces, shifts = self._padded(waveforms)
        return self._transcripts(self._decode_pieces(pieces), waveforms, shifts, options)

    def _padded(self, waveforms: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
        """The pieces the encoder sees: a waveform shorter than ``pad_min_seconds`` zero-padded half
        each side (NeMo's ``transcribe()``), with its left padding in samples."""
        min_len = int(round(self.pad_min_seconds * self.sample_rate))
        pieces, shifts = [], []
        for w in waveforms:
            left = 0
            if len(w) < min_len:  # NeMo transcribe(): zero-pad short clips, half each side
                left = (min_len - len(w)) // 2
                w = np.concatenate([np.zeros(left, np.float32), w, np.zeros(min_len - len(w) - left, np.float32)])
            pieces.append(w)
            shifts.append(left)
        return pieces, shifts

    def _transcripts(self, hyps: list[Hypothesis], waveforms: list[np.ndarray], shifts: list[int],
                     options: TranscribeOptions) -> list[Transcript]:
        """One transcript per waveform from its decoded piece (times back on the waveform's clock)."""
        sr = self.sample_rate
        c0 = time.thread_time()
        out = [self.transcript_of(h, len(w) / sr, offset=-left / sr, options=options)
               for h, w, left in zip(hyps, waveforms, shifts)]
        self._count("detokenize", time.thread_time() - c0)
        return out

    def _count(self, stage: str, cpu_s: float) -> None:
        """Add to :attr:`stage_cpu_s` (this model's own host stages, read by the job report)."""
        if self.stage_cpu_s is None:
            self.stage_cpu_s = {}
        self.stage_cpu_s[stage] = self.stage_cpu_s.get(stage, 0.0) + cpu_s

    def transcript_of(self, hyp: Hypothesis, duration: float, *, offset: float = 0.0,
                      options: TranscribeOptions | None = None) -> Transcript:
        """A :class:`~flashasr.types.Transcript` from one decoded waveform.

        Args:
            hyp: token ids, encoder frames and durations from any decoder with this model's vocabulary
                (the plain one or the GPU engine's).
            duration: the waveform's length in seconds (times are clamped to ``[0, duration]``).
            offset: seconds added to every time (``-left_pad`` when the input was zero-padded).
            options: ``language`` is echoed, ``word_timestamps`` fills ``words``.
        Returns:
            text (exactly the SentencePiece decode), segments (with words) and, if asked, words.
        """
        options = options or TranscribeOptions()
        toks = token_times(hyp.token_ids, hyp.token_frames, hyp.token_durations, self.frame_seconds,
                           offset=offset, duration=duration, tokenizer=self.tokenizer)
        words = group_words(toks, self.tokenizer)
        return Transcript(text=self.tokenizer.decode(hyp.token_ids), language=options.language, duration=duration,
                          segments=build_segments(words, first_id=0),
                          words=[w_ for w_, _ in words] if options.word_timestamps else None, model=self.name)


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


__all__ = ["ParakeetASR", "ParakeetModule", "load_parakeet", "parse_dtype"]
