"""Named shape sets: ``ejkernel bench OP --preset NAME`` (a preset also sets passes and dtype unless given)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Preset:
    op: str
    shapes: tuple[str, ...]
    passes: tuple[str, ...] = ("fwd", "fwd_bwd")
    dtype: str = "bfloat16"
    about: str = ""


def _both(*shapes: str) -> tuple[str, ...]:
    return tuple(f"{s},causal={c}" for s in shapes for c in (0, 1))


PRESETS: dict[str, Preset] = {
    # Was ejkernel-triton/benchmarks/flash_attention_gpu.py (its SHAPES) and the D=256 rows of BENCHMARKS.md.
    "flash-h200": Preset(
        "flash_attention",
        _both("B=2,H=16,T=8192,D=128", "B=2,H=16,T=2048,D=128", "B=2,H=16,T=8192,D=64", "B=2,H=16,T=8192,D=256"),
        about="flash attention at training sizes, causal and not",
    ),
    "flash-seqlen": Preset(
        "flash_attention",
        _both(*(f"B={max(1, 16384 // t)},H=16,T={t},D=128" for t in (1024, 2048, 4096, 8192, 16384))),
        about="flash attention against sequence length at ~fixed tokens per batch (for plots)",
    ),
    "serving-decode": Preset(
        "page_attention",
        (
            *(f"N=64,H=32,K=8,D=128,L={n},P=16" for n in (1024, 4096, 8192)),
            "N=64,H=32,K=8,D=128,L=4096,P=64",  # page size 64
            "N=64,H=32,K=1,D=128,L=4096,P=16",  # MQA
            "N=1,H=32,K=8,D=128,L=32768,P=16",  # one long sequence: split-K must fill the SMs
            "N=256,H=32,K=8,D=128,L=1024,P=16",  # a large batch of short ones
            "N=64,H=32,K=8,D=128,L=4096,P=16,fp8=1",  # a float8 (e4m3) cache: half the bytes
        ),
        passes=("fwd",),
        about="paged decode (the serving issue's shapes): 64 sequences H32 K8 D128 pages of 16, and variations",
    ),
    "ragged-decode": Preset(
        "ragged_decode_attention",
        tuple(f"B=64,H=32,K=8,D=128,L={n}" for n in (1024, 2048, 4096, 8192)),
        passes=("fwd",),
        about="decode over a dense cache with per-row ranges",
    ),
    "serving-mixed": Preset(
        "ragged_page_attention",
        (
            "N=48,F=4,Q=512,L=4096,H=32,K=8,D=128,P=16",  # the serving issue's mixed batch
            "N=0,F=4,Q=512,L=4096,H=32,K=8,D=128,P=16",  # its prefill rows alone
            "N=48,F=0,Q=0,L=4096,H=32,K=8,D=128,P=16",  # its decode rows alone
        ),
        passes=("fwd",),
        about="ragged paged attention: 48 decode rows plus 4 prefills of 512, all at 4096 context, and each part alone",
    ),
    "mla-decode": Preset(
        "multi_head_latent_attention",
        (
            "B=64,H=128,L=4096,D=512,R=64,P=64",  # DeepSeek-V3 dims (the serving issue's shape)
            "B=1,H=128,L=32768,D=512,R=64,P=64",
            "B=256,H=128,L=1024,D=512,R=64,P=64",
            "B=64,H=16,L=4096,D=512,R=64,P=64",  # 16 heads per device (tensor parallel 8)
        ),
        passes=("fwd",),
        about="multi-head latent attention decode over a paged bf16 latent cache, DeepSeek-V3 dims",
    ),
    "moe": Preset(
        "grouped_matmul",
        (
            "G=8,M=16384,K=4096,N=4096",
            "G=8,M=16384,K=4096,N=4096,zipf=1",  # Zipf-imbalanced routing, two experts empty
            "G=64,M=16384,K=4096,N=1024",
            "G=8,M=8192,K=4096,N=14336",  # Mixtral-like
            "G=256,M=32768,K=7168,N=2048",  # DeepSeek-V3-like: 4096 tokens routed to 8 of 256 experts
            "G=256,M=32768,K=7168,N=2048,zipf=1",
        ),
        about="mixture-of-experts grouped matmul: balanced and Zipf-imbalanced groups, Mixtral and DeepSeek-V3 shapes",
    ),
    "linear-attn": Preset(
        "gla", ("B=4,T=4096,H=16,K=128,V=128", "B=4,T=1024,H=16,K=128,V=128"), about="gated linear attention"
    ),
    "gated-delta": Preset(
        "gated_delta_rule",
        ("B=4,T=4096,H=16,K=128,V=128", "B=4,T=1024,H=16,K=128,V=128"),
        about="the gated delta rule",
    ),
    "linear-decode": Preset(
        "gla-decode",
        (
            "B=64,T=1,H=16,K=128,V=128",
            "B=64,T=4,H=16,K=128,V=128",
            "B=1,T=1,H=16,K=128,V=128",
            "B=256,T=1,H=16,K=128,V=128",
        ),
        passes=("fwd",),
        about="a gla decode step against a float32 state [B, H16, 128, 128] (the linear-attention issue's shape)",
    ),
    "delta-decode": Preset(
        "gated_delta_rule-decode",
        (
            "B=64,T=1,H=16,K=128,V=128",
            "B=64,T=4,H=16,K=128,V=128",
            "B=1,T=1,H=16,K=128,V=128",
            "B=256,T=1,H=16,K=128,V=128",
        ),
        passes=("fwd",),
        about="a gated delta rule decode step against a float32 state [B, H16, 128, 128]",
    ),
    "lightning-decode": Preset(
        "lightning_attn-decode",
        ("B=64,T=1,H=16,K=128,V=128", "B=1,T=1,H=16,K=128,V=128", "B=256,T=1,H=16,K=128,V=128"),
        passes=("fwd",),
        about="a lightning_attn decode step against a float32 state [B, H16, 128, 128]",
    ),
    # Were ejkernel-xla/benchmarks/flash_attention_cpu.py and linear_attention_cpu.py (their times; the memory
    # scaling is a test now, tests/xla/test_flash_attention_memory.py).
    "flash-cpu": Preset(
        "flash_attention",
        _both("B=1,H=8,T=2048,D=64", "B=1,H=8,T=8192,D=64"),
        passes=("fwd",),
        dtype="float32",
        about="the XLA blockwise kernel against dense XLA attention on a CPU",
    ),
    "linear-attn-cpu": Preset(
        "gla",
        ("B=1,T=4096,H=4,K=64,V=64",),
        dtype="float32",
        about="chunked gla on a CPU (the reference: step by step)",
    ),
    "tiny-cpu": Preset(
        "flash_attention", ("B=1,H=2,T=64,D=32", "B=1,H=2,T=128,D=32,causal=1"), ("fwd",), "float32", "CI smoke test"
    ),
}
