#!/usr/bin/env bash
# Remake the llama.cpp peers of the demo: an importance matrix from our own calibration dump
# (`moeheal imatrix`), then llama-quantize once per format on the routed experts, every other
# tensor as in our healed variants (IQ4_NL shared down projection, the rest Q8_0 as in the
# reference). Run from the repository root after the demo model or its calibration settings
# change:  LLAMA_CPP_DIR=/path/to/llama.cpp/build bash demo/peers/make_peers.sh
# CONFIG picks another config's calibration dump, FORMATS the formats, SUFFIX names the files
# (demo/ablations/autoround-data.toml: CONFIG=demo/ablations/autoround-data.toml FORMATS=q2_k SUFFIX=_65k).
set -euo pipefail
: "${LLAMA_CPP_DIR:?set LLAMA_CPP_DIR to a llama.cpp build folder holding bin/llama-quantize}"
config=${CONFIG:-demo/heal.toml}
imatrix=$(mktemp --suffix .gguf)
log=$(mktemp)
trap 'rm -f "$imatrix" "$log"' EXIT
.venv/bin/moeheal imatrix -c "$config" --out "$imatrix" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
for format in ${FORMATS:-iq2_xxs iq2_xs q2_k iq3_xxs}; do
  "$LLAMA_CPP_DIR/bin/llama-quantize" --allow-requantize --imatrix "$imatrix" \
    --tensor-type ffn_gate_exps="$format" --tensor-type ffn_up_exps="$format" \
    --tensor-type ffn_down_exps="$format" --tensor-type ffn_down_shexp=iq4_nl \
    demo/model/demo-q8_0.gguf "demo/peers/${format}_imatrix${SUFFIX:-}.gguf" Q8_0 2 >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  echo "demo/peers/${format}_imatrix${SUFFIX:-}.gguf"
done
