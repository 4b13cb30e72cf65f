"""Parakeet-TDT configuration: NeMo ``model_config.yaml`` dict -> typed, validated settings.

Reads the keys NeMo's ``EncDecRNNTBPEModel`` uses for inference (``preprocessor``, ``encoder``,
``decoder``, ``joint``, ``decoding``, ``loss.tdt_kwargs``, ``model_defaults``); absent keys take
NeMo 3.0.0's constructor defaults. Anything this implementation does not compute raises
:class:`flashasr.errors.UnsupportedModelError` naming the key and value.

Also :func:`load_yaml_config` and :func:`parameter_count_formula` (architecture arithmetic, used to
check a build). Random weights of a config, for benchmarks: :mod:`flashasr.random_models`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...errors import ModelLoadError, UnsupportedModelError

_PREPROCESSOR_TARGETS = ("AudioToMelSpectrogramPreprocessor",)
_ENCODER_TARGETS = ("ConformerEncoder",)
_DECODER_TARGETS = ("RNNTDecoder",)
_JOINT_TARGETS = ("RNNTJoint",)
# hybrid TDT-CTC models (e.g. parakeet-tdt_ctc-110m): the TDT branch is used, the CTC head ignored
_MODEL_TARGETS = ("EncDecRNNTBPEModel", "EncDecRNNTModel", "EncDecHybridRNNTCTCBPEModel")


def _target_name(section: Mapping) -> str:
    t = section.get("_target_") or section.get("target") or ""
    return str(t).rsplit(".", 1)[-1]


def _check_target(section: Mapping, allowed: tuple[str, ...], what: str) -> None:
    name = _target_name(section)
    if name and name not in allowed:
        raise UnsupportedModelError(
            f"{what} class {section.get('_target_')!r} is not supported (expected {' or '.join(allowed)})",
            code="unsupported_model")


def _unsupported(key: str, value: Any, expected: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config {key}={value!r} is not supported (supported: {expected})")


@dataclass
class PreprocessorConfig:
    """Log-mel front end (NeMo ``AudioToMelSpectrogramPreprocessor``).

    Derived: ``win_length = int(window_size * sample_rate)`` samples, ``hop_length =
    int(window_stride * sample_rate)`` samples, ``n_fft`` (default next power of 2 >= win_length).
    """

    sample_rate: int = 16000
    window_size: float = 0.02
    window_stride: float = 0.01
    n_fft: int | None = None
    window: str = "hann"
    features: int = 64
    normalize: str | None = "per_feature"
    log: bool = True
    preemph: float | None = 0.97
    lowfreq: float = 0.0
    highfreq: float | None = None
    log_zero_guard_type: str = "add"
    log_zero_guard_value: float | str = 2 ** -24
    mag_power: float = 2.0
    mel_norm: str | None = "slaney"
    pad_to: int = 0
    pad_value: float = 0.0
    dither: float = 1e-5
    frame_splicing: int = 1
    exact_pad: bool = False

    @property
    def win_length(self) -> int:
        return int(self.window_size * self.sample_rate)

    @property
    def hop_length(self) -> int:
        return int(self.window_stride * self.sample_rate)

    @property
    def fft_size(self) -> int:
        return int(self.n_fft) if self.n_fft else 2 ** math.ceil(math.log2(self.win_length))

    @classmethod
    def from_dict(cls, d: Mapping) -> "PreprocessorConfig":
        _check_target(d, _PREPROCESSOR_TARGETS, "preprocessor")
        nullable = ("n_fft", "highfreq", "preemph", "normalize", "mel_norm")
        kw = {f: d[f] for f in cls.__dataclass_fields__ if f in d and (d[f] is not None or f in nullable)}
        if "nfilt" in d and "features" not in d:
            kw["features"] = d["nfilt"]
        c = cls(**kw)
        if not isinstance(c.pad_to, int) or c.pad_to < 0:
            raise _unsupported("preprocessor.pad_to", c.pad_to, "an integer >= 0")
        if int(c.frame_splicing) != 1:
            raise _unsupported("preprocessor.frame_splicing", c.frame_splicing, "1")
        if c.exact_pad:
            raise _unsupported("preprocessor.exact_pad", c.exact_pad, "false")
        if str(c.window).lower() not in ("hann", "hamming", "blackman", "bartlett", "none", "ones"):
            raise _unsupported("preprocessor.window", c.window, "hann, hamming, blackman, bartlett, none")
        if c.normalize not in (None, "per_feature", "all_features", "none"):
            raise _unsupported("preprocessor.normalize", c.normalize, "per_feature, all_features, null")
        if c.log_zero_guard_type not in ("add", "clamp"):
            raise _unsupported("preprocessor.log_zero_guard_type", c.log_zero_guard_type, "add, clamp")
        if isinstance(c.log_zero_guard_value, str) and c.log_zero_guard_value not in ("tiny", "eps"):
            raise _unsupported("preprocessor.log_zero_guard_value", c.log_zero_guard_value,
                               "a number, 'tiny', 'eps'")
        if c.mel_norm not in (None, "slaney"):
            raise _unsupported("preprocessor.mel_norm", c.mel_norm, "slaney, null")
        if c.win_length > c.fft_size:
            raise _unsupported("preprocessor.window_size", c.window_size, "<= n_fft/sample_rate")
        return c


@dataclass
class EncoderConfig:
    """FastConformer encoder (NeMo ``ConformerEncoder``)."""

    feat_in: int = 80
    feat_out: int = -1
    n_layers: int = 17
    d_model: int = 512
    n_heads: int = 8
    ff_expansion_factor: int = 4
    use_bias: bool = True
    subsampling: str = "dw_striding"
    subsampling_factor: int = 8
    subsampling_conv_channels: int = 256
    causal_downsampling: bool = False
    self_attention_model: str = "rel_pos"
    att_context_size: list[int] = field(default_factory=lambda: [-1, -1])
    xscaling: bool = True
    untie_biases: bool = True
    pos_emb_max_len: int = 5000
    conv_kernel_size: int = 31
    conv_norm_type: str = "batch_norm"
    conv_context_size: Any = None
    reduction: Any = None

    @property
    def d_ff(self) -> int:
        return int(self.d_model * self.ff_expansion_factor)

    @property
    def conv_padding(self) -> tuple[int, int]:
        """(left, right) zero padding of the depthwise conv (NeMo ``conv_context_size``)."""
        k = self.conv_kernel_size
        cc = self.conv_context_size
        if cc is None:
            return (k - 1) // 2, (k - 1) // 2
        if cc == "causal":
            return k - 1, 0
        return int(cc[0]), int(cc[1])

    @classmethod
    def from_dict(cls, d: Mapping) -> "EncoderConfig":
        _check_target(d, _ENCODER_TARGETS, "encoder")
        kw = {f: d[f] for f in cls.__dataclass_fields__ if f in d and d[f] is not None}
        if "conv_context_size" in d:
            kw["conv_context_size"] = d["conv_context_size"]
        c = cls(**kw)
        acs = c.att_context_size or [-1, -1]
        if any(isinstance(x, (list, tuple)) for x in acs):
            raise _unsupported("encoder.att_context_size", acs, "one [left, right] pair")
        c.att_context_size = [int(x) for x in acs]
        if c.subsampling != "dw_striding":
            raise _unsupported("encoder.subsampling", c.subsampling, "dw_striding")
        f = int(c.subsampling_factor)
        if f < 2 or f & (f - 1):
            raise _unsupported("encoder.subsampling_factor", f, "a power of 2 >= 2")
        if c.causal_downsampling:
            raise _unsupported("encoder.causal_downsampling", True, "false")
        if c.self_attention_model not in ("rel_pos", "rel_pos_local_attn"):
            raise _unsupported("encoder.self_attention_model", c.self_attention_model,
                               "rel_pos, rel_pos_local_attn")
        style = d.get("att_context_style", "regular")
        if style not in (None, "regular"):
            raise _unsupported("encoder.att_context_style", style, "regular")
        if len(c.att_context_size) != 2:
            raise _unsupported("encoder.att_context_size", c.att_context_size, "[left, right]")
        if c.conv_norm_type not in ("batch_norm", "layer_norm") and not str(c.conv_norm_type).startswith("group_norm"):
            raise _unsupported("encoder.conv_norm_type", c.conv_norm_type, "batch_norm, layer_norm, group_normN")
        if c.reduction not in (None, "null"):
            raise _unsupported("encoder.reduction", c.reduction, "null")
        if c.d_model % c.n_heads:
            raise _unsupported("encoder.n_heads", c.n_heads, f"a divisor of d_model={c.d_model}")
        if c.conv_kernel_size % 2 == 0 and c.conv_context_size is None:
            raise _unsupported("encoder.conv_kernel_size", c.conv_kernel_size, "odd")
        if c.conv_context_size not in (None, "causal"):
            l, r = c.conv_padding
            if l + r + 1 != c.conv_kernel_size:
                raise _unsupported("encoder.conv_context_size", c.conv_context_size,
                                   "[left, right] with left + right + 1 = conv_kernel_size")
        return c


@dataclass
class ParakeetConfig:
    """Everything needed to build a Parakeet-TDT model for inference."""

    preprocessor: PreprocessorConfig
    encoder: EncoderConfig
    vocab_size: int
    pred_hidden: int
    pred_rnn_layers: int
    joint_hidden: int
    joint_activation: str
    durations: list[int]
    max_symbols: int = 10
    joint_out_index: int = 2  # state-dict index of the output Linear inside joint_net
    labels: list[str] | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def blank_id(self) -> int:
        return self.vocab_size

    @property
    def frame_seconds(self) -> float:
        """Seconds per encoder frame (window_stride x subsampling_factor; 0.08 for v2/v3)."""
        return self.preprocessor.window_stride * self.encoder.subsampling_factor

    @classmethod
    def from_dict(cls, cfg: Mapping) -> "ParakeetConfig":
        """Validate a NeMo ``model_config.yaml`` dict.

        Raises:
            UnsupportedModelError: an unknown class (``target``/``_target_``) or an option we do
                not implement (named in the message); ModelLoadError: a required key is missing.
        """
        if not isinstance(cfg, Mapping):
            raise ModelLoadError(f"model config must be a mapping, got {type(cfg).__name__}")
        top = str(cfg.get("target") or "").rsplit(".", 1)[-1]
        if top and top not in _MODEL_TARGETS:
            raise UnsupportedModelError(f"model class {cfg.get('target')!r} is not supported "
                                        f"(expected EncDecRNNTBPEModel with TDT decoding)")
        for key in ("preprocessor", "encoder", "decoder", "joint"):
            if not isinstance(cfg.get(key), Mapping):
                raise ModelLoadError(f"model config has no {key!r} section")
        pre = PreprocessorConfig.from_dict(cfg["preprocessor"])
        enc = EncoderConfig.from_dict(cfg["encoder"])
        dec, joint = cfg["decoder"], cfg["joint"]
        _check_target(dec, _DECODER_TARGETS, "decoder")
        _check_target(joint, _JOINT_TARGETS, "joint")
        if not dec.get("blank_as_pad", True):
            raise _unsupported("decoder.blank_as_pad", dec.get("blank_as_pad"), "true")
        if dec.get("normalization_mode") not in (None, "null"):
            raise _unsupported("decoder.normalization_mode", dec.get("normalization_mode"), "null")
        prednet = dec.get("prednet") or {}
        rnn_h = prednet.get("rnn_hidden_size", -1)
        if rnn_h not in (None, -1) and int(rnn_h) != int(prednet.get("pred_hidden", -1)):
            raise _unsupported("decoder.prednet.rnn_hidden_size", rnn_h, "-1 (= pred_hidden)")
        jn = joint.get("jointnet") or {}
        defaults = cfg.get("model_defaults") or {}
        vocab = dec.get("vocab_size", joint.get("num_classes"))
        if vocab is None:
            raise ModelLoadError("model config has neither decoder.vocab_size nor joint.num_classes")
        if joint.get("num_classes") is not None and int(joint["num_classes"]) != int(vocab):
            raise ModelLoadError(f"decoder.vocab_size={vocab} != joint.num_classes={joint['num_classes']}")
        loss = cfg.get("loss") or {}
        decoding = cfg.get("decoding") or {}
        durations = (decoding.get("durations") or (loss.get("tdt_kwargs") or {}).get("durations")
                     or defaults.get("tdt_durations"))
        if not durations:
            raise UnsupportedModelError("model has no TDT durations (decoding.durations / "
                                        "loss.tdt_kwargs.durations): plain RNN-T is not supported")
        if decoding.get("model_type", "tdt") != "tdt" or loss.get("loss_name", "tdt") != "tdt":
            raise UnsupportedModelError(f"decoding.model_type={decoding.get('model_type')!r} / "
                                        f"loss.loss_name={loss.get('loss_name')!r}: only TDT is supported")
        extra = joint.get("num_extra_outputs")
        if extra is not None and int(extra) != len(durations):
            raise ModelLoadError(f"joint.num_extra_outputs={extra} != number of durations {len(durations)}")
        act = str(jn.get("activation", "relu")).lower()
        if act not in ("relu", "sigmoid", "tanh"):
            raise _unsupported("joint.jointnet.activation", act, "relu, sigmoid, tanh")
        dropout = float(jn.get("dropout", 0.0) or 0.0)
        greedy = (decoding.get("greedy") or {})
        max_symbols = greedy.get("max_symbols", greedy.get("max_symbols_per_step", 10))
        enc_hidden = jn.get("encoder_hidden", defaults.get("enc_hidden"))
        d_out = enc.feat_out if enc.feat_out and enc.feat_out > 0 else enc.d_model
        if enc_hidden is not None and int(enc_hidden) != d_out:
            raise ModelLoadError(f"joint.jointnet.encoder_hidden={enc_hidden} != encoder output size {d_out}")
        pred_hidden = prednet.get("pred_hidden", jn.get("pred_hidden", defaults.get("pred_hidden")))
        joint_hidden = jn.get("joint_hidden", defaults.get("joint_hidden"))
        if pred_hidden is None or joint_hidden is None:
            raise ModelLoadError("model config lacks decoder.prednet.pred_hidden or joint.jointnet.joint_hidden")
        return cls(
            preprocessor=pre, encoder=enc, vocab_size=int(vocab), pred_hidden=int(pred_hidden),
            pred_rnn_layers=int(prednet.get("pred_rnn_layers", 1)), joint_hidden=int(joint_hidden),
            joint_activation=act, durations=[int(x) for x in durations],
            # null would allow an endless loop on one frame; NeMo's label-looping decoder also
            # replaces it by 10
            max_symbols=10 if max_symbols is None else int(max_symbols),
            joint_out_index=2 if dropout > 0 else 1,
            labels=list(joint.get("vocabulary") or cfg.get("labels") or []) or None,
            raw=dict(cfg))


def load_yaml_config(path: str | os.PathLike) -> dict:
    """Read a NeMo-layout yaml file (e.g. ``parakeet-tdt-0.6b-v3.yaml``) into a dict."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            d = yaml.safe_load(fh)
    except FileNotFoundError as e:
        raise ModelLoadError(f"config {str(path)!r}: no such file", code="model_not_found") from e
    except IsADirectoryError as e:
        raise ModelLoadError(f"config {str(path)!r} is a folder, not a YAML file", code="model_not_found") from e
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"config {str(path)!r} is not a text (YAML) file") from e
    except yaml.YAMLError as e:
        raise ModelLoadError(f"config {str(path)!r} is not valid YAML: {e}") from e
    if not isinstance(d, dict):
        raise ModelLoadError(f"config {str(path)!r} does not hold a mapping")
    return d


def parameter_count_formula(cfg: ParakeetConfig) -> dict[str, int]:
    """Parameter count from the architecture arithmetic alone (no module built).

    Returns a dict with ``encoder``, ``predictor``, ``joint`` and ``total`` (trainable
    parameters; BatchNorm running statistics and the preprocessor buffers not counted).
    """
    e = cfg.encoder
    d, C, k = e.d_model, e.subsampling_conv_channels, e.conv_kernel_size
    nb = 1 if e.use_bias else 0
    stages = int(round(math.log2(e.subsampling_factor)))
    f = e.feat_in
    for _ in range(stages):
        f = (f + 2 - 3) // 2 + 1
    sub = (9 * C + C) + (stages - 1) * ((9 * C + C) + (C * C + C)) + (C * f * d + d)
    dh = d // e.n_heads
    ff = 2 * (d * e.d_ff + nb * e.d_ff + e.d_ff * d + nb * d)
    att = 4 * (d * d + nb * d) + d * d + 2 * e.n_heads * dh
    conv = (d * 2 * d + nb * 2 * d) + (d * k + nb * d) + 2 * d + (d * d + nb * d)
    norms = 5 * 2 * d
    layer = ff + att + conv + norms
    enc = sub + e.n_layers * layer
    if e.feat_out and e.feat_out > 0:
        enc += d * e.feat_out + e.feat_out
    H, L, V = cfg.pred_hidden, cfg.pred_rnn_layers, cfg.vocab_size
    pred = (V + 1) * H + L * (4 * H * H * 2 + 8 * H)
    D = e.feat_out if e.feat_out and e.feat_out > 0 else d
    J = cfg.joint_hidden
    joint = (D * J + J) + (H * J + J) + (J * (V + 1 + len(cfg.durations)) + V + 1 + len(cfg.durations))
    return {"encoder": enc, "predictor": pred, "joint": joint, "total": enc + pred + joint}


__all__ = ["PreprocessorConfig", "EncoderConfig", "ParakeetConfig", "load_yaml_config",
           "parameter_count_formula"]
