"""flash-linear-attention's ``chunk_gla`` or ``chunk_gated_delta_rule`` forward (default B4 T4096 H16 K=V=128 bf16, the
linear-attention issue's shape; ``--shape B,T`` for others) for a kernel-by-kernel profile under Nsight Compute,
beside ours (``linear_profile.py``). fla autotunes on its first calls, so they run outside the profiled range; one
forward (with ``--bwd``, one forward+backward) runs inside it (``torch.cuda.profiler``):

    PYTHONPATH=/tmp/ejk-site ncu --profile-from-start off --clock-control none \
        --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
        --csv python3 benchmarks/gpucheck/fla_profile.py [gla|gdr] [--shape B,T] [--bwd]

Needs torch (in the GPU machine's image) and fla-core (installed by ``bash .ci/gpu setup``).
"""

from __future__ import annotations

import sys

import torch

B, T, H, K, V = 4, 4096, 16, 128, 128
if "--shape" in sys.argv:  # B,T
    B, T = (int(x) for x in sys.argv.pop(sys.argv.index("--shape") + 1).split(","))
BWD = "--bwd" in sys.argv
OPS = [a for a in sys.argv[1:] if not a.startswith("--")] or ["gla"]
if len(OPS) != 1 or OPS[0] not in ("gla", "gdr"):
    sys.exit(f"fla_profile.py: expected one op, gla or gdr, got {OPS}")


def main() -> None:
    op = OPS[0]
    torch.manual_seed(0)
    bf = torch.bfloat16
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=bf, requires_grad=BWD) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", dtype=bf, requires_grad=BWD)
    do = torch.randn(B, T, H, V, device="cuda", dtype=bf)
    if op == "gla":
        from fla.ops.gla import chunk_gla

        g = (torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).to(bf).requires_grad_(BWD)

        def fwd():
            return chunk_gla(q, k, v, g)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda") + 3).requires_grad_(BWD)
        beta = torch.sigmoid(torch.randn(B, T, H, device="cuda")).requires_grad_(BWD)

        def fwd():
            return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

    def run():
        out = fwd()[0]
        if BWD:
            out.backward(do)

    for _ in range(3):  # compile and autotune
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
