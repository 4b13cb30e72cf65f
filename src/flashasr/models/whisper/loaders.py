"""Checkpoint loaders: CTranslate2 directories, OpenAI ``.pt`` files and Hugging Face directories,
all mapped to the one parameter layout of :class:`~.model.WhisperModel`.

CTranslate2 ``model.bin`` format (facts from CTranslate2's ``model_spec.py`` / ``models/model.cc``;
little-endian; a string is ``uint16 length`` (including a trailing NUL) + bytes):

    uint32 binary_version (we read 2..6)
    string spec name ("WhisperSpec"), uint32 spec revision
    uint32 number of variables, then per variable:
        string name, uint8 rank, uint32 dims[rank],
        uint8 dtype id (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16),
        uint32 byte count, raw data (C order)
    uint32 number of aliases, then per alias: string alias, string target name

Quantized weights ``W`` (int8) come with ``W_scale`` (float32, one per output row): the float
weight is ``W / W_scale[:, None]``; int16 weights use one scalar scale.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

import numpy as np
import torch

from ...errors import ModelLoadError, UnsupportedModelError
from ..base import model_name_from_path
from .model import WhisperDims, WhisperModel, sinusoids

__all__ = ["load_whisper", "read_ct2_model_bin", "ct2_to_state_dict", "openai_to_state_dict",
           "hf_to_state_dict", "build_model", "resolve_dtype", "MultiFileReader"]

_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
_CT2_MAX_VERSION = 6


# ---------------------------------------------------------------------------------------------
# Reading several files as one stream (whisper base ships model.bin in two package parts).
# ---------------------------------------------------------------------------------------------
class MultiFileReader(io.RawIOBase):
    """Read-only stream over the concatenation of ``paths`` without joining them on disk."""

    def __init__(self, paths: Sequence[str | os.PathLike]):
        super().__init__()
        self._paths = [Path(p) for p in paths]
        for p in self._paths:
            if not p.is_file():
                raise ModelLoadError(f"model file {p} not found", code="model_not_found")
        self._sizes = [p.stat().st_size for p in self._paths]
        self._files = [open(p, "rb") for p in self._paths]
        self._pos = 0
        self.size = sum(self._sizes)

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv) and self._pos < self.size:
            start = 0
            for f, size in zip(self._files, self._sizes):
                if self._pos < start + size:
                    f.seek(self._pos - start)
                    n = f.readinto(mv[done: done + min(len(mv) - done, start + size - self._pos)])
                    if not n:
                        return done
                    done += n
                    self._pos += n
                    break
                start += size
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()


def _read_exact(f: BinaryIO, n: int, what: str) -> bytearray:
    buf = bytearray(n)
    got = f.readinto(buf) if n else 0
    if got != n:
        raise ModelLoadError(f"model.bin is truncated: expected {n} bytes for {what}, got {got} "
                             f"(file ends at byte {f.tell()})", code="model_truncated")
    return buf


def _u(f: BinaryIO, fmt: str, what: str):
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, _read_exact(f, size, what))[0]


def _s(f: BinaryIO, what: str) -> str:
    n = _u(f, "H", what)
    raw = bytes(_read_exact(f, n, what))
    try:
        return raw.rstrip(b"\0").decode("utf-8")
    except UnicodeDecodeError:
        raise ModelLoadError(f"model.bin is corrupt: {what} is not a valid string") from None


def read_ct2_model_bin(stream: BinaryIO) -> tuple[str, int, dict[str, torch.Tensor]]:
    """Parse a CTranslate2 ``model.bin`` stream.

    Returns:
        (spec name, spec revision, variables) with aliases resolved to the same tensors and
        quantized weights dequantized to float32 (the ``*_scale`` variables are consumed).
        Scalars (flags, ``num_heads``) come back as 0-d tensors.
    Raises:
        ModelLoadError: truncated or corrupt stream.
        UnsupportedModelError: binary version outside 2..6.
    """
    version = _u(stream, "I", "binary version")
    if version < 2 or version > _CT2_MAX_VERSION:
        raise UnsupportedModelError(f"CTranslate2 model.bin binary version {version} is not supported "
                                    f"(supported: 2..{_CT2_MAX_VERSION})")
    spec = _s(stream, "spec name")
    revision = _u(stream, "I", "spec revision")
    count = _u(stream, "I", "variable count")
    if count > 100_000:
        raise ModelLoadError(f"model.bin is corrupt: {count} variables")
    raw: dict[str, torch.Tensor] = {}
    for i in range(count):
        name = _s(stream, f"name of variable {i}")
        rank = _u(stream, "B", f"rank of {name}")
        shape = [_u(stream, "I", f"shape of {name}") for _ in range(rank)]
        type_id = _u(stream, "B", f"dtype of {name}")
        nbytes = _u(stream, "I", f"size of {name}")
        if type_id not in _CT2_DTYPES:
            raise ModelLoadError(f"model.bin: variable {name} has unknown dtype id {type_id}")
        dt = _CT2_DTYPES[type_id]
        itemsize = 2 if dt == "bfloat16" else np.dtype(dt).itemsize
        numel = int(np.prod(shape)) if shape else 1
        if numel * itemsize != nbytes:
            raise ModelLoadError(f"model.bin: variable {name} shape {shape} does not match its {nbytes} bytes")
        buf = _read_exact(stream, nbytes, f"data of {name}")
        if dt == "bfloat16":
            t = torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.frombuffer(buf, dtype=dt))
        raw[name] = t.reshape(shape)
    n_alias = _u(stream, "I", "alias count")
    for _ in range(n_alias):
        alias = _s(stream, "alias")
        target = _s(stream, "alias target")
        if target in raw:
            raw[alias] = raw[target]
            if target + "_scale" in raw:
                raw[alias + "_scale"] = raw[target + "_scale"]
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith("_scale") and name[: -len("_scale")] in raw:
            continue
        scale = raw.get(name + "_scale")
        if t.dtype in (torch.int8, torch.int16) and scale is not None and t.ndim >= 1:
            s = scale.float()
            t = t.float() / (s.reshape(-1, *([1] * (t.ndim - 1))) if s.ndim == 1 else s)
        out[name] = t
    return spec, revision, out


def _count_layers(keys: Iterable[str], pattern: str) -> int:
    rx = re.compile(pattern)
    idx = {int(m.group(1)) for k in keys if (m := rx.match(k))}
    if idx and idx != set(range(max(idx) + 1)):
        raise ModelLoadError(f"checkpoint has non-contiguous layer indices {sorted(idx)}")
    return len(idx)


def _heads(v, width: int) -> int:
    if v is None:
        return max(1, width // 64)  # every Whisper size uses 64-dim heads
    return int(v.item() if torch.is_tensor(v) else v)


def ct2_to_state_dict(v: dict[str, torch.Tensor]) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Map CTranslate2 ``WhisperSpec`` variables to our layout. Raises ModelLoadError if a
    required variable is missing."""
    def g(name):
        if name not in v:
            raise ModelLoadError(f"CTranslate2 Whisper model: variable {name!r} missing")
        return v[name]

    n_enc = _count_layers(v, r"^encoder/layer_(\d+)/")
    n_dec = _count_layers(v, r"^decoder/layer_(\d+)/")
    conv1 = g("encoder/conv1/weight")
    emb = g("decoder/embeddings/weight")
    dims = WhisperDims(
        n_mels=conv1.shape[1], n_audio_ctx=g("encoder/position_encodings/encodings").shape[0],
        n_audio_state=conv1.shape[0], n_audio_head=_heads(v.get("encoder/num_heads"), conv1.shape[0]),
        n_audio_layer=n_enc, n_vocab=emb.shape[0], n_text_ctx=g("decoder/position_encodings/encodings").shape[0],
        n_text_state=emb.shape[1], n_text_head=_heads(v.get("decoder/num_heads"), emb.shape[1]),
        n_text_layer=n_dec)
    sd: dict[str, torch.Tensor] = {}

    def lin(dst, src):
        sd[dst + ".weight"] = g(src + "/weight")
        sd[dst + ".bias"] = g(src + "/bias")

    def ln(dst, src):
        sd[dst + ".weight"] = g(src + "/gamma")
        sd[dst + ".bias"] = g(src + "/beta")

    lin("encoder.conv1", "encoder/conv1")
    lin("encoder.conv2", "encoder/conv2")
    sd["encoder.positions"] = g("encoder/position_encodings/encodings")
    for i in range(n_enc):
        s, d = f"encoder/layer_{i}", f"encoder.layers.{i}"
        ln(d + ".self_attn_norm", s + "/self_attention/layer_norm")
        lin(d + ".self_attn.qkv", s + "/self_attention/linear_0")
        lin(d + ".self_attn.out", s + "/self_attention/linear_1")
        ln(d + ".ffn_norm", s + "/ffn/layer_norm")
        lin(d + ".fc1", s + "/ffn/linear_0")
        lin(d + ".fc2", s + "/ffn/linear_1")
    ln("encoder.norm", "encoder/layer_norm")
    sd["decoder.embed.weight"] = emb
    sd["decoder.positions"] = g("decoder/position_encodings/encodings")
    for i in range(n_dec):
        s, d = f"decoder/layer_{i}", f"decoder.layers.{i}"
        ln(d + ".self_attn_norm", s + "/self_attention/layer_norm")
        lin(d + ".self_attn.qkv", s + "/self_attention/linear_0")
        lin(d + ".self_attn.out", s + "/self_attention/linear_1")
        ln(d + ".cross_attn_norm", s + "/attention/layer_norm")
        lin(d + ".cross_attn.q", s + "/attention/linear_0")
        lin(d + ".cross_attn.kv", s + "/attention/linear_1")
        lin(d + ".cross_attn.out", s + "/attention/linear_2")
        ln(d + ".ffn_norm", s + "/ffn/layer_norm")
        lin(d + ".fc1", s + "/ffn/linear_0")
        lin(d + ".fc2", s + "/ffn/linear_1")
    ln("decoder.norm", "decoder/layer_norm")
    return dims, sd


def _fuse_qkv(q_w, k_w, v_w, q_b, v_b):
    w = torch.cat([q_w, k_w, v_w], 0)
    b = torch.cat([q_b, torch.zeros_like(q_b), v_b], 0)
    return w, b


def _from_named_blocks(get, dims: WhisperDims, names: dict) -> dict[str, torch.Tensor]:
    """Shared mapping for the OpenAI and HF layouts; ``names`` gives each layout's key patterns."""
    sd: dict[str, torch.Tensor] = {}
    for part in ("conv1", "conv2"):
        sd[f"encoder.{part}.weight"] = get(names[part] + ".weight")
        sd[f"encoder.{part}.bias"] = get(names[part] + ".bias")
    pos = get(names["enc_pos"], optional=True)
    sd["encoder.positions"] = pos if pos is not None else sinusoids(dims.n_audio_ctx, dims.n_audio_state)

    def attn(dst, src, cross=False):
        qw, qb = get(f"{src}.{names['q']}.weight"), get(f"{src}.{names['q']}.bias")
        kw = get(f"{src}.{names['k']}.weight")
        vw, vb = get(f"{src}.{names['v']}.weight"), get(f"{src}.{names['v']}.bias")
        if cross:
            sd[dst + ".q.weight"], sd[dst + ".q.bias"] = qw, qb
            sd[dst + ".kv.weight"] = torch.cat([kw, vw], 0)
            sd[dst + ".kv.bias"] = torch.cat([torch.zeros_like(vb), vb], 0)
        else:
            sd[dst + ".qkv.weight"], sd[dst + ".qkv.bias"] = _fuse_qkv(qw, kw, vw, qb, vb)
        sd[dst + ".out.weight"] = get(f"{src}.{names['o']}.weight")
        sd[dst + ".out.bias"] = get(f"{src}.{names['o']}.bias")

    def copy(dst, src):
        sd[dst + ".weight"] = get(src + ".weight")
        sd[dst + ".bias"] = get(src + ".bias")

    for side, n in (("encoder", dims.n_audio_layer), ("decoder", dims.n_text_layer)):
        for i in range(n):
            s, d = names[side + "_block"].format(i), f"{side}.layers.{i}"
            copy(d + ".self_attn_norm", s + "." + names["attn_ln"])
            attn(d + ".self_attn", s + "." + names["attn"])
            if side == "decoder":
                copy(d + ".cross_attn_norm", s + "." + names["cross_ln"])
                attn(d + ".cross_attn", s + "." + names["cross"], cross=True)
            copy(d + ".ffn_norm", s + "." + names["mlp_ln"])
            copy(d + ".fc1", s + "." + names["fc1"])
            copy(d + ".fc2", s + "." + names["fc2"])
    copy("encoder.norm", names["enc_ln"])
    sd["decoder.embed.weight"] = get(names["embed"])
    sd["decoder.positions"] = get(names["dec_pos"])
    copy("decoder.norm", names["dec_ln"])
    return sd


_OPENAI_NAMES = dict(conv1="encoder.conv1", conv2="encoder.conv2", enc_pos="encoder.positional_embedding",
                     q="query", k="key", v="value", o="out", encoder_block="encoder.blocks.{}",
                     decoder_block="decoder.blocks.{}", attn_ln="attn_ln", attn="attn", cross_ln="cross_attn_ln",
                     cross="cross_attn", mlp_ln="mlp_ln", fc1="mlp.0", fc2="mlp.2", enc_ln="encoder.ln_post",
                     embed="decoder.token_embedding.weight", dec_pos="decoder.positional_embedding",
                     dec_ln="decoder.ln")

_HF_NAMES = dict(conv1="model.encoder.conv1", conv2="model.encoder.conv2",
                 enc_pos="model.encoder.embed_positions.weight", q="q_proj", k="k_proj", v="v_proj", o="out_proj",
                 encoder_block="model.encoder.layers.{}", decoder_block="model.decoder.layers.{}",
                 attn_ln="self_attn_layer_norm", attn="self_attn", cross_ln="encoder_attn_layer_norm",
                 cross="encoder_attn", mlp_ln="final_layer_norm", fc1="fc1", fc2="fc2",
                 enc_ln="model.encoder.layer_norm", embed="model.decoder.embed_tokens.weight",
                 dec_pos="model.decoder.embed_positions.weight", dec_ln="model.decoder.layer_norm")


def _getter(state: dict, what: str):
    def get(key, optional=False):
        if key not in state:
            if optional:
                return None
            raise ModelLoadError(f"{what}: tensor {key!r} missing from the checkpoint")
        return state[key]
    return get


def openai_to_state_dict(ckpt: dict) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Map an OpenAI checkpoint ``{"dims": {...}, "model_state_dict": {...}}`` to our layout."""
    if not isinstance(ckpt, dict) or "dims" not in ckpt or "model_state_dict" not in ckpt:
        raise UnsupportedModelError("not an OpenAI Whisper checkpoint (expected keys 'dims' and 'model_state_dict')")
    try:
        dims = WhisperDims(**{k: int(ckpt["dims"][k]) for k in WhisperDims.__dataclass_fields__})
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"OpenAI Whisper checkpoint: bad 'dims' ({e})") from e
    return dims, _from_named_blocks(_getter(ckpt["model_state_dict"], "OpenAI Whisper checkpoint"), dims, _OPENAI_NAMES)


def hf_to_state_dict(config: dict, state: dict) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    """Map a Hugging Face ``WhisperForConditionalGeneration`` state dict (+ its config.json) to ours."""
    try:
        dims = WhisperDims(
            n_mels=int(config["num_mel_bins"]), n_audio_ctx=int(config["max_source_positions"]),
            n_audio_state=int(config["d_model"]), n_audio_head=int(config["encoder_attention_heads"]),
            n_audio_layer=int(config["encoder_layers"]), n_vocab=int(config["vocab_size"]),
            n_text_ctx=int(config["max_target_positions"]), n_text_state=int(config["d_model"]),
            n_text_head=int(config["decoder_attention_heads"]), n_text_layer=int(config["decoder_layers"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"Hugging Face Whisper config.json: missing or bad field ({e})") from e
    if not any(k.startswith("model.") for k in state):  # a bare WhisperModel (no LM head wrapper)
        state = {"model." + k: t for k, t in state.items()}
    return dims, _from_named_blocks(_getter(state, "Hugging Face Whisper checkpoint"), dims, _HF_NAMES)


# ---------------------------------------------------------------------------------------------
def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """``None`` -> float32 on CPU, float16 on CUDA; accepts float32/fp32, float16/fp16/half,
    bfloat16/bf16 or a torch dtype. Raises UnsupportedModelError for anything else."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype in ("auto", "default"):
        return torch.float16 if str(device).startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported (use float32, float16 or bfloat16)")
    return table[dtype]


def build_model(dims: WhisperDims, sd: dict[str, torch.Tensor], *, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> WhisperModel:
    """Instantiate :class:`WhisperModel` from ``dims`` and load ``sd`` (our layout).

    Raises:
        ModelLoadError: a tensor is missing, unexpected, or has the wrong shape.
    """
    with torch.device("meta"):
        model = WhisperModel(dims)
    expected = model.state_dict()
    missing = [k for k in expected if k not in sd]
    extra = [k for k in sd if k not in expected]
    if missing or extra:
        raise ModelLoadError(f"Whisper checkpoint does not match the architecture: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}")
    for k, t in expected.items():
        if tuple(sd[k].shape) != tuple(t.shape):
            raise ModelLoadError(f"Whisper checkpoint: tensor {k} has shape {tuple(sd[k].shape)}, "
                                 f"expected {tuple(t.shape)} for dims {dims}", code="shape_mismatch")
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()},
                          assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{p} not found", code="model_not_found") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {p}: {e}") from e


def load_ct2(model_dir: str | os.PathLike, *, bin_parts: Sequence[str | os.PathLike] | None = None,
             device: str = "cpu", dtype=None, name: str | None = None):
    """Load a CTranslate2 Whisper directory (``model.bin`` + ``config.json`` + ``tokenizer.json``).

    Args:
        model_dir: directory with config.json and tokenizer.json (and model.bin unless ``bin_parts``).
        bin_parts: files whose concatenation is model.bin (read as one stream, no temp file).
    Returns:
        :class:`~.asr.WhisperASR`.
    Raises:
        ModelLoadError / UnsupportedModelError (missing file, truncated, unknown spec, bad shapes).
    """
    from .asr import WhisperASR
    from .tokenizer import WhisperTokenizer

    d = Path(model_dir)
    parts = [Path(p) for p in bin_parts] if bin_parts else [d / "model.bin"]
    for p in parts:
        if not p.is_file():
            raise ModelLoadError(f"CTranslate2 model: {p} not found", code="model_not_found")
    cfg = _read_json(d / "config.json") if (d / "config.json").is_file() else {}
    reader = MultiFileReader(parts)
    try:
        spec, _rev, variables = read_ct2_model_bin(reader)
        if reader.tell() != reader.size:
            raise ModelLoadError(f"CTranslate2 model.bin has {reader.size - reader.tell()} unexpected trailing bytes")
    finally:
        reader.close()
    if spec != "WhisperSpec":
        raise UnsupportedModelError(f"CTranslate2 model in {d} has spec {spec!r}; only 'WhisperSpec' is supported")
    dims, sd = ct2_to_state_dict(variables)
    torch_dtype = resolve_dtype(dtype, device)
    model = build_model(dims, sd, device=device, dtype=torch_dtype)
    tok = WhisperTokenizer(d / "tokenizer.json", n_vocab=dims.n_vocab,
                           suppress_ids=cfg.get("suppress_ids"), suppress_ids_begin=cfg.get("suppress_ids_begin"))
    return WhisperASR(model, tok, name=name or f"whisper-{d.name}", device=device,
                      alignment_heads=cfg.get("alignment_heads"))


def _find_tokenizer(near: Path, n_vocab: int) -> Path:
    """tokenizer.json beside a checkpoint, else the embedded one matching the vocabulary size
    (51864: English-only, 51865: multilingual; 51866 (large-v3) is derived from the latter),
    checked against its pinned SHA-256."""
    for cand in (near / "tokenizer.json", near.parent / "tokenizer.json"):
        if cand.is_file():
            return cand
    from .packages import verify_embedded  # the lent file is checked like the embedded model

    if n_vocab == 51864:
        return verify_embedded("tiny.en")["tokenizer.json"]
    if n_vocab in (51865, 51866):
        return verify_embedded("base")["tokenizer.json"]
    raise ModelLoadError(f"no tokenizer.json found beside {near} for a vocabulary of {n_vocab}")


def _large_v3_tokenizer_json(src: Path, dst_dir: Path) -> Path:
    """large-v3 adds ``<|yue|>`` after the 99 languages, shifting later special tokens by one."""
    j = json.loads(src.read_text(encoding="utf-8"))
    translate = next(t["id"] for t in j["added_tokens"] if t["content"] == "<|translate|>")
    for t in j["added_tokens"]:
        if t["id"] >= translate:
            t["id"] += 1
        if t["content"] == "<|nocaptions|>":
            t["content"] = "<|nospeech|>"
    yue = dict(next(t for t in j["added_tokens"] if t["content"] == "<|en|>"), id=translate, content="<|yue|>")
    j["added_tokens"].append(yue)
    j["added_tokens"].sort(key=lambda t: t["id"])
    pp = j.get("post_processor") or {}
    for st in (pp.get("special_tokens") or {}).values():
        st["ids"] = [i + 1 if i >= translate else i for i in st["ids"]]
    out = dst_dir / "tokenizer.large-v3.json"
    out.write_text(json.dumps(j), encoding="utf-8")
    return out


def _make_tokenizer(near: Path, n_vocab: int, cfg: dict | None = None):
    import tempfile

    from .tokenizer import WhisperTokenizer

    cfg = cfg or {}
    path = _find_tokenizer(near, n_vocab)
    if n_vocab == 51866 and "<|yue|>" not in path.read_text(encoding="utf-8"):
        path = _large_v3_tokenizer_json(path, Path(tempfile.mkdtemp(prefix="flashasr-tok-")))
    return WhisperTokenizer(path, n_vocab=n_vocab, suppress_ids=cfg.get("suppress_tokens") or cfg.get("suppress_ids"),
                            suppress_ids_begin=cfg.get("begin_suppress_tokens") or cfg.get("suppress_ids_begin"))


def load_openai_pt(path: str | os.PathLike, *, device: str = "cpu", dtype=None, name: str | None = None):
    """Load an OpenAI Whisper ``.pt`` checkpoint (``{"dims", "model_state_dict"}``). The tokenizer is
    ``tokenizer.json`` beside it or the embedded one matching the vocabulary size."""
    from .asr import WhisperASR

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{p} not found", code="model_not_found")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        raise ModelLoadError(f"cannot read OpenAI Whisper checkpoint {p}: {e}") from e
    dims, sd = openai_to_state_dict(ckpt)
    model = build_model(dims, sd, device=device, dtype=resolve_dtype(dtype, device))
    tok = _make_tokenizer(p.parent, dims.n_vocab)
    return WhisperASR(model, tok, name=name or f"whisper-{model_name_from_path(p)}", device=device)


def load_hf_dir(path: str | os.PathLike, *, device: str = "cpu", dtype=None, name: str | None = None):
    """Load a Hugging Face Whisper directory: config.json + model.safetensors (or shards, or
    pytorch_model.bin) + tokenizer.json; generation_config.json supplies suppress tokens and
    alignment heads when present."""
    from .asr import WhisperASR

    d = Path(path)
    cfg = _read_json(d / "config.json")
    arch = cfg.get("model_type")
    if arch is not None and arch != "whisper":
        raise UnsupportedModelError(f"Hugging Face model in {d} has model_type {arch!r}; only 'whisper' is supported")
    files = sorted(d.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"cannot read {f}: {e}") from e
    elif (d / "pytorch_model.bin").is_file():
        try:
            state = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read {d / 'pytorch_model.bin'}: {e}") from e
    else:
        raise ModelLoadError(f"Hugging Face Whisper directory {d} has no *.safetensors or pytorch_model.bin",
                             code="model_not_found")
    dims, sd = hf_to_state_dict(cfg, state)
    gen = _read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
    model = build_model(dims, sd, device=device, dtype=resolve_dtype(dtype, device))
    tok = _make_tokenizer(d, dims.n_vocab, {**cfg, **gen})
    return WhisperASR(model, tok, name=name or f"whisper-{d.name}", device=device,
                      alignment_heads=gen.get("alignment_heads"))


def load_whisper(path: str | os.PathLike, *, device: str = "cpu", dtype=None):
    """Load any supported Whisper checkpoint at ``path`` (called by the model registry).

    * directory with ``model.bin``: CTranslate2;
    * directory with ``config.json`` + ``*.safetensors`` / ``pytorch_model.bin``: Hugging Face;
    * ``*.pt`` file: OpenAI.
    Returns:
        :class:`~.asr.WhisperASR`.
    Raises:
        ModelLoadError: missing/truncated/mismatched files. UnsupportedModelError: other formats.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model {str(path)!r}: no such file or directory", code="model_not_found")
    if p.is_dir():
        if (p / "model.bin").exists():
            return load_ct2(p, device=device, dtype=dtype)
        if (p / "config.json").is_file():
            return load_hf_dir(p, device=device, dtype=dtype)
        raise UnsupportedModelError(f"{p}: directory holds neither a CTranslate2 model.bin nor a "
                                    "Hugging Face config.json")
    if p.suffix in (".pt", ".pth"):
        return load_openai_pt(p, device=device, dtype=dtype)
    raise UnsupportedModelError(f"{p}: unsupported model file (expected a .pt checkpoint or a model directory)")
