"""Server configuration (``flashasr serve`` options) and its command-line parser.

Every option has a help text that states its default (``flashasr serve --help``), and every value
with a range is checked while parsing: a bad one stops the command with exit status 2 and a
message naming the option (``argument --port: must be an integer in 0..65535, got 70000``), as
argparse does for a value of the wrong type.
"""

from __future__ import annotations

import argparse
import math
import os
import re
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
    mode: str = "single"                # "single": one process; "multi": engine process + front-end worker(s);
    #                                     "ray": ingress + model replicas on Ray Serve (--ray)
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
    decode_workers: int | None = None   # processes decoding one long upload's time ranges (None: CPU count, max 16)
    # timeouts
    body_timeout_s: float = 30.0        # longest gap between two body chunks of an upload
    request_timeout_s: float = 900.0    # longest an engine request may take before 504
    ws_idle_timeout_s: float = 300.0    # a WebSocket without any message for this long is closed
    send_timeout_s: float = 20.0        # a client that does not read an event for this long is dropped
    # streaming
    partial_interval_ms: float = 500.0  # cadence of partial transcripts per stream (0: no partials)
    max_utterance_s: float = 30.0       # utterance buffer cap: a longer utterance is committed (final) early
    stream_partials: str = "auto"       # "auto"/"chunked": chunked encoder for Parakeet partials; "reencode": today's
    stream_left_s: float = 10.24        # chunked partials: left context kept per layer (seconds, 80 ms frames)
    stream_chunk_frames: int | None = None  # chunked partials: most new encoder frames per stream and step
    stream_slots: int = 64              # chunked partials: stream states allocated at start (the pool doubles)
    stream_max_slots: int = 8192        # chunked partials: most live streams with chunked state
    stream_batch: int = 512             # chunked partials: most streams in one batched step
    stream_buckets_per_octave: int = 1  # chunked partials on a GPU: row buckets per doubling above 64 rows
    final_wait_ms: float = 20.0         # longest a stream's final gathers with others while partials wait
    final_wait_max_ms: float = 50.0     # ... and while queued chunked partials are late (>= 80 ms old)
    partial_wait_ms: float = 40.0       # longest chunked partials gather for a larger step (0: no wait)
    finals_with_chunks: bool = False    # a due final batch shares its model call with the queued chunk step
    switch_interval_ms: float = 0.0     # GIL switch interval in the model's process (0: CPython's 5 ms)
    vad_threshold: float = 0.5
    vad_prefix_padding_ms: int = 300
    vad_silence_duration_ms: int = 500
    log_level: str = "warning"
    access_log: bool = True             # one INFO line per HTTP request on ACCESS_LOGGER, whatever log_level says
    # TLS (https:// and wss://; browsers give a page on another host the microphone only over https)
    ssl_certfile: str | None = None     # PEM certificate (chain); None: plain HTTP
    ssl_keyfile: str | None = None      # PEM private key (None: in ssl_certfile)
    # Ray Serve (``--ray``; mode "ray"): the cluster address ("default": ray.init's own choice), model
    # replicas between min and max (None: one per GPU of the cluster on CUDA, else min), the requests a
    # replica holds before the autoscaler adds one (None: 4 x batch_limit)
    ray: str | None = None
    ray_min_replicas: int = 1
    ray_max_replicas: int | None = None
    ray_target_ongoing: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def scheduler_options(self) -> dict:
        """Keyword arguments of :class:`~flashasr.serve.scheduler.BatchScheduler` from this config."""
        return {"max_batch": self.batch_limit, "batch_wait_s": self.batch_wait_ms / 1000,
                "stream_batch": self.stream_batch, "final_wait_s": self.final_wait_ms / 1000,
                "final_wait_max_s": self.final_wait_max_ms / 1000,
                "partial_wait_s": self.partial_wait_ms / 1000, "finals_with_chunks": self.finals_with_chunks,
                "switch_interval_s": self.switch_interval_ms / 1000 or None}

    @property
    def batch_limit(self) -> int:
        """``max_batch``, or its default for the device: 1 on CPU (latency first: an upload's short
        neighbour waited 10-18 s behind a batch of eight 30 s windows; batches of 8 raise tiny.en's
        throughput on 2 cores by 1.2-1.3x, ``bench/results/whisper_cpu_{short,long}_vm.json``, so
        a server that only runs batch work can pass ``--max-batch 8``), 8 on CUDA."""
        if self.max_batch is not None:
            return int(self.max_batch)
        return 8 if str(self.device).startswith("cuda") else 1

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    def streaming_config(self):
        """The :class:`~flashasr.models.parakeet.streaming.StreamingConfig` of chunked partials."""
        from ..models.parakeet.streaming import StreamingConfig

        left = int(round(self.stream_left_s / 0.08))
        kw = dict(left_frames=left, slots=self.stream_slots, max_slots=max(self.stream_slots, self.stream_max_slots),
                  idle_s=max(60.0, self.ws_idle_timeout_s + 30.0), max_batch=self.stream_batch,
                  buckets_per_octave=self.stream_buckets_per_octave)
        if self.stream_chunk_frames:
            return StreamingConfig(chunk_frames=int(self.stream_chunk_frames), **kw)
        return StreamingConfig.for_cadence(self.partial_interval_ms or 500.0, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ServeConfig":
        return cls(**d)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ACCESS_LOGGER = "flashasr.serve.access"  # the access log's logger: level INFO in every front end
ENGINE_WAIT_S = 5.0  # multi/Ray mode: how long a request waits for the engine connection before its 503
UNIX_PATH_MAX = 107  # bytes of a Unix socket path (sun_path holds 108 with the terminating NUL)


def _number(kind: type, low: float, *, above: bool = False, high: float | None = None):
    """An argparse ``type``: ``kind`` (int or float), finite, ``>= low`` (``> low`` when ``above``)
    and ``<= high``; otherwise argparse reports the option with this message and exits 2."""
    word = "an integer" if kind is int else "a number"
    rule = (f"in {low:g}..{high:g}" if high is not None else f"{'>' if above else '>='} {low:g}")

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or v < low or (above and v == low) or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"must be {word} {rule}, got {text!r}")
        return v

    return parse


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def _pem_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def _socket_path(text: str) -> str:
    if len(os.fsencode(text)) > UNIX_PATH_MAX:
        raise argparse.ArgumentTypeError(f"a Unix socket path has at most {UNIX_PATH_MAX} bytes, "
                                         f"got {len(os.fsencode(text))}")
    return text


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to every help, except where the help says its default in words
    (options whose default is None or a flag's off)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``flashasr serve`` option parser (:class:`ServeConfig` has the same names and units)."""
    from ..errors import UsageParser

    p = UsageParser(prog="flashasr serve", formatter_class=_HelpFormatter,
                                description="OpenAI-compatible speech-to-text server (HTTP + WebSocket streaming).")
    _model_options(p)
    _http_options(p)
    _engine_options(p)
    _stream_options(p)
    _ray_options(p)
    return p


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="model spec, as for 'flashasr transcribe --model' "
                   "(default: the embedded whisper tiny.en)")
    g.add_argument("--device", type=_device, default="cpu", help="torch device: cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="weights' dtype (default: the model's: Whisper float16 on CUDA, else float32)")
    g.add_argument("--engine", choices=("auto", "plain"), default="auto",
                   help="auto: the GPU engine for the model on CUDA; plain: plain PyTorch")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up model call at start-up "
                   "(default: warm up before /ready answers 200)")


def _http_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 (or ::) for every interface")
    g.add_argument("--port", type=_number(int, 0, high=65535), default=8000,
                   help="TCP port (0: a free port, named in the start-up line on stderr)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: env FLASHASR_API_KEY; neither: no authentication)")
    g.add_argument("--max-upload-mb", type=_number(float, 0, above=True), default=1024.0,
                   help="request body limit in MiB, enforced while the body streams in (413 file_too_large)")
    g.add_argument("--max-audio-s", type=_number(float, 0, above=True), default=14400.0,
                   help="longest decoded audio of an upload in seconds (400 audio_too_long)")
    g.add_argument("--body-timeout-s", type=_number(float, 0, above=True), default=30.0,
                   help="an upload whose body stalls this many seconds gets 408")
    g.add_argument("--request-timeout-s", type=_number(float, 0, above=True), default=900.0,
                   help="an upload's transcription that takes longer gets 504 (on a CPU a 60-minute upload "
                        "needs more: raise it)")
    g.add_argument("--cpu-threads", type=_number(int, 1), default=2,
                   help="CPU pool of each front end: container decode, resampling, VAD cutting of uploads")
    g.add_argument("--decode-workers", type=_number(int, 1), default=None,
                   help="processes that decode one long upload (>= 60 s) in time ranges, joined sample-exactly, "
                        "in single mode (a front end of --mode multi decodes sequentially; default: env "
                        "FLASHASR_DECODE_WORKERS, else the CPU count, at most 16; 1: sequential)")
    g.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="warning",
                   help="level of the server's log messages on stderr (info adds uvicorn's connection lines "
                        "and one line per client that leaves mid-upload); the access log has its own switch")
    g.add_argument("--no-access-log", action="store_true", help="no access log (default: one line per HTTP "
                   "request on stderr at any --log-level: client, method, path, status, duration)")
    g.add_argument("--ssl-certfile", type=_pem_file, default=None, help="PEM certificate (chain): serve https:// "
                   "and wss:// (default: plain http; browsers allow the web page's microphone only over https "
                   "or on localhost)")
    g.add_argument("--ssl-keyfile", type=_pem_file, default=None, help="PEM private key of --ssl-certfile "
                   "(default: the key is in the certificate file)")


def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("processes and batching")
    g.add_argument("--mode", choices=("single", "multi"), default="single",
                   help="single: one process; multi: one engine process + front-end worker process(es)")
    g.add_argument("--workers", type=_number(int, 1), default=1,
                   help="front-end processes sharing the port (more than 1 needs --mode multi)")
    g.add_argument("--max-batch", type=_number(int, 1), default=None,
                   help="waveforms per model call (default: 1 on CPU, so a short request waits behind one 30 s window, "
                        "not eight (8 gives 1.2-1.3x the throughput of batch work); 8 on CUDA; "
                        "use 256 with a Parakeet model on a GPU)")
    g.add_argument("--batch-wait-ms", type=_number(float, 0), default=2.0,
                   help="how long the scheduler waits to fill a batch of offline work (0: never waits)")
    g.add_argument("--shm-threshold-kb", type=_number(int, 0), default=1024,
                   help="multi mode: audio payloads above this many KiB cross to the engine through shared memory")
    g.add_argument("--engine-socket", type=_socket_path, default=None,
                   help="multi mode: path of the engine's Unix socket (default: in a private temp dir)")
    g.add_argument("--no-gc-freeze", action="store_true", help="skip gc.freeze() after start-up "
                   "(benchmarks; default: freeze in every long-lived process)")


def _stream_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("streaming (WebSocket)")
    g.add_argument("--partial-interval-ms", type=_number(float, 0), default=500.0,
                   help="new audio between two partial transcripts of a stream (0: no partials)")
    g.add_argument("--max-utterance-s", type=_number(float, 0, above=True), default=30.0,
                   help="utterance buffer cap of a stream; a longer utterance is committed early")
    g.add_argument("--ws-idle-timeout-s", type=_number(float, 0, above=True), default=300.0,
                   help="a WebSocket without any message for this many seconds is closed")
    g.add_argument("--stream-partials", choices=("auto", "chunked", "reencode"), default="auto",
                   help="how partials are computed: chunked = encode only the new audio with cached per-layer "
                        "state (cost per stream flat in utterance length; Parakeet-TDT; auto picks it where the "
                        "model has it), reencode = re-transcribe the utterance so far (Whisper always). Finals "
                        "re-encode the whole utterance either way")
    g.add_argument("--stream-left-s", type=_number(float, 0), default=10.24,
                   help="chunked partials: left context per layer in seconds (GPU memory per stream grows with it)")
    g.add_argument("--stream-chunk-frames", type=_number(int, 1, high=256), default=None,
                   help="chunked partials: most new 80 ms encoder frames per stream and step (default: the partial "
                        "cadence in frames, rounded up)")
    g.add_argument("--stream-slots", type=_number(int, 1), default=64,
                   help="chunked partials: stream states allocated at start (doubled when full; on a GPU set it "
                        "to the streams expected, growing re-captures the step's graphs)")
    g.add_argument("--stream-max-slots", type=_number(int, 1), default=8192,
                   help="chunked partials: most live streams with chunked state (more: their partials are skipped)")
    g.add_argument("--stream-batch", type=_number(int, 1), default=512,
                   help="chunked partials: most streams in one batched step")
    g.add_argument("--stream-buckets-per-octave", type=_number(int, 1, high=64), default=1,
                   help="chunked partials on a GPU: one CUDA graph per row bucket, a step padded up to the next; "
                        "powers of two up to 64 rows, then this many sizes per doubling (1: powers of two). Each "
                        "graph holds GPU memory of its own: 4 ran out of memory with 2,000 stream slots on an "
                        "80 GB H100")
    g.add_argument("--final-wait-ms", type=_number(float, 0, high=1000), default=20.0,
                   help="longest a stream's final waits to be batched with others while partial work is "
                        "queued; a final runs at once when a full batch of finals waits or nothing else is "
                        "queued (0: finals always first; at most 1000)")
    g.add_argument("--final-wait-max-ms", type=_number(float, 0, high=1000), default=50.0,
                   help="longest a final waits to be batched with others while queued chunked partials are "
                        "late (the oldest has waited 80 ms, and longer than --partial-wait-ms): near saturation "
                        "larger final batches leave the engine to the partials (up to --max-batch finals a call); "
                        "off when not above --final-wait-ms or when that is 0; at most 1000")
    g.add_argument("--partial-wait-ms", type=_number(float, 0, high=1000), default=40.0,
                   help="chunked partials: longest queued chunks wait for more streams' chunks before a step "
                        "smaller than the stream batch runs, when nothing else is runnable; new work ends the "
                        "wait; a lone stream's partials come this much later (0: never wait; at most 1000)")
    g.add_argument("--finals-with-chunks", action="store_true",
                   help="chunked partials on a GPU: a due batch of finals shares its model call with the queued "
                        "chunk step (the finals' device work queued first, the step's host work and graph beside "
                        "it; the finals answered when read, not after the step). A model without queued device "
                        "work (the CPU) ignores it: there a final would only wait for the step (default: off)")
    g.add_argument("--switch-interval-ms", type=_number(float, 0, high=100), default=0.0,
                   help="the GIL switch interval in the process running the model (its thread shares the GIL "
                        "with the event loop; 0: leave CPython's 5 ms; at most 100)")


def _ray_address(text: str) -> str:
    from ..ray_cluster import check_address
    from ..errors import FlashASRError

    if text == "default":  # the flag alone (argparse converts the const too)
        return text
    try:
        return check_address(text)
    except FlashASRError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ray_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (a cluster; docs/RAY.md)")
    g.add_argument("--ray", nargs="?", const="default", default=None, type=_ray_address, metavar="ADDRESS",
                   help="serve on a Ray cluster: --workers ingress replicas (HTTP, WebSocket, decode, VAD) in front "
                        "of autoscaled model replicas (one GPU each); ADDRESS: auto, local, HOST:PORT or "
                        "ray://HOST:10001 (without one: RAY_ADDRESS, a cluster started here, else a local instance; "
                        "default: not on Ray)")
    g.add_argument("--ray-min-replicas", type=_number(int, 1), default=1, help="model replicas at least")
    g.add_argument("--ray-max-replicas", type=_number(int, 1), default=None,
                   help="model replicas at most (default: one per GPU of the cluster on CUDA, else the minimum)")
    g.add_argument("--ray-target-ongoing", type=_number(float, 0, above=True), default=None,
                   help="requests a model replica holds (queued or running) before the autoscaler adds one "
                        "(default: four times the largest batch)")


def parse_args(argv: list[str]) -> ServeConfig:
    """Parse ``flashasr serve`` options into a :class:`ServeConfig` (bad values: exit status 2)."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.ray is None and a.mode == "single" and a.workers != 1:
        p.error("argument --workers: more than 1 needs --mode multi (one engine process shared by the workers)")
    if a.ssl_keyfile and not a.ssl_certfile:
        p.error("argument --ssl-keyfile: needs --ssl-certfile (the certificate it belongs to)")
    if a.ssl_certfile:
        _check_tls(p, a.ssl_certfile, a.ssl_keyfile)
    return ServeConfig(
        host=a.host, port=a.port, model=a.model, device=a.device, dtype=a.dtype, engine=a.engine,
        api_key=a.api_key or os.environ.get("FLASHASR_API_KEY") or None,
        max_upload_mb=a.max_upload_mb, max_audio_s=a.max_audio_s, mode="ray" if a.ray else a.mode,
        workers=a.workers,
        max_batch=a.max_batch, batch_wait_ms=a.batch_wait_ms, warmup=not a.no_warmup, gc_freeze=not a.no_gc_freeze,
        shm_threshold_bytes=a.shm_threshold_kb * 1024, engine_socket=a.engine_socket,
        cpu_threads=a.cpu_threads, decode_workers=a.decode_workers, partial_interval_ms=a.partial_interval_ms,
        max_utterance_s=a.max_utterance_s, ws_idle_timeout_s=a.ws_idle_timeout_s,
        stream_partials=a.stream_partials, stream_left_s=a.stream_left_s, stream_chunk_frames=a.stream_chunk_frames,
        stream_slots=a.stream_slots, stream_max_slots=a.stream_max_slots, stream_batch=a.stream_batch,
        stream_buckets_per_octave=a.stream_buckets_per_octave, final_wait_ms=a.final_wait_ms, final_wait_max_ms=a.final_wait_max_ms, partial_wait_ms=a.partial_wait_ms,
        finals_with_chunks=a.finals_with_chunks,
        switch_interval_ms=a.switch_interval_ms, body_timeout_s=a.body_timeout_s,
        request_timeout_s=a.request_timeout_s, log_level=a.log_level,
        access_log=not a.no_access_log,
        ssl_certfile=a.ssl_certfile, ssl_keyfile=a.ssl_keyfile, ray=a.ray, ray_min_replicas=a.ray_min_replicas,
        ray_max_replicas=a.ray_max_replicas, ray_target_ongoing=a.ray_target_ongoing,
    )


def _check_tls(p: argparse.ArgumentParser, certfile: str, keyfile: str | None) -> None:
    """Load the certificate and key once while parsing, so a wrong pair or a bad file stops the
    command with exit 2 naming the option, not a traceback after start-up."""
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError, ValueError) as e:
        p.error(f"argument --ssl-certfile: cannot use {certfile!r}{f' with {keyfile!r}' if keyfile else ''} "
                f"as a TLS certificate and key: {e}")
