"""Reading NeMo ``.nemo`` archives and mapping their state dict onto our modules.

A ``.nemo`` file (NeMo ``SaveRestoreConnector``) is a tar archive, uncompressed since NeMo 1.7
(older files are gzip-compressed), with members named ``./model_config.yaml``,
``./model_weights.ckpt`` (``torch.save`` of the model ``state_dict()``) and artifacts named
``<uuid>_<basename>`` referenced from the config as ``nemo:<uuid>_<basename>`` (for BPE models
``tokenizer.model_path`` -> the SentencePiece model).

Every failure raises :class:`flashasr.errors.ModelLoadError` (or
:class:`~flashasr.errors.UnsupportedModelError`) with a message naming the file and the problem.
"""

from __future__ import annotations

import io
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import ModelLoadError
from ..catalog import not_a_nemo

CONFIG_NAME = "model_config.yaml"
WEIGHTS_NAME = "model_weights.ckpt"


@dataclass
class NemoArchive:
    """Contents of a ``.nemo`` file: config dict, state dict (CPU tensors), tokenizer model bytes."""

    path: str
    config: dict
    state_dict: dict
    tokenizer_model: bytes | None
    members: list[str]


def _norm(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


def _artifact_name(ref: str | None) -> str | None:
    if not ref:
        return None
    ref = str(ref)
    if ref.startswith("nemo:"):
        ref = ref[len("nemo:"):]
    return os.path.basename(ref)


def read_nemo(path: str | os.PathLike) -> NemoArchive:
    """Read config, weights and tokenizer model from a ``.nemo`` file.

    Raises:
        ModelLoadError: no such file (code ``model_not_found``), not a tar archive, truncated
            archive, missing ``model_config.yaml`` / ``model_weights.ckpt`` / tokenizer model,
            unreadable YAML or checkpoint.
    """
    import yaml

    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model {str(p)!r}: no such file", code="model_not_found")
    if p.is_dir():
        raise ModelLoadError(f"model {str(p)!r} is a directory, expected a .nemo file")
    try:
        tar = tarfile.open(p, "r:*")
    except (tarfile.ReadError, EOFError, OSError, zlib.error) as e:
        raise ModelLoadError(not_a_nemo(p, e)) from e
    try:
        with tar:
            try:
                infos = tar.getmembers()
            except (tarfile.ReadError, EOFError, OSError, zlib.error) as e:
                raise ModelLoadError(f"model {str(p)!r}: truncated or corrupt .nemo archive ({e})") from e
            by_name = {_norm(m.name): m for m in infos if m.isfile()}

            def read(name: str) -> bytes:
                m = by_name.get(name)
                if m is None:
                    raise ModelLoadError(f"model {str(p)!r}: .nemo archive has no member {name!r} "
                                         f"(members: {sorted(by_name)[:8]})")
                try:
                    fh = tar.extractfile(m)
                    data = fh.read() if fh is not None else b""
                except (tarfile.ReadError, EOFError, OSError, zlib.error) as e:
                    raise ModelLoadError(f"model {str(p)!r}: truncated or corrupt .nemo archive "
                                         f"while reading {name!r} ({e})") from e
                if len(data) != m.size:
                    raise ModelLoadError(f"model {str(p)!r}: truncated .nemo archive: member {name!r} "
                                         f"has {len(data)} of {m.size} bytes")
                return data

            try:
                config = yaml.safe_load(read(CONFIG_NAME).decode("utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"model {str(p)!r}: {CONFIG_NAME} is not valid YAML ({e})") from e
            if not isinstance(config, dict):
                raise ModelLoadError(f"model {str(p)!r}: {CONFIG_NAME} does not hold a mapping")
            raw = read(WEIGHTS_NAME)
            try:
                state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception as e:  # torch raises several types for corrupt pickles/zips
                raise ModelLoadError(f"model {str(p)!r}: {WEIGHTS_NAME} is not a readable PyTorch "
                                     f"state dict ({type(e).__name__}: {e})") from e
            del raw
            if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
                state = state["state_dict"]
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ModelLoadError(f"model {str(p)!r}: {WEIGHTS_NAME} does not hold a dict of tensors")
            tok_cfg = config.get("tokenizer") or {}
            tok_name = _artifact_name(tok_cfg.get("model_path"))
            tok = None
            if tok_name is not None:
                if tok_name not in by_name:
                    cands = [n for n in by_name if n.endswith(tok_name)]
                    if not cands:
                        raise ModelLoadError(f"model {str(p)!r}: tokenizer model {tok_cfg.get('model_path')!r} "
                                             f"is not in the archive")
                    tok_name = cands[0]
                tok = read(tok_name)
            return NemoArchive(str(p), config, state, tok, sorted(by_name))
    except ModelLoadError:
        raise
    except (tarfile.ReadError, EOFError, zlib.error) as e:
        raise ModelLoadError(f"model {str(p)!r}: truncated or corrupt .nemo archive ({e})") from e


def nemo_to_ours(state: dict, joint_out_index: int, n_layers: int) -> dict:
    """Rename NeMo state-dict keys to :class:`~flashasr.models.parakeet.model.ParakeetModule` keys.

    ``preprocessor.featurizer.{window,fb}`` -> ``preprocessor.{window,fb}``;
    ``encoder.*`` unchanged (shared ``encoder.pos_bias_u/v`` of untied=false models are
    copied into every layer); ``decoder.prediction.embed`` -> ``predictor.embed``;
    ``decoder.prediction.dec_rnn.lstm`` -> ``predictor.lstm``; ``joint.{enc,pred}`` unchanged;
    ``joint.joint_net.<i>`` (the output Linear) -> ``joint.out``; ``ctc_decoder.*`` (the auxiliary
    CTC head of hybrid TDT-CTC models) is dropped. Unknown keys are kept under
    their NeMo names so the caller reports them as unexpected.
    """
    out = {}
    shared = {}
    for k, v in state.items():
        if k.startswith("preprocessor.featurizer."):
            out["preprocessor." + k[len("preprocessor.featurizer."):]] = v
        elif k.startswith("ctc_decoder."):  # auxiliary CTC head of hybrid TDT-CTC models: unused
            continue
        elif k in ("encoder.pos_bias_u", "encoder.pos_bias_v"):
            shared[k.rsplit(".", 1)[1]] = v
        elif k.startswith("decoder.prediction.embed."):
            out["predictor.embed." + k[len("decoder.prediction.embed."):]] = v
        elif k.startswith("decoder.prediction.dec_rnn.lstm."):
            out["predictor.lstm." + k[len("decoder.prediction.dec_rnn.lstm."):]] = v
        elif k.startswith(f"joint.joint_net.{joint_out_index}."):
            out["joint.out." + k[len(f"joint.joint_net.{joint_out_index}."):]] = v
        else:
            out[k] = v
    for name, v in shared.items():
        for i in range(n_layers):
            out.setdefault(f"encoder.layers.{i}.self_attn.{name}", v)
    return out


def load_mapped_state(module: torch.nn.Module, state: dict, source: str) -> None:
    """Copy ``state`` into ``module`` strictly.

    Raises:
        ModelLoadError: missing keys, unexpected keys or mismatched shapes (each listed).
    """
    own = module.state_dict()
    optional = {"preprocessor.window", "preprocessor.fb"}
    missing = [k for k in own if k not in state and k not in optional and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys (e.g. {missing[:5]})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[:5]})")
    if shapes:
        problems.append(f"{len(shapes)} mismatched shapes (e.g. {shapes[:3]})")
    if problems:
        raise ModelLoadError(f"model {source!r}: checkpoint does not match the architecture in its config: "
                             + "; ".join(problems), code="model_load_error")
    own_dtypes = {k: v.dtype for k, v in own.items()}
    module.load_state_dict({k: v.to(own_dtypes[k]) for k, v in state.items()}, strict=False, assign=True)


def ours_to_nemo(state: dict, joint_out_index: int) -> dict:
    """Inverse of :func:`nemo_to_ours` (our module keys -> NeMo state-dict keys)."""
    out = {}
    for k, v in state.items():
        if k.startswith("preprocessor."):
            out["preprocessor.featurizer." + k[len("preprocessor."):]] = v
        elif k.startswith("predictor.embed."):
            out["decoder.prediction.embed." + k[len("predictor.embed."):]] = v
        elif k.startswith("predictor.lstm."):
            out["decoder.prediction.dec_rnn.lstm." + k[len("predictor.lstm."):]] = v
        elif k.startswith("joint.out."):
            out[f"joint.joint_net.{joint_out_index}." + k[len("joint.out."):]] = v
        else:
            out[k] = v
    return out


def write_nemo(path: str | os.PathLike, config: dict, state_dict: dict, artifacts: dict[str, bytes] | None = None,
               compress: bool = False) -> None:
    """Write a ``.nemo`` archive the way NeMo does (members ``./model_config.yaml``,
    ``./model_weights.ckpt``, ``./<artifact>``); ``compress`` writes the pre-1.7 gzip form.
    ``state_dict`` must already use NeMo key names (see :func:`ours_to_nemo`)."""
    import yaml

    def add(tar, name, data: bytes):
        info = tarfile.TarInfo("./" + name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, buf)
    with tarfile.open(path, "w:gz" if compress else "w:") as tar:
        add(tar, CONFIG_NAME, yaml.safe_dump(config, allow_unicode=True, sort_keys=False).encode("utf-8"))
        add(tar, WEIGHTS_NAME, buf.getvalue())
        for name, data in (artifacts or {}).items():
            add(tar, name, data)


__all__ = ["NemoArchive", "read_nemo", "nemo_to_ours", "ours_to_nemo", "load_mapped_state", "write_nemo"]
