"""The ``recurrent`` contract: the general gated linear-attention recurrence.

Shapes: B batch, T length, H heads (shared by every array), K query/key head dim, V value head dim,
N packed sequences.

For every batch row (or packed sequence) and head, with a state ``S`` of shape ``[K, V]`` that starts
at ``initial_state`` (zeros when absent), token by token:

1. ``S_t = exp(g_t) * diag(exp(g_k,t)) S_{t-1} diag(exp(g_v,t)) + k_t^T v_t``: state entry ``(i, j)``
   decays by ``exp(g_t + g_k,t[i] + g_v,t[j])``; an absent gate counts as 0 (no decay), so with no gate
   at all this is plain causal linear attention;
2. ``o_t = scale * q_t S_t`` (the current token included; ``scale`` defaults to ``K ** -0.5``).

With ``reverse`` the tokens are visited from the last to the first (``t = T-1, ..., 0``, or from
``cu_seqlens[n+1] - 1`` down to ``cu_seqlens[n]`` within each packed sequence): ``S_{t+1}`` takes the
place of ``S_{t-1}``, so ``o_t`` sums over ``s >= t``, and the final state is the state after the first
token. This is the convention of flash-linear-attention's ``fused_recurrent`` (``g``, ``gk``, ``gv``).

The gates are logs of decays, so ``<= 0`` (values above 0 are not checked but are outside the contract:
implementations may overflow). Everything is computed in float32; the output has ``q``'s dtype and the
final state is float32. Gates and ``initial_state`` may have any float dtype; every array argument is
differentiable.

With ``cu_seqlens`` (B == 1) the sequences ``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T:
each starts from ``initial_state[n]`` (``[N, H, K, V]``) and its final state is ``final_state[n]``. A
sequence of length 0 outputs nothing and its final state is its initial state; tokens outside
``[cu_seqlens[0], cu_seqlens[N])`` give zeros. ``cu_seqlens`` must be non-decreasing within ``[0, T]``:
checked when concrete (``ValueError``); under ``jit`` it is traced and unchecked unless ``EJKERNEL_CHECKS=1``
(then the call fails when it runs), and a violation gives wrong outputs without an error.

Returns ``(o, final_state)``: ``o`` ``[B, T, H, V]``, ``final_state`` ``[B or N, H, K, V]`` when
``output_final_state`` else ``None``.

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures._checks import ArrayIn, check_bool
from ejkernel.kernels.signatures._linear_attention import check_gate, check_qkv, check_state_options
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import linear_attention_zeros
from ejkernel.modules.operations._linear_attention import normalize_scale, timing_inputs
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import RecurrentConfig
from ejkernel.ops import Invocation, Kernel


def validate(
    q: Any,
    k: Any,
    v: Any,
    g: Any = None,
    g_k: Any = None,
    g_v: Any = None,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Any = None,
    **_: Any,
) -> None:
    """Check a ``recurrent`` call; raise an error naming the argument, what was expected and what came."""
    dims = check_qkv("recurrent", q, k, v)
    b, t, h, dk, dv = dims
    if g is not None:
        check_gate("recurrent", "g", g, (b, t, h), "[B, T, H]")
    if g_k is not None:
        check_gate("recurrent", "g_k", g_k, (b, t, h, dk), "[B, T, H, K]")
    if g_v is not None:
        check_gate("recurrent", "g_v", g_v, (b, t, h, dv), "[B, T, H, V]")
    check_state_options(
        "recurrent",
        dims,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    check_bool("recurrent", "reverse", reverse)


class Recurrent(Kernel[RecurrentConfig]):
    op_id = "recurrent"
    config_type = RecurrentConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return normalize_scale(arguments)

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        return timing_inputs(super().make_inputs(inv, seed), inv, ("g", "g_k", "g_v"))

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return linear_attention_zeros(arguments)


_kernel = Recurrent()


@checked
def recurrent(
    q: Float[ArrayIn, "B T H K"],
    k: Float[ArrayIn, "B T H K"],
    v: Float[ArrayIn, "B T H V"],
    g: Float[ArrayIn, "B T H"] | None = None,
    g_k: Float[ArrayIn, "B T H K"] | None = None,
    g_v: Float[ArrayIn, "B T H V"] | None = None,
    *,
    scale: float | None = None,
    initial_state: Float[ArrayIn, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Int[ArrayIn, "N1"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: RecurrentConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B_or_N H K V"] | None]:
    """The general linear-attention recurrence: a ``[K, V]`` state per head with optional scalar, key and value gates.

    Shapes: B batch, T length, H heads (the same for every array), K query/key head dim, V value head
    dim, N packed sequences. Token by token (flash-linear-attention's ``fused_recurrent`` convention)::

        S_t = exp(g_t) * diag(exp(g_k,t)) S_{t-1} diag(exp(g_v,t)) + k_t^T v_t        o_t = scale * q_t S_t

    An absent gate means no decay: with none, this is causal linear attention.

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, H, V]``.
        g: log decay of the whole state ``[B, T, H]``, ``<= 0``.
        g_k: log decay of every key channel ``[B, T, H, K]``, ``<= 0``.
        g_v: log decay of every value channel ``[B, T, H, V]``, ``<= 0``. Gates may have any float dtype
            and are differentiable.
        scale: multiplies ``q``, default ``K ** -0.5``.
        initial_state: the state before the first visited token, ``[B, H, K, V]`` (``[N, H, K, V]`` with
            ``cu_seqlens``); default zeros; differentiable.
        output_final_state: also return the state after the last visited token.
        reverse: visit the tokens from last to first (within each packed sequence), so ``o_t`` sums over
            ``s >= t``.
        cu_seqlens: ``[N+1]`` offsets of sequences packed along T (B must be 1); each starts from its own
            initial state; tokens outside every sequence give zeros.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``RecurrentConfig`` that overrides the config chain (never cached);
            ``fwd_params.q_blocksize``/``bwd_params.q_blocksize`` are the XLA implementation's chunk lengths.
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``q.dtype``; ``final_state`` ``[B or N, H, K, V]``
        in float32 when ``output_final_state``, else ``None``.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import recurrent
    >>> q = k = jnp.ones((1, 4, 1, 1)); v = jnp.arange(1.0, 5.0).reshape(1, 4, 1, 1)
    >>> g = jnp.full((1, 4, 1), jnp.log(0.5))  # the state halves every step
    >>> o, _ = recurrent(q, k, v, g, scale=1.0)
    >>> o[0, :, 0, 0].tolist()  # 1, 0.5 * 1 + 2, 0.5 * 2.5 + 3, 0.5 * 4.25 + 4
    [1.0, 2.5, 4.25, 6.125]
    >>> o, _ = recurrent(q, k, v, scale=1.0, reverse=True)  # no gate: sums of v[t:]
    >>> o[0, :, 0, 0].tolist()
    [10.0, 9.0, 7.0, 4.0]
    """
    arrays = {
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "g_k": g_k,
        "g_v": g_v,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }
    options = {"scale": scale, "output_final_state": output_final_state, "reverse": reverse}
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
