#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, README "Fuzzing") with clang-14,
# ASan and UBSan into their own build directory, then runs each target on its
# seed corpus (tests/fuzz/corpus/<target>/) and fails on the first crash,
# sanitizer report, broken invariant, leak, timeout or out-of-memory.
#   bash scripts/fuzz.sh                     every target, briefly (what CI runs)
#   bash scripts/fuzz.sh decode_fuzz 600     one target for 600 s
# Knobs: FUZZ_BUILD_DIR (default build-fuzz), JOBS (default nproc),
# FUZZ_SECONDS / FUZZ_RUNS (per target, whichever ends first; default 10 s,
# 100000 runs). New inputs go to a scratch directory, never into the tree; a
# crashing input is kept under $FUZZ_BUILD_DIR/fuzz-artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_BUILD_DIR="${FUZZ_BUILD_DIR:-build-fuzz}"
JOBS="${JOBS:-$(nproc)}"
seconds="${FUZZ_SECONDS:-10}"
runs="${FUZZ_RUNS:-100000}"
if [ $# -ge 1 ]; then
  targets=("$1")
  if [ $# -ge 2 ]; then seconds="$2"; runs=-1; fi
else
  targets=()
  for src in tests/fuzz/*_fuzz.cc; do targets+=("$(basename "$src" .cc)"); done
fi

if [ ! -f "$FUZZ_BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$FUZZ_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROPEATTN_FUZZ=ON \
    -DCMAKE_CXX_COMPILER=clang++-14 >/dev/null
fi
cmake --build "$FUZZ_BUILD_DIR" -j "$JOBS" --target "${targets[@]}"

artifacts="$FUZZ_BUILD_DIR/fuzz-artifacts"
mkdir -p "$artifacts"
passed=0
failed=0
for t in "${targets[@]}"; do
  scratch="$(mktemp -d)"
  mkdir -p "$scratch/corpus"
  extra=()
  # The decode target's inputs carry many features each; libFuzzer's entropic
  # scheduler then spends half the time on bookkeeping.
  if [ "$t" = decode_fuzz ]; then extra+=(-entropic=0); fi
  log="$scratch/log"
  echo "== fuzz: $t (${seconds} s or ${runs} runs)"
  if "$FUZZ_BUILD_DIR/bin/$t" -runs="$runs" -max_total_time="$seconds" -timeout=25 \
      -rss_limit_mb=4096 -malloc_limit_mb=1024 -print_final_stats=1 \
      -artifact_prefix="$artifacts/$t-" "${extra[@]}" "$scratch/corpus" "tests/fuzz/corpus/$t" \
      >"$log" 2>&1 < /dev/null; then
    grep -E "^#[0-9]+[[:space:]]+DONE" "$log" | tail -1 || true
    passed=$((passed + 1))
  else
    tail -n 60 "$log"
    echo "== fuzz: $t FAILED; the input is in $artifacts/ (rerun: $FUZZ_BUILD_DIR/bin/$t FILE)"
    failed=$((failed + 1))
  fi
  rm -rf "$scratch"
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
