#!/usr/bin/env bash
# Remake the demo's recipe twins: each budget variant of demo/heal.toml (init's `budget_2p625` and
# `budget_2p3`) as its own mix of formats, one per (layer, routed role), made by llama.cpp's
# llama-quantize with an importance matrix from our own calibration dump, as init's peers.sh makes
# them. `moeheal recipe` runs the stages the allocation needs (dumps, guidance, sensitivity,
# allocate; cached in the demo's lake for `make heal`) and prints the llama-quantize command. Run
# from the repository root:  LLAMA_CPP_DIR=/path/to/llama.cpp/build bash demo/peers/make_twins.sh
# OUT names another folder for the files (to compare them with the committed ones).
set -euo pipefail
: "${LLAMA_CPP_DIR:?set LLAMA_CPP_DIR to a llama.cpp build folder holding bin/llama-quantize}"
config=demo/heal.toml
out=${OUT:-demo/peers}
imatrix=$(mktemp --suffix .gguf)
log=$(mktemp)
trap 'rm -f "$imatrix" "$log"' EXIT
.venv/bin/moeheal imatrix -c "$config" --out "$imatrix" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
# variant, file: budget_2p3's recipe is the one ablations/uniform-8k.toml's budget_2p3 chose, but its
# file there (budget_2p3_llama.gguf) was made with the earlier importance matrix of the routed
# experts alone, so this one takes its own name.
for pair in budget_2p625:budget_2p625_llama budget_2p3:budget_2p3_llama; do
  variant=${pair%%:*} file=${pair#*:}
  command=$(.venv/bin/moeheal recipe -c "$config" --variant "$variant" --imatrix "$imatrix" \
    --out "$out/$file.gguf" --llama-quantize "$LLAMA_CPP_DIR/bin/llama-quantize" 2>"$log") || { cat "$log" >&2; exit 1; }
  eval "$command 2" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  echo "$out/$file.gguf"
done
