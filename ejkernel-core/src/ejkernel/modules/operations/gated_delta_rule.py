"""The ``gated_delta_rule`` contract (the recurrence of Gated DeltaNet).

Shapes: B batch, T length, H query/key heads, HV value heads (a multiple of H; HV == H is plain
multi-head), K query/key head dim, V value head dim, N packed sequences.

Grouped value heads (Qwen3-Next's Gated DeltaNet: 16 query/key heads, 32 value heads): value head ``hv``
reads query/key head ``hv // (HV // H)`` (the grouping of GQA in flash attention: consecutive value heads
share a query/key head). The gates ``g`` and ``beta``, the state and the output follow the value heads:
every value head has its own gates and state.

For every batch row (or packed sequence) and value head, with a state ``S`` of shape ``[K, V]`` that starts
at ``initial_state`` (zeros when absent), token by token (``a_t = exp(g_t)``; ``q_t``, ``k_t`` of the value
head's query/key head):

1. with ``use_qk_l2norm``: ``q_t = q_t / sqrt(|q_t|^2 + 1e-6)``, likewise ``k_t`` (in float32);
2. ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, that is: decay the state, read the
   value it holds for ``k_t``, and move it a fraction ``beta_t`` of the way towards ``v_t``
   (``S = a S; S += beta k (v - S^T k)^T``);
3. ``o_t = scale * S_t^T q_t`` (``scale`` defaults to ``K ** -0.5``).

This is the convention of flash-linear-attention's ``chunk_gated_delta_rule``. ``g`` is the log of the
decay and ``beta`` the writing strength; with ``g <= 0``, ``beta`` in ``[0, 1]`` and unit-norm keys every
step is a contraction and the state stays bounded (none of this is checked: it is data). The gates may
have another float dtype than ``q``, ``k``, ``v`` (float32 gates beside bfloat16 activations are usual).
Everything is computed in float32; the output has ``q``'s dtype and the final state is float32.

With ``cu_seqlens`` (B == 1) the sequences ``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T:
each starts from ``initial_state[n]`` (``[N, HV, K, V]``) and its final state is ``final_state[n]``. A
sequence of length 0 outputs nothing and its final state is its initial state; tokens outside
``[cu_seqlens[0], cu_seqlens[N])`` give zeros. ``cu_seqlens`` must be non-decreasing within ``[0, T]``:
checked when concrete (``ValueError``); under ``jit`` it is traced and unchecked unless ``EJKERNEL_CHECKS=1``
(then the call fails when it runs), and a violation gives wrong outputs without an error.

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures._checks import ArrayIn, check_bool, check_float_array
from ejkernel.kernels.signatures._linear_attention import check_gate, check_grouped_qkv, check_state_options
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import linear_attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import GatedDeltaRuleConfig
from ejkernel.ops import Invocation, Kernel

OP = "gated_delta_rule"


def validate(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    use_qk_l2norm: bool = False,
    **_: Any,
) -> None:
    """Check a ``gated_delta_rule`` call; raise an error naming the argument, what was expected and what came."""
    b, t, _heads, hv, dk, dv = check_grouped_qkv(OP, q, k, v)
    for name, x in (("g", g), ("beta", beta)):
        check_float_array(OP, name, x, "[B, T, HV]")
        check_gate(OP, name, x, (b, t, hv), "[B, T, HV]")
    check_state_options(
        OP,
        (b, t, hv, dk, dv),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        heads="HV",
    )
    check_bool(OP, "use_qk_l2norm", use_qk_l2norm)


class GatedDeltaRule(Kernel[GatedDeltaRuleConfig]):
    op_id = "gated_delta_rule"
    config_type = GatedDeltaRuleConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        d = arguments["q"].shape[-1]
        arguments["scale"] = float(d**-0.5 if arguments["scale"] is None else arguments["scale"])
        return arguments

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        # Gates in their usual ranges (log decay <= 0, beta in (0, 1)) and unit keys, so that timing
        # runs a bounded recurrence rather than overflowing floats.
        jnp = jax.numpy
        inputs["g"] = -jax.nn.softplus(inputs["g"].astype(jnp.float32)).astype(inputs["g"].dtype)
        inputs["beta"] = jax.nn.sigmoid(inputs["beta"].astype(jnp.float32)).astype(inputs["beta"].dtype)
        k = inputs["k"].astype(jnp.float32)
        inputs["k"] = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(inputs["k"].dtype)
        cu = inv.arguments.get("cu_seqlens")
        if isinstance(cu, jax.ShapeDtypeStruct):
            # Packed sequences of equal length: representative work for timing.
            n, t = cu.shape[0] - 1, inv.arguments["q"].shape[1]
            inputs["cu_seqlens"] = jnp.asarray(np.linspace(0, t, n + 1).astype(np.int64), cu.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return linear_attention_zeros(arguments)


_kernel = GatedDeltaRule()


@checked
def gated_delta_rule(
    q: Float[ArrayIn, "B T H K"],
    k: Float[ArrayIn, "B T H K"],
    v: Float[ArrayIn, "B T HV V"],
    g: Float[ArrayIn, "B T HV"],
    beta: Float[ArrayIn, "B T HV"],
    *,
    scale: float | None = None,
    initial_state: Float[ArrayIn, "B_or_N HV K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Int[ArrayIn, "N1"] | None = None,
    use_qk_l2norm: bool = False,
    platform: str | None = None,
    backend: str | None = None,
    cfg: GatedDeltaRuleConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B_or_N HV K V"] | None]:
    """The gated delta rule of Gated DeltaNet: a decaying ``[K, V]`` state per value head, corrected towards each value.

    Per value head, token by token (``a_t = exp(g_t)``):
    ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` and ``o_t = scale * S_t^T q_t``, the
    convention of flash-linear-attention's ``chunk_gated_delta_rule``.

    Shapes: B batch, T length, H query/key heads, HV value heads (a multiple of H; value head ``hv`` reads
    query/key head ``hv // (HV // H)``), K query/key head dim, V value head dim, N packed sequences.

    Args:
        q: ``[B, T, H, K]``.
        k: ``[B, T, H, K]`` (keep them unit-norm, or pass ``use_qk_l2norm``, for a bounded state).
        v: ``[B, T, HV, V]``; ``HV == H`` is plain multi-head, more value heads share query/key heads.
        g: ``[B, T, HV]`` log decay (``<= 0``), per value head.
        beta: ``[B, T, HV]`` writing strength (in ``(0, 1)``), per value head.
        scale: multiplies the output, default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``) state before the first token;
            default zeros. Differentiable.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N+1]`` offsets of packed sequences (B must be 1); each starts from its own initial state.
        use_qk_l2norm: L2-normalise ``q`` and ``k`` over the head dim first (``x / sqrt(|x|^2 + 1e-6)``).
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``GatedDeltaRuleConfig`` that overrides the config chain (never cached); the XLA implementation
            reads the chunk size from ``fwd_params.q_blocksize`` (1: the token-by-token recurrence).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in ``q.dtype``; ``final_state`` ``[B|N, HV, K, V]`` in
        float32, or None without ``output_final_state``. An empty packed sequence keeps its initial state.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import gated_delta_rule
    >>> q, k = jax.random.normal(jax.random.key(0), (2, 2, 100, 4, 32))
    >>> v = jax.random.normal(jax.random.key(1), (2, 100, 4, 64))
    >>> g = -jax.nn.softplus(jax.random.normal(jax.random.key(2), (2, 100, 4)))
    >>> beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(3), (2, 100, 4)))
    >>> o, state = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True)
    >>> o.shape, state.shape, state.dtype
    ((2, 100, 4, 64), (2, 4, 32, 64), dtype('float32'))

    Grouped value heads, as in Qwen3-Next: 8 value heads over the 4 query/key heads (value heads 0 and 1
    read head 0, ...); the gates are per value head:

    >>> v8 = jax.random.normal(jax.random.key(1), (2, 100, 8, 64))
    >>> g8 = -jax.nn.softplus(jax.random.normal(jax.random.key(2), (2, 100, 8)))
    >>> beta8 = jax.nn.sigmoid(jax.random.normal(jax.random.key(3), (2, 100, 8)))
    >>> o, state = gated_delta_rule(q, k, v8, g8, beta8, use_qk_l2norm=True, output_final_state=True)
    >>> o.shape, state.shape
    ((2, 100, 8, 64), (2, 8, 32, 64))
    """
    arrays = {
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "beta": beta,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }
    options = {"scale": scale, "output_final_state": output_final_state, "use_qk_l2norm": use_qk_l2norm}
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
