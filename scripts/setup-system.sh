#!/usr/bin/env bash
# Installs the host packages corral needs on Debian bookworm (run as root).
# Idempotent: only missing packages are installed, so repeated `make` calls are cheap.
set -euo pipefail
PKGS=(runc runsc fuse3 libfuse3-dev erofs-utils busybox-static docker.io debootstrap iproute2 util-linux gcc libc6-dev procps
      qemu-system-x86 linux-image-amd64)  # the last two: the microvm substrate (QEMU, and its guest kernel)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then echo "corral setup: need root to install: ${missing[*]}" >&2; exit 1; fi
  echo "corral setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
