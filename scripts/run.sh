#!/usr/bin/env bash
# Sets up, builds, and runs the main job: for now the core demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh ropeattn-demo
exec "${BUILD_DIR:-build}/bin/ropeattn-demo" "$@"
