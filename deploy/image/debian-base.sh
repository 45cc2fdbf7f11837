#!/bin/sh
# A Debian 12 (bookworm) base image built with debootstrap and imported into
# buildah's local storage, for building deploy/image/Containerfile where no
# image registry can be reached (CI: tests/test_image.py):
#
#   deploy/image/debian-base.sh localhost/textswap-base:bookworm [mirror]
#
# minbase + Python 3.11, its venv module, the CA certificates and tini: what
# the Containerfile needs from python:3.11-slim-bookworm. Needs root,
# debootstrap and buildah.
set -eu
tag=${1:?usage: debian-base.sh TAG [MIRROR]}
mirror=${2:-http://deb.debian.org/debian}
work=$(mktemp -d "${TMPDIR:-/var/tmp}/textswap-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase --include=python3.11,python3-venv,ca-certificates,tini \
    bookworm "$work/root" "$mirror" >"$work/log" 2>&1 || { tail -20 "$work/log" >&2; exit 1; }
# what a slim image leaves out: the downloaded packages, the package lists,
# documentation and translations
rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"* \
    "$work/root/usr/share/doc/"* "$work/root/usr/share/man/"* "$work/root/usr/share/locale/"*
ctr=$(buildah from scratch)
tar -C "$work/root" -cf "$work/root.tar" .
buildah add --quiet "$ctr" "$work/root.tar" / >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/sh "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
echo "$tag"
