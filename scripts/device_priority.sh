export PYTHONUNBUFFERED=1 PYTHONPATH=src:bench
echo '{"cudnn_benchmark": true, "conv_channels_last": true}' > /tmp/tune.json
FLASHASR_TUNE=/tmp/tune.json timeout 200 python3 -W ignore bench/bench_gpu_e2e.py --runs 5 --variants pipelined_prio,pipelined,pipelined_fit --name e2e_priority 2>&1 | grep -v Warning | tail -5
