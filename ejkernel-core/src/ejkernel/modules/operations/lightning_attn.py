"""The ``lightning_attn`` contract (linear attention with a fixed decay per head, as in Lightning Attention).

Shapes: B batch, T length, H heads (shared by ``q``, ``k``, ``v``), K query/key head dim, V value head
dim, N packed sequences.

For every batch row (or packed sequence) and head ``h``, with a state ``S`` of shape ``[K, V]`` that
starts at ``initial_state`` (zeros when absent), token by token:

1. ``S_t = exp(-slope[h]) S_{t-1} + k_t^T v_t``: the whole state decays by the same factor each step;
2. ``o_t = scale * q_t S_t`` (the current token included; ``scale`` defaults to ``K ** -0.5``).

Unrolled: ``o_t = scale * sum_{s <= t} exp(-slope[h] (t - s)) (q_t . k_s) v_s`` plus the decayed initial
state. ``slope >= 0`` (0: no decay, plain causal linear attention); negative slopes are not checked but
are outside the contract. Lightning Attention / MiniMax build the slopes ALiBi-style per layer
(flash-linear-attention's ``chunk_lightning_attn`` uses ``slope[h] = 8 h / H * (1 - layer / layers)``);
this op takes them as an array and is differentiable in it. Everything is computed in float32; the
output has ``q``'s dtype and the final state is float32. ``slope`` and ``initial_state`` may have any
float dtype.

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

from ejkernel.kernels.signatures._checks import ArrayIn
from ejkernel.kernels.signatures._linear_attention import check_gate, check_qkv, check_state_options
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import linear_attention_zeros
from ejkernel.modules.operations._linear_attention import normalize_scale, timing_inputs
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import LightningAttnConfig
from ejkernel.ops import Invocation, Kernel


def validate(
    q: Any,
    k: Any,
    v: Any,
    slope: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    **_: Any,
) -> None:
    """Check a ``lightning_attn`` call; raise an error naming the argument, what was expected and what came."""
    dims = check_qkv("lightning_attn", q, k, v)
    check_gate("lightning_attn", "slope", slope, (dims[2],), "[H]")
    check_state_options(
        "lightning_attn",
        dims,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


class LightningAttn(Kernel[LightningAttnConfig]):
    op_id = "lightning_attn"
    config_type = LightningAttnConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return normalize_scale(arguments)

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        return timing_inputs(super().make_inputs(inv, seed), inv, ())

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return linear_attention_zeros(arguments)


_kernel = LightningAttn()


@checked
def lightning_attn(
    q: Float[ArrayIn, "B T H K"],
    k: Float[ArrayIn, "B T H K"],
    v: Float[ArrayIn, "B T H V"],
    slope: Float[ArrayIn, "H"],
    *,
    scale: float | None = None,
    initial_state: Float[ArrayIn, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Int[ArrayIn, "N1"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: LightningAttnConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B_or_N H K V"] | None]:
    """Causal linear attention whose ``[K, V]`` state decays by ``exp(-slope[h])`` every step (Lightning Attention).

    Shapes: B batch, T length, H heads (the same for every array), K query/key head dim, V value head
    dim, N packed sequences. Token by token::

        S_t = exp(-slope[h]) S_{t-1} + k_t^T v_t        o_t = scale * q_t S_t

    that is ``o_t = scale * sum_{s <= t} exp(-slope[h] (t - s)) (q_t . k_s) v_s`` plus the decayed
    initial state.

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, H, V]``.
        slope: decay rate of every head ``[H]``, ``>= 0`` (0: no decay); any float dtype, differentiable.
        scale: multiplies ``q``, default ``K ** -0.5``.
        initial_state: the state before the first token, ``[B, H, K, V]`` (``[N, H, K, V]`` with
            ``cu_seqlens``); default zeros; differentiable.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N+1]`` offsets of sequences packed along T (B must be 1); each starts from its own
            initial state; tokens outside every sequence give zeros.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``LightningAttnConfig`` that overrides the config chain (never cached);
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
    >>> from ejkernel.modules import lightning_attn
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 128, 8, 64))
    >>> slope = 2.0 ** (-8.0 * jnp.arange(1, 9) / 8)  # ALiBi-style rates, one per head
    >>> o, state = lightning_attn(q, k, v, slope)
    >>> o.shape, state is None
    ((1, 128, 8, 64), True)
    """
    arrays = {
        "q": q,
        "k": k,
        "v": v,
        "slope": slope,
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
