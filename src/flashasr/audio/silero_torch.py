"""Silero VAD as one batched PyTorch computation: the same network and weights as the package's
ONNX models, run over every frame of many recordings at once (on the GPU, or the CPU).

The network (the 16 kHz model in the package's ``silero_vad.jit``, whose weights its ONNX models
hold; the layout of the package's ``tinygrad_model.py``), per 32 ms frame of 512 samples at 16 kHz
preceded by the previous frame's last 64 samples (zeros before the first):

    [576] --reflect pad 64--> [640] --STFT conv (258 x 256, stride 128)--> |.| [129, 4]
          --conv 3 +ReLU--> [128, 4] --conv 3 /2 +ReLU--> [64, 2] --conv 3 /2 +ReLU--> [64, 1]
          --conv 3 +ReLU--> [128] --LSTM cell (state carried from frame to frame)--> h [128]
          --ReLU, 1x1 conv, sigmoid--> speech probability

Before the network each frame is multiplied by the VAD's level gain
(:func:`flashasr.audio.vad.level_gains`: a target RMS over the RMS of the loudest frame of the
second ending with it, at most 20 dB), computed here on the device from the same frames; applied to the reflect-padded
frame, which is the same product.

Everything before the LSTM is independent per frame, so all frames of all recordings go through
the convolutions as one batch ``[F, 576]``; the LSTM then runs as one cuDNN/oneDNN call over each
recording's frame sequence ``[T, B, 128]`` (recordings padded at their ends: the LSTM is causal,
so padding changes nothing before it). A recording longer than ``chunk_frames`` is cut into chunks
that run side by side in the batch, each started ``warmup_frames`` early from a zero state; the
warm-up outputs are dropped. The defaults are the ONNX path's state restarts
(:data:`flashasr.audio.vad.STATE_CHUNK_FRAMES`: 16.4 s chunks, 4 s warm-up), so both give the
same probabilities; a state carried longer drifts (quiet speech after a minute of whale song was
not found).

Frame ``t`` of a recording covers seconds ``[t * 0.032, (t + 1) * 0.032)``; the last frame is
zero-padded, as :func:`flashasr.audio.vad.speech_probabilities` (ONNX) does; both give the same
probabilities up to float rounding (tested).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import numpy as np

FRAME = 512
CONTEXT = 64
_NETS: dict = {}
_LOCK = threading.Lock()


# the 16 kHz network's tensors in the package's TorchScript model (the weights of its ONNX models;
# the package's silero_vad_16k.safetensors holds an older network's) -> the names used here
_NAMES = {"_model.stft.forward_basis_buffer": "stft_conv.weight",
          "_model.encoder.0.reparam_conv.weight": "conv1.weight", "_model.encoder.0.reparam_conv.bias": "conv1.bias",
          "_model.encoder.1.reparam_conv.weight": "conv2.weight", "_model.encoder.1.reparam_conv.bias": "conv2.bias",
          "_model.encoder.2.reparam_conv.weight": "conv3.weight", "_model.encoder.2.reparam_conv.bias": "conv3.bias",
          "_model.encoder.3.reparam_conv.weight": "conv4.weight", "_model.encoder.3.reparam_conv.bias": "conv4.bias",
          "_model.decoder.rnn.weight_ih": "lstm_cell.weight_ih", "_model.decoder.rnn.weight_hh": "lstm_cell.weight_hh",
          "_model.decoder.rnn.bias_ih": "lstm_cell.bias_ih", "_model.decoder.rnn.bias_hh": "lstm_cell.bias_hh",
          "_model.decoder.decoder.2.weight": "final_conv.weight", "_model.decoder.decoder.2.bias": "final_conv.bias"}


def _load_weights() -> dict:
    """The 16 kHz network's tensors (CPU, float32) from the silero-vad package's TorchScript file."""
    import warnings

    import torch

    from .vad import silero_data_path

    path = silero_data_path("silero_vad.jit")  # located, not imported (the import sets torch to 1 thread)

    with warnings.catch_warnings():  # torch 2.11+ deprecates TorchScript; only its tensors are read here
        warnings.simplefilter("ignore", DeprecationWarning)
        sd = torch.jit.load(path, map_location="cpu").state_dict()
    return {ours: sd[theirs].detach().float().clone() for theirs, ours in _NAMES.items()}


def _net(device: str):
    """The network's tensors on ``device`` (float32), loaded once per device."""
    with _LOCK:
        if device not in _NETS:
            import torch

            w = {k: v.to(device=device) for k, v in _load_weights().items()}
            lstm = torch.nn.LSTM(128, 128).to(device)
            with torch.no_grad():
                lstm.weight_ih_l0.copy_(w["lstm_cell.weight_ih"])
                lstm.weight_hh_l0.copy_(w["lstm_cell.weight_hh"])
                lstm.bias_ih_l0.copy_(w["lstm_cell.bias_ih"])
                lstm.bias_hh_l0.copy_(w["lstm_cell.bias_hh"])
            lstm.eval()
            lstm.flatten_parameters()
            _NETS[device] = (w, lstm)
        return _NETS[device]


def _conv(x, weight, bias, stride: int):
    """A kernel-3, padding-1 1-D convolution over ``x`` [F, T, C] as one matrix product (cuBLAS;
    no cuDNN algorithm search for the ever-changing frame counts) -> [F, T', O]."""
    import torch.nn.functional as F

    cols = F.pad(x, (0, 0, 1, 1)).unfold(1, 3, stride)  # [F, T', C, 3]
    return cols.flatten(2) @ weight.flatten(1).T + bias


def _level_gains(frames):
    """:func:`flashasr.audio.vad.level_gains` of every frame of the buffer ``[G, 576]`` (the signals
    are :data:`~flashasr.audio.vad.LEVEL_FRAMES` - 1 zero frames apart, so each frame's window sees
    only its own signal, and silence before its start) -> float32 ``[G]`` on the device."""
    import torch
    import torch.nn.functional as F

    from .vad import LEVEL_FRAMES, LEVEL_MAX_GAIN_DB, LEVEL_TARGET_DBFS

    e = torch.linalg.vector_norm(frames[:, CONTEXT:], dim=1) ** 2 / FRAME  # [G] mean squares
    level = F.pad(e, (LEVEL_FRAMES - 1, 0)).unfold(0, LEVEL_FRAMES, 1).amax(1)
    target = 10.0 ** (LEVEL_TARGET_DBFS / 20.0)
    floor = (target / 10.0 ** (LEVEL_MAX_GAIN_DB / 20.0)) ** 2
    return target / torch.sqrt(torch.clamp(level, min=floor))


def _encode(frames, w):
    """[F, 576] -> LSTM inputs [F, 128] (the per-frame part of the network, on the frames times their
    level gain), as matrix products."""
    import torch
    import torch.nn.functional as F

    gains = _level_gains(frames)
    x = F.pad(frames.unsqueeze(1), (0, 64), mode="reflect").squeeze(1)  # [F, 640]
    x.mul_(gains[:, None])
    x = x.unfold(1, 256, 128) @ w["stft_conv.weight"][:, 0, :].T  # [F, 4, 258]
    x = torch.sqrt(x[..., :129] ** 2 + x[..., 129:] ** 2)  # [F, 4, 129]
    x = torch.relu(_conv(x, w["conv1.weight"], w["conv1.bias"], 1))  # [F, 4, 128]
    x = torch.relu(_conv(x, w["conv2.weight"], w["conv2.bias"], 2))  # [F, 2, 64]
    x = torch.relu(_conv(x, w["conv3.weight"], w["conv3.bias"], 2))  # [F, 1, 64]
    x = torch.relu(_conv(x, w["conv4.weight"], w["conv4.bias"], 1))  # [F, 1, 128]
    return x[:, 0]


def speech_probabilities_batch(signals: Sequence[np.ndarray], *, device: str = "cpu", chunk_frames: int | None = None,
                               warmup_frames: int | None = None) -> list[np.ndarray]:
    """Silero speech probability per 32 ms frame for every 16 kHz recording, in one computation.

    Args:
        signals: float32 ``[N_i]`` arrays at 16 kHz.
        device: where to compute (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        chunk_frames: a recording longer than this runs as chunks side by side, each from a zero
            state (default :data:`~flashasr.audio.vad.STATE_CHUNK_FRAMES`, 512 frames = 16.4 s: then
            the result equals :func:`flashasr.audio.vad.speech_probabilities` up to float rounding).
        warmup_frames: frames each later chunk starts early (run, then dropped) to warm its state
            (default :data:`~flashasr.audio.vad.STATE_WARMUP_FRAMES`, 125 = 4 s).
    Returns:
        float32 ``[ceil(N_i / 512)]`` per recording (empty for an empty one).
    Raises:
        ValueError: a signal that is not 1-D.
    """
    import torch

    from .vad import LEVEL_FRAMES, STATE_CHUNK_FRAMES, STATE_WARMUP_FRAMES

    chunk_frames = STATE_CHUNK_FRAMES if chunk_frames is None else int(chunk_frames)
    warmup_frames = STATE_WARMUP_FRAMES if warmup_frames is None else int(warmup_frames)
    w, lstm = _net(str(device))
    # one buffer for all signals, each at a multiple of 512 samples plus 64 (its first frame's
    # context: zeros), LEVEL_FRAMES - 1 frames of zeros between signals (the level gain's window sees
    # silence before each start): then frame g of the whole buffer (buffer[512 g : 512 g + 576]) is
    # frame t of signal i for g = base_i + t -- the frames are a view of the buffer on the device (no
    # host-side framing, one copy of the audio)
    gap = max(1, LEVEL_FRAMES - 1)
    xs, total, bases, rows, pos = [], [], [], [], 0  # rows: (signal, first kept, first run, frames run, base)
    for i, s in enumerate(signals):
        x = np.asarray(s, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"signal {i}: expected mono samples [N], got shape {x.shape}")
        n_frames = -(-x.shape[0] // FRAME)
        xs.append(x)
        total.append(n_frames)
        bases.append(pos)
        for keep in range(0, n_frames, chunk_frames):
            start = max(0, keep - warmup_frames)
            rows.append((i, keep, start, min(n_frames, keep + chunk_frames) - start, pos))
        pos += n_frames + gap
    buf = np.zeros(pos * FRAME + CONTEXT, np.float32)  # (the last signal's gap frames: unused)
    for x, base in zip(xs, bases):
        buf[base * FRAME + CONTEXT: base * FRAME + CONTEXT + x.shape[0]] = x
    out = [np.zeros(0, np.float32) if t == 0 else np.empty(t, np.float32) for t in total]
    if not rows:
        return out
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        if str(device).startswith("cuda"):  # its own stream: the model's work is not waited for
            stack.enter_context(torch.cuda.stream(_stream(device)))
        p = _run(buf, rows, w, lstm, device)
    for b, (i, keep, start, n, _off) in enumerate(rows):
        out[i][keep:start + n] = p[b, keep - start:n]
    return out


def _stream(device: str):
    with _LOCK:
        if ("stream", device) not in _NETS:
            import torch

            _NETS[("stream", device)] = torch.cuda.Stream(device=device)
        return _NETS[("stream", device)]


def _run(buf: np.ndarray, rows: list, w: dict, lstm, device: str) -> np.ndarray:
    """The network over every frame of ``buf`` (see :func:`speech_probabilities_batch`):
    [B rows, T] probabilities on the host."""
    import torch

    allf = torch.from_numpy(buf).to(device).unfold(0, CONTEXT + FRAME, FRAME)  # [G, 576], a view
    feats = _encode(allf, w)  # [F_total, 128]
    t_max = max(r[3] for r in rows)
    # each row's frames into [t_max, B, 128] in one indexing op (rows shorter than t_max read frame
    # 0 at their end: the LSTM is causal, so nothing before it changes, and those outputs are dropped)
    idx = np.zeros((t_max, len(rows)), np.int64)
    for b, (_i, _keep, start, n, off) in enumerate(rows):
        idx[:n, b] = np.arange(off + start, off + start + n)
    h, _ = lstm(feats[torch.from_numpy(idx).to(feats.device)])
    p = torch.sigmoid(torch.relu(h) @ w["final_conv.weight"][0, :, 0] + w["final_conv.bias"][0])  # [T, B]
    return p.T.float().cpu().numpy()


__all__ = ["speech_probabilities_batch"]
