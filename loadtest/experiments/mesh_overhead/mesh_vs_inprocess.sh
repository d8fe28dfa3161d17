#!/bin/bash
# The mesh at concurrency 64 against the engine in process, back to back (issue 10's 0.85 target).
#   loadtest/experiments/mesh_overhead/mesh_vs_inprocess.sh MODEL_DIR TAG   -> /tmp/c64_TAG_inproc.json, /tmp/c64_TAG_mesh.json
# MODEL_DIR: a checkpoint with a tokenizer whose vocabulary matches the model (loadtest/results/README.md
# says how the CPU figures' one was built). Run it from the repository root after `make venv`.
set -u
MODEL=$1
TAG=$2
export PYTHONPATH=$PWD
PY=$PWD/.venv/bin/python
$PY -m loadtest.cli bench offline --model "$MODEL" --skip-hf --num-prompts 128 --threads 2 \
    --json /tmp/c64_${TAG}_inproc.json > /tmp/c64_${TAG}_inproc.log 2>&1
WORK=$(mktemp -d)
(cd "$WORK" && setsid "$PY" -m shared.cli up --model "$MODEL" --prefill 1 --decode 1 --port 8011 \
    --kvstore-disk-dir none > /tmp/c64_${TAG}_up.log 2>&1 & echo $! > "$WORK/pid")
for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8011/v1/models > /dev/null && break; sleep 1; done
sleep 3
$PY -m loadtest.cli bench serve --base-url http://127.0.0.1:8011 --model "$(basename "$MODEL")" --dataset random \
    --input-len 32:512 --output-len 32:256 --num-prompts 128 --max-concurrency 64 --prompt-kind ids \
    --vocab-size 8192 --json /tmp/c64_${TAG}_mesh.json > /tmp/c64_${TAG}_mesh.log 2>&1
kill -INT -- -"$(cat "$WORK/pid")" 2> /dev/null; sleep 8; kill -9 -- -"$(cat "$WORK/pid")" 2> /dev/null
rm -rf "$WORK"
grep -h "kvmesh .*tok/s" /tmp/c64_${TAG}_inproc.log
grep -h "Output token throughput" /tmp/c64_${TAG}_mesh.log
