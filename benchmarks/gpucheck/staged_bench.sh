#!/usr/bin/env bash
# The second GPU call after pair_run.sh: gla at B2 T16384 against flash-linear-attention (forward and
# forward+backward; fla autotunes for 150+ s in its child process), then recurrent's forward+backward there (no peer)
# and the both-gates path, with the staged plans forced (force_staged.py: the same as the defaults once they are
# made so; the same warm machine's site then needs no new setup). Run in the repository root on the GPU machine,
# .whl/ carried: bash benchmarks/gpucheck/staged_bench.sh (results under $OUT).
source "$(dirname "$0")/_gpu_env.sh"
ejkernel=(python3 benchmarks/gpucheck/force_staged.py)
timeout 400 "${ejkernel[@]}" bench gla --shapes B=2,T=16384,H=16,K=128,V=128 --impls default \
  --passes fwd,fwd_bwd --out "$OUT/gla" 2>&1 | tail -20
timeout 60 "${ejkernel[@]}" bench recurrent --shapes B=2,T=16384,H=16,K=128,V=128 --impls default --peers none \
  --passes fwd_bwd --out "$OUT/recurrent" 2>&1 | tail -12
timeout 90 "${ejkernel[@]}" bench recurrent --shapes B=4,T=4096,H=16,K=128,V=128,gk=1,gv=1 --impls default,xla \
  --peers none --passes fwd,fwd_bwd --out "$OUT/recurrent-gates" 2>&1 | tail -12
