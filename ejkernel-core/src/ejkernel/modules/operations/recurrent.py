"""``recurrent``: the public function and its operations-layer ``Kernel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jaxtyping import Array, Float, Int

from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import linear_attention_zeros
from ejkernel.modules.operations._linear_attention import normalize_scale, timing_inputs
from ejkernel.modules.operations.configs import RecurrentConfig
from ejkernel.ops import Invocation, Kernel


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


def recurrent(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H"] | None = None,
    g_k: Float[Array, "B T H K"] | None = None,
    g_v: Float[Array, "B T H V"] | None = None,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Int[Array, "N+1"] | None = None,
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
