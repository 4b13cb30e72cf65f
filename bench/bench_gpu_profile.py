"""Where does encoder time go? torch.profiler top kernels for one large batch of the 0.6B-v3
encoder (eager, bf16), and engine-level settings tried: cudnn.benchmark, channels-last
subsampling convolutions. Writes bench/results/gpu_encoder_profile.json. Device only."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench_gpu_common import build_v3_model, cuda_time, env_record, write_result
from flashasr.engine.profiles import EncoderProfiles, Profile


def main(argv=None):
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # --help, nothing else
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_profile.py needs a CUDA GPU (run it on the device machine)")
    torch.backends.cuda.matmul.allow_tf32 = True
    from flashasr.engine.fast_attention import install_fast_attention

    model = build_v3_model("cuda")
    B, S = 96, 20.0
    ep = EncoderProfiles(model, [Profile(B, S)], dtype=torch.bfloat16, project=False, fast_attention=False)
    audio = torch.randn(B, int(S * 16000), device="cuda") * 0.1
    lens = torch.full((B,), int(S * 16000), device="cuda")
    rows = {}

    def t(name):
        rows[name] = 1e3 * cuda_time(lambda: ep.forward_eager(audio, lens), warmup=2, reps=5)["median_s"]
        print(f"{name:50s} {rows[name]:8.2f} ms  RTFx {B * S / rows[name] * 1e3:8.0f}", flush=True)

    t("eager, model attention")
    print("fast attention modules:", install_fast_attention(model.encoder))
    t("eager fast attention")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ep.forward_eager(audio, lens)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70)
    print(table[:2500])
    torch.backends.cudnn.benchmark = True
    t("eager fast attention + cudnn.benchmark")
    for m in model.encoder.pre_encode.conv:
        if isinstance(m, torch.nn.Conv2d):
            m.to(memory_format=torch.channels_last)
    t("eager fast attention + cudnn.benchmark + channels_last convs")
    torch.backends.cudnn.benchmark = False
    t("eager fast attention + channels_last convs")
    best = min((k for k in rows if "fast" in k), key=rows.get)
    tune = {"cudnn_benchmark": "cudnn" in best, "conv_channels_last": "channels_last" in best}
    import json, os
    open(os.path.join(os.environ.get("OUT", "."), "tune.json"), "w").write(json.dumps(tune))
    print("best:", best, tune)
    write_result("encoder_profile", {"benchmark": "encoder profile (eager, B=96 x 20 s, bf16)", "env": env_record(),
                                     "times_ms": rows, "best": tune, "top_kernels": table})


if __name__ == "__main__":
    sys.exit(main())
