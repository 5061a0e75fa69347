#!/usr/bin/env bash
# Sets up, builds, and runs every test (CI runs exactly this).
#   bash scripts/test.sh            the fuzz step, then all tests
#   LABEL=core bash scripts/test.sh only tests with that ctest label (no fuzz step)
#   LABEL=fuzz bash scripts/test.sh only the fuzz step
# The fuzz step (scripts/fuzz.sh, README "Fuzzing") builds the libFuzzer
# targets into FUZZ_BUILD_DIR (default build-fuzz) and runs each briefly on
# its seed corpus; any crash fails the script. It runs before ctest so that
# ctest's summary closes the output.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${LABEL:-}" ] || [ "${LABEL}" = fuzz ]; then
  bash scripts/fuzz.sh
fi
if [ "${LABEL:-}" = fuzz ]; then exit 0; fi
bash scripts/build.sh
args=(--test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" --timeout 600)
if [ -n "${LABEL:-}" ]; then args+=(-L "$LABEL"); fi
ctest "${args[@]}"
