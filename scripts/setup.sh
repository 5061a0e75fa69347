#!/usr/bin/env bash
# Installs every Debian 12 package ropeattn needs to build, test and run.
# Idempotent and quiet when everything is already there.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libabsl-dev libdnnl-dev ocl-icd-opencl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libmicrohttpd-dev nlohmann-json3-dev libyaml-cpp-dev
  # The server's structured log (JSON lines): spdlog, with fmt.
  libspdlog-dev libfmt-dev
  # TLS: the server checks that a certificate and its key belong together
  # (libcrypto); tests make their certificates with the openssl command.
  libssl-dev openssl
  # The Python client (client/python) and its test: grpcio, protobuf, numpy.
  python3 python3-grpcio python3-protobuf python3-numpy python3-venv
  # Fuzzing (scripts/fuzz.sh): clang, its libFuzzer / ASan / UBSan runtimes,
  # and its OpenMP runtime.
  clang-14 libclang-rt-14-dev libomp-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
