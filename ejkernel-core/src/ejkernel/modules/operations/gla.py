"""The ``gla`` contract (gated linear attention, Yang et al. 2024).

Shapes: B batch, T length, H query/key heads, HV value heads (a multiple of H; HV == H is plain
multi-head), K query/key head dim, V value head dim, N packed sequences.

Grouped value heads: value head ``hv`` reads query/key head ``hv // (HV // H)`` (the grouping of GQA in
flash attention: consecutive value heads share a query/key head). The gate ``g``, the state and the output
follow the value heads: every value head has its own gate and state.

For every batch row (or packed sequence) and value head, with a state ``S`` of shape ``[K, V]`` that starts
at ``initial_state`` (zeros when absent), token by token (``q_t``, ``k_t`` of the value head's query/key head):

1. ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``: every key channel ``i`` of the state decays by
   ``exp(g_t[i])``, then the outer product of the key and the value is added;
2. ``o_t = scale * q_t S_t`` (the current token included; ``scale`` defaults to ``K ** -0.5``).

This is the convention of flash-linear-attention's ``chunk_gla``. ``g`` is the log of the decay, so
``g <= 0`` (for instance ``log_sigmoid(x) / 16``); values above 0 are not checked but are outside the
contract (implementations may overflow). Everything is computed in float32; the output has ``q``'s
dtype and the final state ``S_T`` is float32. ``g`` and ``initial_state`` may have any float dtype. Every
array argument is differentiable (the gradient of ``g`` included).

With ``cu_seqlens`` (B == 1) the sequences ``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T:
each starts from ``initial_state[n]`` (``[N, HV, K, V]``) and its final state is ``final_state[n]``. A
sequence of length 0 outputs nothing and its final state is its initial state; tokens outside
``[cu_seqlens[0], cu_seqlens[N])`` give zeros. ``cu_seqlens`` must be non-decreasing within ``[0, T]``:
checked when concrete (``ValueError``); under ``jit`` it is traced and unchecked unless ``EJKERNEL_CHECKS=1``
(then the call fails when it runs), and a violation gives wrong outputs without an error.

Returns ``(o, final_state)``: ``o`` ``[B, T, HV, V]``, ``final_state`` ``[B or N, HV, K, V]`` when
``output_final_state`` else ``None``.

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures._checks import ArrayIn
from ejkernel.kernels.signatures._linear_attention import check_gate, check_grouped_qkv, check_state_options
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import linear_attention_zeros
from ejkernel.modules.operations._linear_attention import normalize_scale, timing_inputs
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import GLAConfig
from ejkernel.ops import Invocation, Kernel


def validate(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    **_: Any,
) -> None:
    """Check a ``gla`` call; raise an error naming the argument, what was expected and what came."""
    b, t, _heads, hv, dk, dv = check_grouped_qkv("gla", q, k, v)
    check_gate("gla", "g", g, (b, t, hv, dk), "[B, T, HV, K]")
    check_state_options(
        "gla",
        (b, t, hv, dk, dv),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        heads="HV",
    )


class GLA(Kernel[GLAConfig]):
    op_id = "gla"
    config_type = GLAConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return normalize_scale(arguments)

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        return timing_inputs(super().make_inputs(inv, seed), inv, ("g",))

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return linear_attention_zeros(arguments)


_kernel = GLA()


@checked
def gla(
    q: Float[ArrayIn, "B T H K"],
    k: Float[ArrayIn, "B T H K"],
    v: Float[ArrayIn, "B T HV V"],
    g: Float[ArrayIn, "B T HV K"],
    *,
    scale: float | None = None,
    initial_state: Float[ArrayIn, "B_or_N HV K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Int[ArrayIn, "N1"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: GLAConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B_or_N HV K V"] | None]:
    """Gated linear attention: a ``[K, V]`` state per value head, decayed per key channel and fed ``k_t^T v_t``.

    Shapes: B batch, T length, H query/key heads, HV value heads (a multiple of H; value head ``hv`` reads
    query/key head ``hv // (HV // H)``), K query/key head dim, V value head dim, N packed sequences. Per
    value head, token by token (flash-linear-attention's ``chunk_gla`` convention)::

        S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, HV, V]``; ``HV == H`` is plain multi-head, more value heads share query/key heads.
        g: log decay of every key channel ``[B, T, HV, K]`` (per value head), ``<= 0`` (e.g.
            ``log_sigmoid(x) / 16``); any float dtype, differentiable.
        scale: multiplies ``q``, default ``K ** -0.5``.
        initial_state: the state before the first token, ``[B, HV, K, V]`` (``[N, HV, K, V]`` with
            ``cu_seqlens``); default zeros; differentiable.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N+1]`` offsets of sequences packed along T (B must be 1); each starts from its own
            initial state; tokens outside every sequence give zeros.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``GLAConfig`` that overrides the config chain (never cached); ``fwd_params.q_blocksize``
            and ``bwd_params.q_blocksize`` are the chunk lengths of the XLA implementation.
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in ``q.dtype``; ``final_state`` ``[B or N, HV, K, V]``
        in float32 when ``output_final_state``, else ``None``.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import gla
    >>> kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    >>> q, k = jax.random.normal(kq, (2, 256, 4, 64)), jax.random.normal(kk, (2, 256, 4, 64))
    >>> v = jax.random.normal(kv, (2, 256, 4, 32))
    >>> g = jax.nn.log_sigmoid(jax.random.normal(kg, (2, 256, 4, 64))) / 16
    >>> o, state = gla(q, k, v, g, output_final_state=True)
    >>> o.shape, state.shape, state.dtype
    ((2, 256, 4, 32), (2, 4, 64, 32), dtype('float32'))

    Grouped value heads: 8 value heads over the 4 query/key heads (value heads 0 and 1 read head 0, ...):

    >>> v8 = jax.random.normal(kv, (2, 256, 8, 32))
    >>> g8 = jax.nn.log_sigmoid(jax.random.normal(kg, (2, 256, 8, 64))) / 16
    >>> o, state = gla(q, k, v8, g8, output_final_state=True)
    >>> o.shape, state.shape
    ((2, 256, 8, 32), (2, 8, 64, 32))
    """
    arrays = {
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }
    options = {"scale": scale, "output_final_state": output_final_state}
    return dispatch(
        _kernel,
        arrays,
        options,
        platform=platform,
        backend=backend,
        cfg=cfg,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )
