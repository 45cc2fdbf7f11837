#!/bin/sh
# The image as tests/test_image.py checks it: the base (built here unless
# BASE names one), then `make image` with buildah on it, its pip reading the
# wheels of the hashed lock downloaded beforehand (the Containerfile alone
# installs from PyPI). Writes OUT/log, OUT/times (seconds per step) and, last,
# OUT/rc, so that .ci/run can start it beside the test suite and the test
# waits for OUT/rc:
#
#   deploy/image/ci-build.sh OUT [BASE]
#
# Needs root, debootstrap and buildah.
set -u
out=${1:?usage: ci-build.sh OUT [BASE]}
base=${2:-}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
: >"$out/times"
export BUILDAH_ISOLATION=chroot
step() {  # step NAME CMD...: run, log, time; a failure ends the build
    name=$1; shift
    t0=$(date +%s)
    if ! "$@" >>"$out/log" 2>&1; then echo "$name failed" >>"$out/log"; echo 1 >"$out/rc"; exit 1; fi
    echo "$name $(( $(date +%s) - t0 ))" >>"$out/times"
}
if [ -z "$base" ] || ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    base=localhost/textswap-base:bookworm
    step base deploy/image/debian-base.sh "$base"
fi
echo "$base" >"$out/base"
python=${PYTHON:-.venv/bin/python}
step wheels "$python" -m pip download --quiet --require-hashes -r requirements.txt -d "$out/wheels"
step image make image IMAGE_BUILDER=buildah "BASE=$base" \
    "IMAGE_ARGS=--layers=false --volume $out/wheels:/wheels:ro --build-arg PIP_FIND_LINKS=/wheels --build-arg PIP_NO_INDEX=1"
rm -rf "$out/wheels"
echo 0 >"$out/rc"
