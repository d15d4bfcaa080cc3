"""Peers: other libraries' kernels for an op, timed beside ejkernel's on the same inputs.

A :class:`Peer` names the op it serves, builds a function of the op's arrays (``build(shape, inputs)``)
and says why it cannot run here (``unavailable()``: ``None`` when it can). Register one with
:func:`register`; ``ejkernel bench --peers`` picks by name. A peer whose result is not the op's own
(a dense matmul of the same FLOPs) gives its own float32 ``reference``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ejkernel.bench.cases import Inputs, Shape


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    op: str
    build: Callable[[Shape, Inputs], Callable[..., Any]]
    modules: tuple[str, ...] = ()  # imported first: a missing one skips the peer, naming it
    gpu_only: bool = False
    reference: Callable[[Shape, Inputs], Callable[..., Any]] | None = None

    def unavailable(self) -> str | None:
        if self.gpu_only and jax.default_backend() != "gpu":
            return f"needs a GPU (this is {jax.default_backend()})"
        for module in self.modules:
            if module == "tokamax":
                _stub_xprof()
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - any import failure skips the peer with its reason
                return f"{module} does not import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None


def _stub_xprof() -> None:
    """tokamax imports ``xprof.cli.tools`` at load time, for profiling only: an empty stand-in lets it import."""
    import sys
    import types

    try:
        importlib.import_module("xprof.cli.tools")
    except ImportError:

        def anything(attr: str) -> Any:  # any name tokamax imports (get_kernel_stats_tool, ...): a no-op
            if attr.startswith("__"):
                raise AttributeError(attr)
            return lambda *args, **kwargs: None

        parent = None
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            module = sys.modules.setdefault(name, types.ModuleType(name))
            module.__getattr__ = anything  # type: ignore[method-assign]
            if parent is not None:
                setattr(parent, name.rsplit(".", 1)[1], module)
            parent = module


PEERS: dict[tuple[str, str], Peer] = {}


def register(peer: Peer) -> Peer:
    if (peer.op, peer.name) in PEERS:
        raise ValueError(f"peer {peer.name!r} of {peer.op} is registered twice")
    PEERS[(peer.op, peer.name)] = peer
    return peer


def peers_of(op: str) -> list[Peer]:
    return [p for (o, _), p in PEERS.items() if o == op]


def _dpa(implementation: Literal["xla", "cudnn"]) -> Callable[[Shape, Inputs], Callable[..., Any]]:
    def build(s: Shape, inputs: Inputs) -> Callable[..., Any]:
        causal = bool(s["causal"])
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

    return build


def _pallas_triton_mha(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    from jax.experimental.pallas.ops.gpu import attention

    causal, scale = bool(s["causal"]), s["D"] ** -0.5
    return lambda q, k, v: attention.mha(q, k, v, segment_ids=None, sm_scale=scale, causal=causal)


def _tokamax_attention(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    import tokamax

    causal = bool(s["causal"])
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal)


def _dequantized(inputs: Inputs, q: Any, kc: Any, vc: Any) -> tuple[Any, Any]:
    """A float8 cache (bench shapes with ``fp8``) as a peer without float8 support reads it: scaled, in q's dtype."""
    if kc.dtype == q.dtype:
        return kc, vc
    ks, vs = inputs.kwargs["k_scale"], inputs.kwargs["v_scale"]
    return (kc.astype(jnp.float32) * ks).astype(q.dtype), (vc.astype(jnp.float32) * vs).astype(q.dtype)


def _gathered_pages(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    def fn(q: Any, kc: Any, vc: Any, lens: Any, tables: Any) -> Any:
        kc, vc = _dequantized(inputs, q, kc, vc)
        n, per_seq = tables.shape
        k = kc[tables].reshape(n, per_seq * kc.shape[1], *kc.shape[2:])
        v = vc[tables].reshape(n, per_seq * vc.shape[1], *vc.shape[2:])
        out = jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lens, implementation="xla")
        return out[:, 0]

    return fn


def _pallas_paged(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    from jax.experimental.pallas.ops.gpu import paged_attention

    def fn(q: Any, kc: Any, vc: Any, lens: Any, tables: Any) -> Any:
        kc, vc = _dequantized(inputs, q, kc, vc)
        k, v = jnp.moveaxis(kc, 2, 0), jnp.moveaxis(vc, 2, 0)  # [K, pages, page, D]
        return paged_attention.paged_attention(
            q * q.shape[-1] ** -0.5, k, v, tables, lens, k_splits=8, pages_per_compute_block=4
        )

    return fn


def _dense_ragged(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    def fn(q: Any, k: Any, v: Any, start: Any, end: Any) -> Any:
        k, v = _dequantized(inputs, q, k, v)
        pos = jnp.arange(k.shape[1])
        mask = (pos[None] >= start[:, None]) & (pos[None] < end[:, None])  # [B, S]
        out = jax.nn.dot_product_attention(q[:, None], k, v, mask=mask[:, None, None, :], implementation="xla")
        return out[:, 0]

    return fn


def _pallas_paged_ragged(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    from jax.experimental.pallas.ops.gpu import paged_attention

    page = 16

    def fn(q: Any, k: Any, v: Any, start: Any, end: Any) -> Any:
        k, v = _dequantized(inputs, q, k, v)
        b, length, kh, d = k.shape
        # The dense cache seen as pages of 16 (identity page table); paged_attention has no start, so start is 0.
        kp = jnp.moveaxis(k.reshape(b * length // page, page, kh, d), 2, 0)
        vp = jnp.moveaxis(v.reshape(b * length // page, page, kh, d), 2, 0)
        tables = jnp.arange(b * length // page, dtype=jnp.int32).reshape(b, length // page)
        return paged_attention.paged_attention(q * d**-0.5, kp, vp, tables, end, k_splits=8, pages_per_compute_block=4)

    return fn


def _triton_copy(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    """A copy of the key cache: it reads and writes the bytes the op reads of keys and values (the ceiling)."""
    from ejkernel_triton.copy import device_copy

    return lambda q, keys, *rest: device_copy(keys)


def _copy_reference(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    return lambda q, keys, *rest: keys.astype(jnp.float32)


def _copy_half_latent(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    """A copy of the first half of the latent cache: it reads and writes as many bytes as MLA decode reads."""
    from ejkernel_triton.copy import device_copy

    return lambda q, kv, *rest: device_copy(kv, size=kv.size // 2)


def _half_latent_reference(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    return lambda q, kv, *rest: kv.reshape(-1)[: kv.size // 2].astype(jnp.float32)


def _copy_state(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    """A copy of a decode step's float32 state (its last argument): the bytes the step reads and writes."""
    from ejkernel_triton.copy import device_copy

    return lambda *args: device_copy(args[-1])


def _state_reference(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    return lambda *args: args[-1]


def _ragged_dot(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    return lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes)


def _tokamax_ragged_dot(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    import tokamax

    return lambda lhs, rhs, sizes: tokamax.ragged_dot(lhs, rhs, sizes)


def _dense_matmul(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    return lambda lhs, rhs, sizes: lhs @ rhs[0]


def _dense_matmul_reference(s: Shape, inputs: Inputs) -> Callable[..., Any]:
    return lambda lhs, rhs, sizes: jnp.matmul(
        lhs.astype(jnp.float32), rhs[0].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )


PALLAS_GPU = "jax.experimental.pallas.ops.gpu"
for _peer in (
    Peer("cudnn", "flash_attention", _dpa("cudnn"), gpu_only=True),
    Peer("jax-xla", "flash_attention", _dpa("xla")),
    Peer("pallas-triton", "flash_attention", _pallas_triton_mha, (f"{PALLAS_GPU}.attention",), gpu_only=True),
    Peer("tokamax", "flash_attention", _tokamax_attention, ("tokamax",), gpu_only=True),
    Peer("gather-xla", "page_attention", _gathered_pages),
    Peer("pallas-triton-paged", "page_attention", _pallas_paged, (f"{PALLAS_GPU}.paged_attention",), gpu_only=True),
    Peer("triton-copy", "page_attention", _triton_copy, ("ejkernel_triton.copy",), True, _copy_reference),
    Peer("dense-xla", "ragged_decode_attention", _dense_ragged),
    Peer("triton-copy", "ragged_decode_attention", _triton_copy, ("ejkernel_triton.copy",), True, _copy_reference),
    Peer(
        "pallas-triton-paged",
        "ragged_decode_attention",
        _pallas_paged_ragged,
        (f"{PALLAS_GPU}.paged_attention",),
        gpu_only=True,
    ),
    Peer(
        "triton-copy",
        "multi_head_latent_attention",
        _copy_half_latent,
        ("ejkernel_triton.copy",),
        True,
        _half_latent_reference,
    ),
    Peer("triton-copy", "gla-decode", _copy_state, ("ejkernel_triton.copy",), True, _state_reference),
    Peer("triton-copy", "gated_delta_rule-decode", _copy_state, ("ejkernel_triton.copy",), True, _state_reference),
    Peer("lax-ragged_dot", "grouped_matmul", _ragged_dot),
    Peer("tokamax-ragged_dot", "grouped_matmul", _tokamax_ragged_dot, ("tokamax",), gpu_only=True),
    Peer("dense-matmul", "grouped_matmul", _dense_matmul, reference=_dense_matmul_reference),
):
    register(_peer)

# Torch peers run in a child process (ejkernel.bench.torch_child): their import is checked there.
TORCH_PEERS: dict[str, tuple[str, str]] = {  # op -> (peer name, module)
    "gla": ("fla-chunk_gla", "fla"),
    "gated_delta_rule": ("fla-chunk_gated_delta_rule", "fla"),
    "lightning_attn": ("fla-chunk_simple_gla", "fla"),
    "recurrent": ("fla-chunk_simple_gla", "fla"),
}
