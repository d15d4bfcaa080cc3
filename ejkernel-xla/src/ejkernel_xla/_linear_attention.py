"""Linear attention in plain JAX: the engine behind ``gla``, ``lightning_attn`` and ``recurrent``.

The recurrence, per batch row (or packed sequence) and head, in float32::

    S_t = diag(exp(a_t)) S_{t-1} diag(exp(c_t)) + k_t^T v_t        S: [K, V]
    o_t = scale * q_t S_t

``a`` is the key-side log decay, ``[B, T, H, K]`` or ``[B, T, H, 1]`` (one decay for the whole state:
lightning's slope, recurrent's scalar ``g``); ``c`` the value-side one ``[B, T, H, V]`` (recurrent's
``g_v``); either may be absent. Each op maps its gates onto ``a`` and ``c``.

Two forms, chosen by the chunk size ``C`` (``ChunkParams.chunk_size`` of the launch parameters):

* ``C == 1``: the step-by-step recurrence, one ``lax.scan`` step per token carrying ``S`` (decoding and
  short inputs). Its backward (``_steps_bwd``) keeps the state at the start of every block of ~sqrt(T)
  tokens only, not every ``S_t``, and computes the gates' gradients from the states themselves.
* ``C > 1`` (a power of two): the chunked parallel form. Tokens are cut into chunks of ``C``; with ``P``
  the prefix sums of the gates inside a chunk (token t included, one matmul with a triangle of ones) and
  ``P_L`` the chunk's total, a chunk entered with state ``S_in`` gives

      o     = intra-chunk attention  +  ((q * exp(Pa)) @ S_in) * exp(Pc)
      S_out = exp(Pa_L)[:, None] * S_in * exp(Pc_L)[None, :]  +  (k * exp(Pa_L - Pa))^T (v * exp(Pc_L - Pc))

  All matmuls run batched over chunks; only the ``[K, V]`` recurrence over chunks is a ``lax.scan``
  (T / C steps of one multiply-add). Every exponent above is <= 0, so nothing overflows.

  Intra-chunk attention needs ``exp(Pa_t - Pa_s)`` (``s <= t``) inside ``q_t . k_s``: it is factored around
  the middle prefix sum ``m`` as ``(q_t e^(Pa_t - m)) . (k_s e^(m - Pa_s))``, one ``[C, C]`` matmul per
  chunk (likewise ``exp(Pc_t - Pc_s)`` on the value axis). That is exact while every ``|P - m|`` and
  ``|m|`` stay within ``SAFE_EXPONENT`` (per-step log gates above about ``-60 / C``: usual gates, e.g.
  GLA's ``log_sigmoid(x) / 16``; small prefix sums also keep their differences accurate). Otherwise
  ``lax.cond`` runs the step-by-step recurrence on the same layout, exact for any gates (``_fits``).

Varlen (``cu_seqlens``, B == 1): tokens are gathered into a chunk-aligned layout in which every packed
sequence starts a new chunk (at most ``T // C + N`` chunks); a chunk that starts a sequence takes that
sequence's initial state instead of the carried one; final states are read at each sequence's last chunk.
``reverse`` visits each sequence backwards: the layout holds its tokens in reverse order.

Gradients: with one chunk size for both passes, the forward's own residuals (``jax.vjp``): for the
chunked form O(T (K + V + C) + (T / C) K V), the step-by-step form keeps its inputs and ~sqrt(T) states
(its backward, ``_steps_bwd``, walks each block of ~sqrt(T) tokens again). With another chunk size for
the backward (its ``ChunkParams``), only the inputs are kept and the backward recomputes the forward with it.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.device import cdiv

from ejkernel_xla.params import ChunkParams, coerce

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
# Largest exponent a factor of the intra-chunk form may take: products of two stay below e^60 ~ 1e26, far
# from float32's 3e38, even for the masked pairs (s > t) that a where drops, so no inf or NaN appears on
# either branch of the lax.cond (under vmap both run).
SAFE_EXPONENT = 30.0


@dataclasses.dataclass(frozen=True)
class Options:
    """Static options of one call: ``fwd_chunk``/``bwd_chunk`` are the chunk sizes (1 = step by step)."""

    scale: float = 1.0
    reverse: bool = False
    output_final_state: bool = False
    fwd_chunk: int = 64
    bwd_chunk: int = 64


# Chunk sizes. Up to STEP_MAX_T tokens (decoding, short prompts) the step-by-step recurrence; longer inputs
# chunks of DEFAULT_CHUNK: on a shared 2-core CPU (B=1, H=4, T=4096, K=V=64, float32;
# a benchmark script since replaced by `ejkernel bench gla --preset linear-attn-cpu`) forward+backward took 105 ms with chunks of 64, 115-119 with 128 or
# 32, 154 with 16 and 268 step by step (68 / 76-81 / 115 / 226 ms on a quieter run). The autotuner times
# CANDIDATE_CHUNKS, the step-by-step form included: the fastest forward on CPU (17 vs 36 ms), and its
# backward keeps ~2 sqrt(T) states, so it is a safe candidate at any length.
STEP_MAX_T = 16
DEFAULT_CHUNK = 64
CANDIDATE_CHUNKS = (1, 16, 32, 64, 128)


def chunk_size(requested: int | None, t: int) -> int:
    """The chunk size used for length ``t``: ``requested`` (default: the heuristic) rounded down to a power
    of two and at most the next power of two of ``t``; 1 means the step-by-step recurrence."""
    c = (1 if t <= STEP_MAX_T else DEFAULT_CHUNK) if requested is None else int(requested)
    if c < 1:
        raise ValueError(f"linear attention: the chunk size (ChunkParams.chunk_size) must be >= 1, got {c}")
    c = 1 << (c.bit_length() - 1)
    return min(c, 1 << max(0, (t - 1).bit_length()))


def options(
    t: int,
    scale: float,
    fwd_params: ChunkParams | None,
    bwd_params: ChunkParams | None,
    *,
    reverse: bool = False,
    output_final_state: bool = False,
) -> Options:
    """``Options`` of a call of length ``t`` with these launch parameters (generic ``FwdParams``/``BwdParams``
    of a direct call are mapped: ``q_blocksize`` is the chunk size)."""
    fwd, bwd = coerce(ChunkParams, fwd_params), coerce(ChunkParams, bwd_params)
    return Options(
        scale=float(scale),
        reverse=bool(reverse),
        output_final_state=bool(output_final_state),
        fwd_chunk=chunk_size(None if fwd is None else fwd.chunk_size, t),
        bwd_chunk=chunk_size(None if bwd is None else bwd.chunk_size, t),
    )


def heuristic_cfg(inv: Any, stage: str) -> ChunkParams:
    """The chunk size for the call's length (both passes)."""
    t = int(inv.arguments["q"].shape[1])
    return ChunkParams(chunk_size=chunk_size(None, t))


def candidate_cfgs(inv: Any, stage: str) -> list[ChunkParams]:
    """The chunk sizes the autotuner times: ``CANDIDATE_CHUNKS`` that fit the call's length (1: step by step)."""
    t = int(inv.arguments["q"].shape[1])
    return [ChunkParams(chunk_size=c) for c in dict.fromkeys(chunk_size(c, t) for c in CANDIDATE_CHUNKS)]


def _mm(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, y, precision=HIGHEST, preferred_element_type=F32)


# ---- layout ---------------------------------------------------------------------------------------


class _Varlen(NamedTuple):
    """Where the tokens of packed sequences go in the chunk-aligned layout (all traced int/bool arrays).

    ``src[p]``: token at position p (T: padding); ``dst[t]``: position of token t (L: outside every
    sequence); per chunk ``reset`` (it starts a sequence) and ``seq`` (which); per sequence ``last``
    (its last chunk) and ``nonempty``.
    """

    src: jax.Array
    dst: jax.Array
    reset: jax.Array
    seq: jax.Array
    last: jax.Array
    nonempty: jax.Array


def _varlen_plan(cu_seqlens: jax.Array, t: int, chunk: int, reverse: bool) -> tuple[_Varlen, int]:
    n = cu_seqlens.shape[0] - 1
    n_chunks = t if chunk == 1 else t // chunk + n  # sum of ceil(len / C) over the sequences is below this
    cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, t)
    start, end = cu[:-1], cu[1:]
    lengths = jnp.maximum(end - start, 0)
    chunks = cdiv(lengths, chunk)
    first = jnp.cumsum(chunks) - chunks  # first chunk of each sequence
    used = jnp.sum(chunks)
    c = jnp.arange(n_chunks)
    seq = jnp.clip(jnp.searchsorted(first, c, side="right") - 1, 0, n - 1)  # empty sequences own no chunk
    reset = (c < used) & (c == first[seq])
    p = jnp.arange(n_chunks * chunk)
    p_seq = seq[p // chunk]
    j = p - first[p_seq] * chunk  # offset inside the sequence
    valid = (p // chunk < used) & (j < lengths[p_seq])
    src = jnp.where(valid, end[p_seq] - 1 - j if reverse else start[p_seq] + j, t)
    tok = jnp.arange(t)
    t_seq = jnp.clip(jnp.searchsorted(cu, tok, side="right") - 1, 0, n - 1)
    inside = (tok >= cu[0]) & (tok < cu[n])
    jt = end[t_seq] - 1 - tok if reverse else tok - start[t_seq]
    dst = jnp.where(inside, first[t_seq] * chunk + jt, n_chunks * chunk)
    return _Varlen(src, dst, reset, seq, first + chunks - 1, chunks > 0), n_chunks


def _pack(x: jax.Array | None, length: int, reverse: bool, plan: _Varlen | None) -> jax.Array | None:
    """``[B, T, H, D]`` -> ``[B, length, H, D]`` in visiting order (zeros on padding), float32."""
    if x is None:
        return None
    x = x.astype(F32)
    if plan is not None:
        return jnp.take(x, plan.src, axis=1, mode="fill", fill_value=0)
    if reverse:
        x = jnp.flip(x, axis=1)
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))


def _unpack(o: jax.Array, t: int, reverse: bool, plan: _Varlen | None) -> jax.Array:
    if plan is not None:
        return jnp.take(o, plan.dst, axis=1, mode="fill", fill_value=0)
    o = o[:, :t]
    return jnp.flip(o, axis=1) if reverse else o


# ---- step by step ---------------------------------------------------------------------------------


class _Meta(NamedTuple):
    """Per position of a varlen layout: the state restarts from ``h0[seq]`` (``reset``) and the state
    after it is the sequence's final state (``last``)."""

    reset: jax.Array
    seq: jax.Array
    last: jax.Array


def _step_meta(plan: _Varlen | None, length: int, chunk: int) -> _Meta | None:
    if plan is None:
        return None
    pos = jnp.arange(length)
    n, i = pos // chunk, pos % chunk
    seq = plan.seq[n]
    last = plan.nonempty[seq] & (n == plan.last[seq]) & (i == chunk - 1)  # padding keeps the state
    return _Meta(plan.reset[n] & (i == 0), seq, last)


def _time_major(x: jax.Array | None) -> jax.Array | None:
    return None if x is None else jnp.moveaxis(x, 1, 0)


def _decays(a: jax.Array | None, c: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    return (None if a is None else jnp.exp(a)), (None if c is None else jnp.exp(c))


def _decay(state, ea_t, ec_t):
    if ea_t is not None:
        state = ea_t[..., :, None] * state
    if ec_t is not None:
        state = state * ec_t[..., None, :]
    return state


def _restart(state, h0, m_t):
    """The state entering a position: ``h0[seq]`` where a sequence starts, else the carried one."""
    if m_t is None:
        return state
    return jnp.where(m_t.reset, lax.dynamic_index_in_dim(h0, m_t.seq, keepdims=True), state)


def _block_size(length: int) -> int:
    """Tokens per block of the step-by-step form: about sqrt(L), so that the backward keeps ~2 sqrt(L) states."""
    return max(1, math.isqrt(length - 1) + 1) if length > 1 else 1


def _blocked(x: Any, blocks: int, fill: float = 0.0) -> Any:
    """``[L, ...]`` time-major arrays (or a ``_Meta``) -> ``[NB, blocks, ...]``, padded with positions that
    change nothing (no input, no restart, not last; decays padded with ``fill=1``)."""
    if x is None:
        return None
    if isinstance(x, _Meta):
        return _Meta(*(_blocked(f, blocks) for f in x))
    pad = -x.shape[0] % blocks
    x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
    return x.reshape(x.shape[0] // blocks, blocks, *x.shape[1:])


@jax.custom_vjp
def _steps(q, k, v, a, c, h0, meta):
    """The recurrence token by token over ``[B, L, H, D]`` inputs; returns ``o`` and the final states.

    Without ``meta`` every batch row is one sequence starting from ``h0[b]``; with it (B == 1) the
    sequences restart and end where ``meta`` says. Tokens are visited in blocks of about sqrt(L) (an
    outer scan over blocks, an inner one over their tokens), so that the backward can keep the state at
    every block start only.
    """
    return _steps_forward(q, k, v, a, c, h0, meta)[0]


def _steps_forward(q, k, v, a, c, h0, meta):
    """``((o, final states), state entering every block)``."""
    length = q.shape[1]
    blocks = _block_size(length)
    ea, ec = _decays(a, c)

    def token(carry, x):
        state, finals = carry
        q_t, k_t, v_t, ea_t, ec_t, m_t = x  # [B, H, D]
        state = _decay(_restart(state, h0, m_t), ea_t, ec_t) + k_t[..., :, None] * v_t[..., None, :]
        if m_t is not None:
            kept = lax.dynamic_index_in_dim(finals, m_t.seq, keepdims=True)
            finals = lax.dynamic_update_index_in_dim(finals, jnp.where(m_t.last, state, kept), m_t.seq, 0)
        return (state, finals), _mm("bhk,bhkv->bhv", q_t, state)

    def block(carry, x):
        carry_out, o = lax.scan(token, carry, x)
        return carry_out, (o, carry[0])

    # Varlen: an empty sequence never writes its final state, which stays its initial state.
    carry0 = (h0, None) if meta is None else (jnp.zeros((1, *h0.shape[1:]), F32), h0)
    xs = tuple(_blocked(_time_major(x), blocks) for x in (q, k, v))
    xs += tuple(_blocked(_time_major(x), blocks, 1.0) for x in (ea, ec)) + (_blocked(meta, blocks),)
    (state, finals), (o, entered) = lax.scan(block, carry0, xs)
    o = jnp.moveaxis(o.reshape(-1, *o.shape[2:])[:length], 0, 1)
    return (o, state if meta is None else finals), entered


def _steps_fwd(q, k, v, a, c, h0, meta):
    out, entered = _steps_forward(q, k, v, a, c, h0, meta)
    return out, (q, k, v, a, c, h0, meta, entered)


def _steps_bwd(res, cotangents):
    """A reverse scan over the blocks: recompute the states inside a block from its saved start, then walk
    it backwards with the state's gradient ``dS`` (``dS_t += q_t^T do_t``; ``dq_t = S_t do_t``,
    ``dk_t = dS_t v_t``, ``dv_t = dS_t^T k_t``; the gates' from ``dS_t * decay_t * S_{t-1}`` summed over
    the other axis; ``dS_{t-1} = decay_t * dS_t``). Memory: ~2 sqrt(L) states."""
    q, k, v, a, c, h0, meta, entered = res
    do, dfinal = cotangents
    length = q.shape[1]
    blocks = _block_size(length)
    ea, ec = _decays(a, c)
    width_a = None if a is None else a.shape[-1]

    def at(x, m_t):  # x[seq] (varlen) where m_t says so, else 0
        return lax.dynamic_index_in_dim(x, m_t.seq, keepdims=True)

    def block(carry, x):
        start, xb = x

        def forward(state, x_t):  # the state entering each token (after a restart)
            k_t, v_t, ea_t, ec_t, m_t = x_t
            prev = _restart(state, h0, m_t)
            return _decay(prev, ea_t, ec_t) + k_t[..., :, None] * v_t[..., None, :], prev

        q_b, k_b, v_b, ea_b, ec_b, do_b, m_b = xb
        _, prev = lax.scan(forward, start, (k_b, v_b, ea_b, ec_b, m_b))

        def backward(carry, x_t):
            ds, dh0 = carry
            q_t, k_t, v_t, ea_t, ec_t, do_t, m_t, prev_t = x_t
            if m_t is not None:
                ds = ds + jnp.where(m_t.last, at(dfinal, m_t), 0.0)
            ds = ds + q_t[..., :, None] * do_t[..., None, :]
            decayed = _decay(prev_t, ea_t, ec_t)
            state = decayed + k_t[..., :, None] * v_t[..., None, :]
            dq_t = _mm("bhkv,bhv->bhk", state, do_t)
            dk_t = _mm("bhkv,bhv->bhk", ds, v_t)
            dv_t = _mm("bhkv,bhk->bhv", ds, k_t)
            da_t = dc_t = None
            if ea_t is not None:
                da_t = jnp.sum(ds * decayed, axis=-1)
                da_t = jnp.sum(da_t, axis=-1, keepdims=True) if width_a == 1 else da_t
            if ec_t is not None:
                dc_t = jnp.sum(ds * decayed, axis=-2)
            ds = _decay(ds, ea_t, ec_t)  # the gradient of the state entering this token
            if m_t is not None:  # where a sequence starts, it flows to that sequence's initial state
                dh0 = lax.dynamic_update_index_in_dim(dh0, at(dh0, m_t) + jnp.where(m_t.reset, ds, 0.0), m_t.seq, 0)
                ds = jnp.where(m_t.reset, 0.0, ds)
            return (ds, dh0), (dq_t, dk_t, dv_t, da_t, dc_t)

        return lax.scan(backward, carry, (q_b, k_b, v_b, ea_b, ec_b, do_b, m_b, prev), reverse=True)

    carry0: tuple[Any, Any] = (dfinal, None)
    if meta is not None:  # an empty sequence's final state is its initial state
        nonempty = jnp.zeros(h0.shape[0], bool).at[meta.seq].max(meta.last)
        carry0 = (jnp.zeros((1, *h0.shape[1:]), F32), jnp.where(nonempty[:, None, None, None], 0.0, dfinal))
    xs = tuple(_blocked(_time_major(x), blocks) for x in (q, k, v))
    xs += tuple(_blocked(_time_major(x), blocks, 1.0) for x in (ea, ec))
    xs += (_blocked(_time_major(do), blocks), _blocked(meta, blocks))
    (ds, dh0), grads = lax.scan(block, carry0, (entered, xs), reverse=True)
    dq, dk, dv, da, dc = (
        None if x is None else jnp.moveaxis(x.reshape(-1, *x.shape[2:])[:length], 0, 1) for x in grads
    )
    return dq, dk, dv, da, dc, (ds if meta is None else dh0), None


_steps.defvjp(_steps_fwd, _steps_bwd)


# ---- chunked ----------------------------------------------------------------------------------------


def _blocks(x: jax.Array | None, chunk: int) -> jax.Array | None:
    """``[B, L, H, D]`` -> ``[B, H, L / C, C, D]``."""
    if x is None:
        return None
    b, length, h, d = x.shape
    return x.reshape(b, length // chunk, chunk, h, d).transpose(0, 3, 1, 2, 4)


def _prefix(g: jax.Array | None) -> jax.Array | None:
    """Prefix sums inside every chunk (token t included) of ``[..., C, D]`` gates, as one matmul with a
    lower-triangular matrix of ones (XLA:CPU runs it much faster than ``cumsum``)."""
    if g is None:
        return None
    chunk = g.shape[-2]
    ones = jnp.tril(jnp.ones((chunk, chunk), F32))
    return _mm("ts,...sd->...td", ones, g)


def _intra(q, k, v, pa, pc, causal):
    """Intra-chunk attention, the gates factored around the chunk's middle prefix sum (exact when ``_fits``)."""
    mid = q.shape[-2] // 2 - 1
    if pa is not None:
        m = pa[..., mid : mid + 1, :]
        q = q * jnp.exp(jnp.minimum(pa - m, SAFE_EXPONENT))  # the clamps bite only on a branch not taken
        k = k * jnp.exp(jnp.minimum(m - pa, SAFE_EXPONENT))
    scores = jnp.where(causal, _mm("...tk,...sk->...ts", q, k), 0.0)  # [..., C, C]
    if pc is None:
        return _mm("...ts,...sv->...tv", scores, v)
    m = pc[..., mid : mid + 1, :]
    v = v * jnp.exp(jnp.minimum(m - pc, SAFE_EXPONENT))
    return _mm("...ts,...sv->...tv", scores, v) * jnp.exp(jnp.minimum(pc - m, SAFE_EXPONENT))


def _fits(pa: jax.Array | None, pc: jax.Array | None) -> jax.Array:
    """Whether the chunked form is exact for gates with these prefix sums: inside every chunk, each prefix
    sum is within ``SAFE_EXPONENT`` of the middle one, and the middle one itself is (so every prefix sum
    is below 2 ``SAFE_EXPONENT`` and differences of them lose no significant bits)."""
    ok = jnp.asarray(True)
    for p in (pa, pc):
        if p is not None:
            mid = p.shape[-2] // 2 - 1
            m = p[..., mid : mid + 1, :]
            ok &= (jnp.max(jnp.abs(p - m)) <= SAFE_EXPONENT) & (jnp.max(jnp.abs(m)) <= SAFE_EXPONENT)
    return ok


def _tame(p: jax.Array | None, fits: jax.Array) -> jax.Array | None:
    return None if p is None else jnp.where(fits, p, 0.0)


def _chunks(q, k, v, pa, pc, h0, plan, chunk):
    """The chunked form: ``q``, ``k``, ``v`` ``[B, L, H, D]`` (L a multiple of ``chunk``), the gates as their
    prefix sums inside each chunk ``[B, H, L / C, C, D]`` (``_prefix``)."""
    b, length, h, _ = q.shape
    dv = v.shape[-1]
    q, k, v = _blocks(q, chunk), _blocks(k, chunk), _blocks(v, chunk)

    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    o = _intra(q, k, v, pa, pc, causal)

    # What each chunk adds to the state, and by how much it decays the state it was entered with.
    k_in, v_in = k, v
    decay_k = decay_v = None
    # The suffix sums (after token s) are P_L - P_s: exact enough, every |P| being small (``_fits``).
    if pa is not None:
        k_in = k * jnp.exp(pa[..., -1:, :] - pa)
        decay_k = jnp.exp(pa[..., -1, :])  # [B, H, NC, K|1]
    if pc is not None:
        v_in = v * jnp.exp(pc[..., -1:, :] - pc)
        decay_v = jnp.exp(pc[..., -1, :])
    update = _mm("bhnck,bhncv->bhnkv", k_in, v_in)  # [B, H, NC, K, V]

    restart = None
    if plan is not None:  # the initial state of the sequence each chunk starts, [NC, 1, H, K, V]
        restart = (plan.reset, h0[plan.seq][:, None])

    def step(state, x):
        dk_n, dv_n, u_n, r_n = x
        if r_n is not None:
            state = jnp.where(r_n[0], r_n[1], state)
        entered = state
        if dk_n is not None:
            state = dk_n[..., :, None] * state
        if dv_n is not None:
            state = state * dv_n[..., None, :]
        return state + u_n, entered

    def chunk_major(x):
        return None if x is None else jnp.moveaxis(x, 2, 0)

    state0 = h0 if plan is None else jnp.zeros((1, *h0.shape[1:]), F32)
    xs = (chunk_major(decay_k), chunk_major(decay_v), chunk_major(update), restart)
    state, entered = lax.scan(step, state0, xs)
    entered = jnp.moveaxis(entered, 0, 2)  # [B, H, NC, K, V]: the state each chunk starts from

    q_in = q if pa is None else q * jnp.exp(pa)
    o_inter = _mm("bhnck,bhnkv->bhncv", q_in, entered)
    if pc is not None:
        o_inter = o_inter * jnp.exp(pc)
    o = (o + o_inter).transpose(0, 2, 3, 1, 4).reshape(b, length, h, dv)

    if plan is None:
        return o, state
    # Final state of each sequence: its last chunk's entered state, carried through that chunk.
    last = plan.last
    final = jnp.moveaxis(entered[0][:, last], 1, 0)  # [N, H, K, V]
    if decay_k is not None:
        final = jnp.moveaxis(decay_k[0][:, last], 1, 0)[..., :, None] * final
    if decay_v is not None:
        final = final * jnp.moveaxis(decay_v[0][:, last], 1, 0)[..., None, :]
    final = final + jnp.moveaxis(update[0][:, last], 1, 0)
    return o, jnp.where(plan.nonempty[:, None, None, None], final, h0)


# ---- entry point ----------------------------------------------------------------------------------


def _run(opts: Options, chunk: int, q, k, v, a, c, h0, cu_seqlens):
    b, t, _, _ = q.shape
    plan = None
    if cu_seqlens is not None:
        plan, n_chunks = _varlen_plan(cu_seqlens, t, chunk, opts.reverse)
        length = n_chunks * chunk
    else:
        length = -(-t // chunk) * chunk
    qp, kp, vp, ap, cp = (_pack(x, length, opts.reverse, plan) for x in (q.astype(F32) * opts.scale, k, v, a, c))
    n = b if plan is None else plan.last.shape[0]
    h0 = jnp.zeros((n, *q.shape[2:], v.shape[-1]), F32) if h0 is None else h0.astype(F32)
    meta = _step_meta(plan, length, chunk)
    if chunk == 1:
        o, final = _steps(qp, kp, vp, ap, cp, h0, meta)
    elif a is None and c is None:
        o, final = _chunks(qp, kp, vp, None, None, h0, plan, chunk)
    else:
        pa, pc = _prefix(_blocks(ap, chunk)), _prefix(_blocks(cp, chunk))
        fits = _fits(pa, pc)
        # The chunked form runs outside the cond: XLA:CPU runs a conditional's branches without the
        # parallelism it gives top-level ops (measured: 2.2x slower forward and backward at T=4096).
        # Gates too strong for it take the cond's step-by-step branch, exact for any gates; the chunked
        # form then runs on zero gates so that it stays finite even for -inf gates (its cotangent is zero
        # there, and 0 * inf would be NaN).
        o, final = _chunks(qp, kp, vp, _tame(pa, fits), _tame(pc, fits), h0, plan, chunk)
        o, final = lax.cond(fits, lambda: (o, final), lambda: _steps(qp, kp, vp, ap, cp, h0, meta))
    o = _unpack(o, t, opts.reverse, plan).astype(q.dtype)
    return o, (final if opts.output_final_state else None)


# Compiled as a whole (also when called eagerly: a scan or cond outside jit would compile at every call).
_run_jit = jax.jit(_run, static_argnums=(0, 1))


def _arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """NumPy inputs (``jax.test_util.check_grads`` passes them) as JAX arrays."""
    return tuple(None if x is None else jnp.asarray(x) for x in arrays)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def linear_attention(opts: Options, q, k, v, a, c, h0, cu_seqlens):
    """``(o [B, T, H, V] in q's dtype, final state [B|N, H, K, V] float32 or None)``; see the module docstring.

    Differentiable in ``q``, ``k``, ``v``, ``a``, ``c`` and ``h0``.
    """
    return _run_jit(opts, opts.fwd_chunk, *_arrays((q, k, v, a, c, h0, cu_seqlens)))


def _fwd(opts: Options, *primals: Any) -> tuple[Any, Any]:
    *diff, cu_seqlens = _arrays(primals)
    if opts.bwd_chunk == opts.fwd_chunk:  # keep the forward's residuals: no second forward in the backward
        out, vjp = jax.vjp(lambda *x: _run_jit(opts, opts.fwd_chunk, *x, cu_seqlens), *diff)
        return out, (vjp, None)
    return _run_jit(opts, opts.fwd_chunk, *diff, cu_seqlens), (None, (*diff, cu_seqlens))


def _bwd(opts: Options, res: Any, cotangent: Any) -> tuple[Any, ...]:
    vjp, arrays = res
    if vjp is None:  # another chunk size for the backward: recompute the forward with it
        *diff, cu_seqlens = arrays
        _, vjp = jax.vjp(lambda *x: _run_jit(opts, opts.bwd_chunk, *x, cu_seqlens), *diff)
    return (*vjp(cotangent), None)


linear_attention.defvjp(_fwd, _bwd)
