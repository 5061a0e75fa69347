#!/usr/bin/env bash
# Sets up, builds, and runs every test (CI runs exactly this).
#   bash scripts/test.sh            all tests
#   LABEL=core bash scripts/test.sh only tests with that ctest label
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
args=(--test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" --timeout 600)
if [ -n "${LABEL:-}" ]; then args+=(-L "$LABEL"); fi
ctest "${args[@]}"
