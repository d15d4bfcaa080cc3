#!/usr/bin/env bash
# The pending GPU check of the staged chunked-kernel changes (Plan.decayed_keys: gla's forward walk reads decayed
# keys; Plan.paired_states: the backward's two state walks in one launch) and of chunk_dqk_inter's stores before
# its cumulative sums, one device call of at most 9 minutes and a setup: both staged plans checked exactly and timed
# against today's launches (gla_state_pair.py), the conformance GPU tier of the chunked kernels with both forced
# (force_staged.py), then gla's check against the reference and each Triton launch of its forward + backward timed
# at B2 T16384 with both (gla_chunk.py --kernels). Run in the repository root on the GPU machine, .whl/ carried:
# bash benchmarks/gpucheck/pair_run.sh (logs under $OUT).
source "$(dirname "$0")/_gpu_env.sh"
( cd benchmarks/gpucheck && timeout 230 python3 gla_state_pair.py ) > "$OUT/pair.log" 2>&1
tail -n 60 "$OUT/pair.log"
PYTHONPATH=/tmp/ejk-site:benchmarks/gpucheck timeout 170 python3 -m pytest -v -p no:cacheprovider -p no:benchmark \
  -o addopts= -rfs --ejkernel-tier=gpu -p force_staged -n 8 --ejkernel-platform=triton_chunk \
  tests/conformance/test_gla.py tests/conformance/test_lightning_attn.py tests/conformance/test_recurrent.py \
  > "$OUT/conformance-pair.log" 2>&1
tail -n 30 "$OUT/conformance-pair.log"
PYTHONPATH=/tmp/ejk-site:benchmarks/gpucheck timeout 150 python3 -c "import force_staged, runpy, sys
sys.argv = ['gla_chunk.py', '--shape', '2,16384', '--kernels']
runpy.run_path('benchmarks/gpucheck/gla_chunk.py', run_name='__main__')" > "$OUT/gla-chunk-staged.log" 2>&1
tail -n 40 "$OUT/gla-chunk-staged.log"
