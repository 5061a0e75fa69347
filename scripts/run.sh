#!/usr/bin/env bash
# The main job: set up, build, start ropeattn-server on its built-in defaults,
# run a short decoding session and an attention call against it with the
# reference CLI, print what happened, and stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh ropeattn-server ropeattn
BIN="${BUILD_DIR:-build}/bin"
TARGET=127.0.0.1:50051

echo "== starting ropeattn-server (gRPC ${TARGET}, metrics 127.0.0.1:9464)"
"$BIN/ropeattn-server" &
SERVER_PID=$!
trap 'kill -TERM "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT

for _ in $(seq 1 50); do
  "$BIN/ropeattn" health --target "$TARGET" >/dev/null 2>&1 && break
  sleep 0.1
done
"$BIN/ropeattn" health --target "$TARGET"
"$BIN/ropeattn" info --target "$TARGET"

echo
echo "== a decoding session: 512 tokens of context, then 16 single-token steps"
echo "   (32 query heads over 8 kv heads, head_dim 128, Llama 3 RoPE scaling)"
"$BIN/ropeattn" decode --target "$TARGET" --heads 32 --kv_heads 8 --head_dim 128 \
  --rope_type llama3 --rope_factor 8 --original_max_positions 8192 --theta 500000 \
  --context 512 --steps 16 --seed 1

echo
echo "== one Attend: causal, 64 tokens, 8 heads, head_dim 64, YaRN RoPE"
"$BIN/ropeattn" attend --target "$TARGET" --q_len 64 --k_len 64 --heads 8 --kv_heads 8 \
  --head_dim 64 --causal --rope_type yarn --rope_factor 4 --original_max_positions 32 --seed 2

echo
echo "== stopping the server"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || true
trap - EXIT
