#!/usr/bin/env bash
# Rebuild the editable install's build tree under a lock, so that several developers (or
# helpers) working in one checkout never run two ninja builds in the same folder at once.
# The first run creates the editable install (pip install --no-build-isolation -e .);
# later runs rebuild build/cp3XX with ninja, which also picks up meson.build changes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec 9>/tmp/remote_accel-build.lock
flock 9
builddir=$(ls -d build/cp3* 2>/dev/null | head -n1 || true)
if [[ -z $builddir ]] || ! python3 -c 'import remote_accel' 2>/dev/null; then
  exec python3 -m pip install -q --no-build-isolation -e .
fi
exec ninja -C "$builddir" "$@"
