#!/usr/bin/env bash
# Sourced by the scripts' `prepare` steps (HERE, PyPI reachable):
#   ignore_here PATH...            adds /PATH/ to this checkout's git exclude file (a worktree's too:
#                                  its .git is a file), once
#   device_wheels DIR PACKAGE...   downloads into DIR the wheels of PACKAGE... for the device's CPython 3.12
#                                  (manylinux x86_64), pinned to the versions installed here; a package not
#                                  installed here is left out, with a line saying so.
device_wheels() {
  local dir=$1; shift
  local pins=() p v
  for p in "$@"; do
    v=$(python -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$v" ] && pins+=("$p==$v") || echo "not installed here, left out: $p"
  done
  mkdir -p "$dir"
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir" "${pins[@]}"
}

ignore_here() {
  local f d
  f=$(git rev-parse --git-path info/exclude) || return 1
  mkdir -p "$(dirname "$f")"
  for d in "$@"; do grep -qxF "/$d/" "$f" 2>/dev/null || echo "/$d/" >> "$f"; done
}
