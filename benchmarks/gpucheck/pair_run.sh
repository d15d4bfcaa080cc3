#!/usr/bin/env bash
# The pending GPU check of the staged chunked-kernel changes (Plan.decayed_keys: gla's forward walk reads decayed
# keys; Plan.paired_states: the backward's two state walks in one launch), one device call of about 8 minutes (the
# steps' timeouts add up past the 10-minute limit only if several hang): both checked exactly and timed against
# today's launches (gla_state_pair.py), the conformance GPU tier of the chunked kernels with both forced
# (force_staged.py), recurrent at B2 T16384, and a kernel-by-kernel Nsight Compute profile of gla's
# forward+backward at B2 T16384 with both. Run in the repository root on the GPU machine, .whl/ carried:
# bash benchmarks/gpucheck/pair_run.sh (logs under $OUT).
source "$(dirname "$0")/_gpu_env.sh"
( cd benchmarks/gpucheck && timeout 270 python3 gla_state_pair.py ) > "$OUT/pair.log" 2>&1
tail -n 60 "$OUT/pair.log"
PYTHONPATH=/tmp/ejk-site:benchmarks/gpucheck timeout 200 python3 -m pytest -v -p no:cacheprovider -p no:benchmark \
  -o addopts= -rfs --ejkernel-tier=gpu -p force_staged -n 8 --ejkernel-platform=triton_chunk \
  tests/conformance/test_gla.py tests/conformance/test_lightning_attn.py tests/conformance/test_recurrent.py \
  > "$OUT/conformance-pair.log" 2>&1
tail -n 30 "$OUT/conformance-pair.log"
timeout 90 python3 -m ejkernel bench recurrent --shapes B=2,T=16384,H=16,K=128,V=128 --impls default --passes fwd \
  --out "$OUT/recurrent" 2>&1 | tail -20
PYTHONPATH=/tmp/ejk-site:benchmarks/gpucheck timeout 110 ncu --clock-control none \
  --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
  -k regex:'chunk_|delta_|value_' --csv python3 -c "import force_staged, runpy, sys
sys.argv = ['linear_profile.py', 'gla', '--shape', '2,16384']
runpy.run_path('benchmarks/gpucheck/linear_profile.py', run_name='__main__')" > "$OUT/ncu-gla-pair.csv" 2>&1
python3 benchmarks/gpucheck/ncu_summary.py "$OUT/ncu-gla-pair.csv" | tail -40
