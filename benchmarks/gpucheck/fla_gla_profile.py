"""flash-linear-attention's ``chunk_gla`` forward (B4 T4096 H16 K=V=128 bf16, the linear-attention issue's shape) for a
kernel-by-kernel profile under Nsight Compute, beside ours (``linear_profile.py gla``). fla autotunes on its first
calls, so they run outside the profiled range; one forward runs inside it (``torch.cuda.profiler``):

    PYTHONPATH=/tmp/ejk-site ncu --profile-from-start off --clock-control none \
        --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
        --csv python3 benchmarks/gpucheck/fla_gla_profile.py

Needs torch (in the GPU machine's image) and fla-core (installed by ``bash .ci/gpu setup``).
"""

from __future__ import annotations

import torch
from fla.ops.gla import chunk_gla

B, T, H, K, V = 4, 4096, 16, 128, 128


def main() -> None:
    torch.manual_seed(0)
    bf = torch.bfloat16
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=bf) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", dtype=bf)
    g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).to(bf)
    for _ in range(3):  # compile and autotune
        chunk_gla(q, k, v, g)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    chunk_gla(q, k, v, g)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
