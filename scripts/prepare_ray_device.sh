#!/usr/bin/env bash
# HERE (the CPU machine, repository root, PyPI reachable): the Ray wheels scripts/gpu_bench_ray.sh
# installs on the device machine (Python 3.12 there), in folders .git/info/exclude ignores.
# Ray's wheel alone (~77 MB) is larger than one device call may carry (64 MiB with the working
# tree), so it travels in two parts, cut with `split`:
#   .rayw1/  the first 48 MB of the ray wheel                              (call 1 carries it)
#   .rayw2/  the rest of the ray wheel + the wheels Ray needs that the device image lacks and
#            .whl (scripts/prepare_device_data.sh, the FastAPI stack) does not already hold  (call 2)
# The image's package list: /work/.library/device/KINDS.md ("Python packages already there");
# a wheel of a package already in the image or in .whl is left out (two versions of one package
# stop pip's install).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/device_prep.sh
ignore_here .rayw1 .rayw2
tmp=$(mktemp -d)
python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  -d "$tmp" "ray[data,serve]==2.60.0"
# packages of the device image (KINDS.md, 2026-11-17) and of .whl, normalised (lower case, '-');
# grpcio is not among them on purpose: the image's 1.84.0 is older than ray[serve]'s grpcio-reflection
# needs (>= 1.85.1: `from ray import serve` raised on the H200, 2026-12-02), so its wheel travels too
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama filelock frozenlist fsspec h11 httpcore httpx
huggingface-hub idna jinja2 markupsafe msgpack multidict numpy packaging pandas pillow pip propcache
protobuf psutil pyarrow pygments python-dateutil pyyaml requests rich setuptools six
typing-extensions urllib3 uvloop wheel wrapt yarl zipp prometheus-client tqdm"
have=" $(echo $image) "
if [ -d .whl ]; then
  for f in .whl/*.whl; do have="$have$(basename "$f" | cut -d- -f1 | tr '_A-Z' '-a-z') "; done
fi
rm -rf .rayw1 .rayw2 && mkdir -p .rayw1 .rayw2
for f in "$tmp"/*.whl; do
  n=$(basename "$f" | cut -d- -f1 | tr '_A-Z' '-a-z')
  case "$have" in *" $n "*) continue ;; esac
  if [ "$n" = ray ]; then
    split -b 48000000 -d "$f" ".rayw1/$(basename "$f").part-"
    mv .rayw1/*.part-0[1-9] .rayw2/
  else
    cp "$f" .rayw2/
  fi
done
rm -rf "$tmp"
du -sh .rayw1 .rayw2
