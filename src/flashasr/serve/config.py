"""Server configuration (``flashasr serve`` options) and its command-line parser."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field


@dataclass
class ServeConfig:
    """Everything the HTTP/WebSocket front end and the engine need to know.

    Units are in the field names: ``*_mb`` mebibytes, ``*_s`` seconds, ``*_ms`` milliseconds.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None            # model spec for flashasr.pipeline.engines.load_model (None: tiny.en)
    device: str = "cpu"
    dtype: str | None = None
    engine: str = "auto"                # "auto": the GPU engine on CUDA; "plain": plain PyTorch
    api_key: str | None = None          # Bearer key; None: no authentication
    max_upload_mb: float = 1024.0       # request body limit, enforced while the body streams in
    max_audio_s: float = 14400.0        # longest decoded audio accepted (4 h)
    mode: str = "single"                # "single": one process; "multi": engine process + front-end worker(s)
    workers: int = 1                    # front-end worker processes (multi mode)
    # engine / batching
    max_batch: int | None = None        # waveforms per model call; None: 1 on CPU, 8 on CUDA (see batch_limit)
    batch_wait_ms: float = 2.0          # how long the scheduler waits to fill a batch of offline work
    warmup: bool = True
    gc_freeze: bool = True              # gc.freeze() after start-up/warm-up in each long-lived process
    # IPC
    shm_threshold_bytes: int = 1 << 20  # audio payloads larger than this travel through shared memory
    engine_socket: str | None = None    # Unix socket path of the engine (multi mode); None: private temp dir
    # CPU pool for container decode / resampling (threads that release the GIL)
    cpu_threads: int = 2
    # timeouts
    body_timeout_s: float = 30.0        # longest gap between two body chunks of an upload
    request_timeout_s: float = 900.0    # longest an engine request may take before 504
    ws_idle_timeout_s: float = 300.0    # a WebSocket without any message for this long is closed
    send_timeout_s: float = 20.0        # a client that does not read an event for this long is dropped
    # streaming
    partial_interval_ms: float = 500.0  # cadence of partial transcripts per stream (0: no partials)
    max_utterance_s: float = 30.0       # utterance buffer cap: a longer utterance is committed (final) early
    vad_threshold: float = 0.5
    vad_prefix_padding_ms: int = 300
    vad_silence_duration_ms: int = 500
    log_level: str = "warning"
    extra: dict = field(default_factory=dict)

    @property
    def batch_limit(self) -> int:
        """``max_batch``, or its default for the device: 1 on CPU (on 2 cores 8 batched Whisper windows
        ran slower than one by one, ``bench/results/whisper_cpu_vm.json``, and an upload's short
        neighbour waited 10-18 s behind a batch of eight), 8 on CUDA."""
        if self.max_batch is not None:
            return int(self.max_batch)
        return 8 if str(self.device).startswith("cuda") else 1

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ServeConfig":
        return cls(**d)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashasr serve",
                                description="OpenAI-compatible speech-to-text server (HTTP + WebSocket streaming).")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="model spec (default: embedded whisper tiny.en)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--engine", choices=("auto", "plain"), default="auto",
                   help="auto (default): the GPU engine for the model on CUDA; plain: plain PyTorch")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env FLASHASR_API_KEY)")
    p.add_argument("--max-upload-mb", type=float, default=1024.0)
    p.add_argument("--max-audio-s", type=float, default=14400.0)
    p.add_argument("--mode", choices=("single", "multi"), default="single",
                   help="single: one process; multi: one engine process + front-end worker process(es)")
    p.add_argument("--workers", type=int, default=1, help="front-end worker processes (multi mode)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="waveforms per model call (default: 1 on CPU, where batching Whisper windows measured "
                        "slower and a short request would wait behind a batch of 30 s windows; 8 on CUDA; "
                        "use 256 with a Parakeet model on a GPU)")
    p.add_argument("--batch-wait-ms", type=float, default=2.0)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-gc-freeze", action="store_true", help="skip gc.freeze() after start-up (benchmarks)")
    p.add_argument("--shm-threshold-kb", type=int, default=1024)
    p.add_argument("--engine-socket", default=None)
    p.add_argument("--cpu-threads", type=int, default=2)
    p.add_argument("--partial-interval-ms", type=float, default=500.0)
    p.add_argument("--max-utterance-s", type=float, default=30.0)
    p.add_argument("--ws-idle-timeout-s", type=float, default=300.0)
    p.add_argument("--body-timeout-s", type=float, default=30.0)
    p.add_argument("--log-level", default="warning")
    return p


def parse_args(argv: list[str]) -> ServeConfig:
    """Parse ``flashasr serve`` options into a :class:`ServeConfig`."""
    a = build_parser().parse_args(argv)
    if a.workers < 1:
        raise SystemExit("--workers must be >= 1")
    if a.mode == "single" and a.workers != 1:
        raise SystemExit("--workers > 1 needs --mode multi (one engine process shared by the workers)")
    return ServeConfig(
        host=a.host, port=a.port, model=a.model, device=a.device, dtype=a.dtype, engine=a.engine,
        api_key=a.api_key or os.environ.get("FLASHASR_API_KEY") or None,
        max_upload_mb=a.max_upload_mb, max_audio_s=a.max_audio_s, mode=a.mode, workers=a.workers,
        max_batch=a.max_batch, batch_wait_ms=a.batch_wait_ms, warmup=not a.no_warmup, gc_freeze=not a.no_gc_freeze,
        shm_threshold_bytes=a.shm_threshold_kb * 1024, engine_socket=a.engine_socket,
        cpu_threads=a.cpu_threads, partial_interval_ms=a.partial_interval_ms,
        max_utterance_s=a.max_utterance_s, ws_idle_timeout_s=a.ws_idle_timeout_s,
        body_timeout_s=a.body_timeout_s, log_level=a.log_level,
    )
