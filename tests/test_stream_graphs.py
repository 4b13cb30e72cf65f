"""GPU only (skipped without CUDA): the chunked streaming step as CUDA graphs equals the eager step
(the same streamer class with ``use_graphs=False``: the same kernels, token for token), and stays
within float rounding of the plain model's streamer (its Triton add + LayerNorm rounds differently).

Run on the H200 with ``scripts/gpu_tests.sh`` (or ``pytest -m gpu tests/test_stream_graphs.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PARAKEET_FIXTURES
from flashasr.models.parakeet.model import load_parakeet
from flashasr.models.parakeet.streaming import ParakeetStreamer, StreamingConfig

pytestmark = pytest.mark.gpu
TINY = PARAKEET_FIXTURES / "tiny-tdt"


@pytest.fixture(scope="module")
def speech():
    ref = np.load(TINY / "reference.npz")
    return [ref["audio"][b, : ref["audio_lengths"][b]].astype(np.float32) for b in range(4)]


def _run(streamer, clips, sizes):
    pos = [0] * len(clips)
    k = 0
    out = None
    while any(p < len(c) for p, c in zip(pos, clips)):
        reqs = []
        for i, c in enumerate(clips):
            if pos[i] < len(c):
                n = sizes[(i + k) % len(sizes)]
                reqs.append((f"s{i}", c[pos[i]: pos[i] + n]))
                pos[i] += n
        out = streamer.step(reqs)
        k += 1
    return {f"s{i}": list(streamer.streams[f"s{i}"].tokens) for i in range(len(clips))}, out


def _close(got: dict, plain: dict) -> None:
    """Tokens of the GPU streamer against the plain PyTorch streamer: float rounding may flip a rare
    decision, so at least 98 % of each stream's tokens match."""
    import difflib

    for k, toks in plain.items():
        assert difflib.SequenceMatcher(a=got[k], b=toks, autojunk=False).ratio() >= 0.98, k


def test_graphed_step_equals_eager_on_cuda(speech):
    from flashasr.engine.stream_graphs import GraphedStreamer

    m = load_parakeet(TINY / "model.nemo", device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = StreamingConfig(chunk_frames=7, left_frames=16, slots=2, max_batch=4)
    want, _ = _run(GraphedStreamer(m, cfg, use_graphs=False), speech, [8000, 3000, 12000])
    plain, _ = _run(ParakeetStreamer(m, cfg), speech, [8000, 3000, 12000])
    g = GraphedStreamer(m, cfg)
    g.warmup()
    got, res = _run(g, speech, [8000, 3000, 12000])
    assert got == want
    _close(got, plain)
    assert g._graph_ok and g._full_ok, g.events  # the WHILE-node graph was used
    assert g.pool.capacity >= 4  # the pool grew (graphs re-captured) while streams were live


def test_graphed_steps_in_buckets_between_powers_of_two_equal_eager(speech):
    """Steps of 70 (padded to 80), then fewer rows as streams end: the buckets between powers of two
    share one window buffer, and each row's tokens equal the eager step's."""
    from flashasr.engine.stream_graphs import GraphedStreamer

    m = load_parakeet(TINY / "model.nemo", device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    clips = [speech[i % 4][(i * 1_237) % 8_000:] for i in range(70)]  # 70 streams, each its own start
    cfg = StreamingConfig(chunk_frames=7, left_frames=16, slots=80, max_batch=96, buckets_per_octave=4)
    want, _ = _run(GraphedStreamer(m, cfg, use_graphs=False), clips, [8000, 3000, 12000])
    plain, _ = _run(ParakeetStreamer(m, cfg), clips, [8000, 3000, 12000])
    g = GraphedStreamer(m, cfg)
    assert g.buckets == [1, 2, 4, 8, 16, 32, 64, 80, 96]
    g.warmup()
    got, _ = _run(g, clips, [8000, 3000, 12000])
    assert got == want
    _close(got, plain)
    assert g._graph_ok and g._full_ok, g.events
    assert g._graphs[80].seg.data_ptr() == g._graphs[4].seg.data_ptr()  # one shared window buffer


def test_gpu_engine_streamer_is_graphed_and_close_to_fp32(speech):
    """ParakeetGPUASR (bf16 fused encoder) gives a GraphedStreamer; its partial text is produced and its
    encoder frames stay close to the float32 eager ones."""
    from flashasr.engine.parakeet_gpu import ParakeetGPUASR
    from flashasr.engine.stream_graphs import GraphedStreamer

    gpu = ParakeetGPUASR(load_parakeet(TINY / "model.nemo", device="cuda"), warmup=False)
    s = gpu.make_streamer(StreamingConfig(chunk_frames=7, left_frames=16, max_batch=8))
    assert isinstance(s, GraphedStreamer)
    s.warmup()
    got, res = _run(s, speech, [8000])
    assert all(isinstance(r.text, str) for r in res) and s.counters["steps"] > 10


def test_offline_graphs_survive_a_streamer_built_after_them(speech):
    """A streamer made after the offline TDT graphs were captured must not move the predictor's
    weights (the H200 run of bench_stream_scale: every offline replay after make_streamer was an
    illegal memory access, RNNBase.flatten_parameters re-allocating the LSTM's weight chunk)."""
    from flashasr.engine.parakeet_gpu import ParakeetGPUASR

    gpu = ParakeetGPUASR(load_parakeet(TINY / "model.nemo", device="cuda"), warmup=False)
    lstm = gpu.predictor.lstm
    before = [t.text for t in gpu.transcribe_batch(speech)]  # captures the offline graphs
    ptrs = [w.data_ptr() for w in lstm._flat_weights]
    s = gpu.make_streamer(StreamingConfig(chunk_frames=7, left_frames=16, max_batch=4))
    s.warmup()
    _run(s, speech, [8000])
    assert [w.data_ptr() for w in lstm._flat_weights] == ptrs
    after = [t.text for t in gpu.transcribe_batch(speech)]
    torch.cuda.synchronize()
    assert after == before
