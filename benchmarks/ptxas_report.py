"""Registers, spills and shared memory of every Triton kernel of one chunked ``gla``, ``simple_gla`` (the scalar
decay of ``lightning_attn`` and ``recurrent``), ``value_gla`` (``recurrent``'s value gate), ``keyed_value_gla``
(``recurrent``'s key and value gates together) or ``gated_delta_rule`` forward + backward, as ptxas and Triton
report them for sm_90, on a machine without a GPU.

Each launch is compiled the way jax-triton would (``EJKERNEL_TRITON_COMPILE_ONLY=90``, see
``ejkernel_triton.launch``) and its PTX is assembled again by the ptxas that Triton itself uses, with ``-v``.
Spills cost time on the GPU that the interpreter never shows: check a new default plan here before timing it.
Shared memory is Triton's ``metadata.shared`` (bytes per block); a kernel above sm_90's 232448 (227 KiB) fails at
launch on the GPU, so it is marked ``OVER`` here (and the report goes on, rather than stopping at the first, as
``ejkernel_triton.launch``'s compile-only check would).

    .venv/bin/python benchmarks/ptxas_report.py gla --dtype float32 --bwd block_v=32
    .venv/bin/python benchmarks/ptxas_report.py gated_delta_rule --fwd chunk_size=32 --bwd num_stages=2
    .venv/bin/python benchmarks/ptxas_report.py simple_gla --fwd block_v=128 --bwd num_warps=8

Shapes: B4 T4096 H16 K=V=128 (``--dims K,V`` to change the head dims).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ["EJKERNEL_TRITON_COMPILE_ONLY"] = "90"
os.environ.pop("EJKERNEL_TRITON_INTERPRET", None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import triton  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

_TILES = ("BT", "BK", "BKC", "BV")


def _fields(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name] = int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", choices=["gla", "simple_gla", "value_gla", "keyed_value_gla", "gated_delta_rule"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--dims", default="128,128", help="K,V")
    ap.add_argument("--fwd", nargs="*", default=[], help="ChunkFwdParams fields, name=value")
    ap.add_argument("--bwd", nargs="*", default=[], help="ChunkBwdParams fields, name=value")
    a = ap.parse_args()

    from ejkernel_triton import _simple_chunk as simple
    from ejkernel_triton import _value_chunk as value
    from ejkernel_triton import launch
    from ejkernel_triton.gated_delta_rule import chunk as gdr
    from ejkernel_triton.gla import chunk as gla

    ptxas = get_ptxas(90).path
    real = triton.compile
    limit = launch.shared_memory_per_block(90)
    launch.shared_memory_per_block = lambda _: 1 << 62  # report every kernel, then judge
    over = []

    def report(src, target=None, options=None):
        compiled = real(src, target=target, options=options)
        with tempfile.TemporaryDirectory() as d:
            with open(f"{d}/k.ptx", "w") as f:
                f.write(compiled.asm["ptx"])
            log = subprocess.run(
                [ptxas, "-v", "-arch=sm_90a", f"{d}/k.ptx", "-o", f"{d}/k.o"], capture_output=True, text=True
            ).stderr
        regs = re.findall(r"Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        if not regs:
            raise RuntimeError(f"ptxas said:\n{log}")
        shared = int(compiled.metadata.shared)
        names = src.fn.arg_names
        tiles = " ".join(f"{names[i[0]]}={v}" for i, v in src.constants.items() if names[i[0]] in _TILES)
        if shared > limit:
            over.append(src.fn.__name__)
        print(
            f"{src.fn.__name__:24s} {tiles:22s} warps {options.get('num_warps')} stages {options.get('num_stages')}: "
            f"{regs[0]:>3s} registers, {spills[0] if spills else '?':>5s} bytes spilled, "
            f"{shared:>6d} bytes shared{' OVER' if shared > limit else ''}",
            flush=True,
        )
        return compiled

    triton.compile = report
    dk, dv = (int(x) for x in a.dims.split(","))
    dt = jnp.dtype(a.dtype)
    z = lambda *shape, d=dt: jnp.zeros(shape, d)  # noqa: E731
    fp, bp = gla.ChunkFwdParams(**_fields(a.fwd)), gla.ChunkBwdParams(**_fields(a.bwd))
    b, t, h = 4, 4096, 16
    if a.op == "gla":
        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, h, dv), z(b, t, h, dk, d=jnp.float32))
        fn = lambda *x: gla.gla(*x, fwd_params=fp, bwd_params=bp)[0]  # noqa: E731
    elif a.op == "simple_gla":  # the final state returned: the forward's state pass at float32 accuracy
        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, h, dv), z(b, t, h, d=jnp.float32))
        fn = lambda *x: simple.simple_gla(*x, output_final_state=True, fwd_params=fp, bwd_params=bp)  # noqa: E731
    elif a.op == "value_gla":
        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, h, dv), z(b, t, h, dv, d=jnp.float32))
        fn = lambda *x: value.value_gla(*x, output_final_state=True, fwd_params=fp, bwd_params=bp)  # noqa: E731
    elif a.op == "keyed_value_gla":  # recurrent with a key and a value gate: both sides' log decays side by side
        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, h, dv), z(b, t, h, dk + dv, d=jnp.float32))
        fn = lambda *x: value.keyed_value_gla(*x, output_final_state=True, fwd_params=fp, bwd_params=bp)  # noqa: E731
    else:
        f32 = jnp.float32
        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, h, dv), z(b, t, h, d=f32), z(b, t, h, d=f32))
        fn = lambda *x: gdr.gated_delta_rule(*x, use_qk_l2norm=True, fwd_params=fp, bwd_params=bp)[0]  # noqa: E731
    print(f"{a.op} {a.dtype} K={dk} V={dv}, sm_90 ({ptxas})")
    out, vjp = jax.vjp(fn, *args)
    vjp(out)
    print(f"shared memory: {'over ' + str(limit) + ' in ' + ', '.join(over) if over else 'every kernel fits'}")


if __name__ == "__main__":
    main()
