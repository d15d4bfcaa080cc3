"""Mosaic TPU gated linear attention kernels: a chunked forward and its backward, one ``pallas_call`` each.

Layout: rows lead, ``q``/``k``/``g`` ``[R, L, K]`` and ``v`` ``[R, L, V]`` with ``R = B * H`` (or ``H`` for
packed sequences, B being 1) and ``L`` a multiple of the chunk ``C``; initial and final states float32
``[N * R, K, V]`` (N = 1 without packing), the state of row ``r``'s sequence ``seq`` at ``seq * R + r``. The grid is ``(R, L / C)``: rows are independent
("parallel"), chunks are visited in order ("arbitrary") with the ``[K, V]`` float32 state in a VMEM scratch.

Per chunk, with ``P`` the prefix sums of the log gates inside the chunk (token t included; one matmul
with a triangle of ones), ``P_L`` the chunk's total, ``q' = scale q`` and ``S_in`` the state entered::

    o      = A v + (q' * exp(P)) S_in            A[t, s] = sum_i q'_t,i k_s,i exp(P_t,i - P_s,i), s <= t
    S_out  = exp(P_L)[:, None] S_in + (k * exp(P_L - P))^T v

Every exponent above is <= 0 (gates are log decays), so nothing overflows whatever the gates. ``A`` needs
care: factoring ``exp(P_t - P_s)`` as ``exp(P_t) exp(-P_s)`` overflows for strong gates. It is built from
sub-blocks of ``SUB`` rows: the pairs of two different sub-blocks are one matmul around a reference
prefix sum that lies between them (``exp(P_t - r) exp(r - P_s)``, both factors <= 1); the pairs inside a
sub-block are summed element by element (``SUB`` vector steps). That is exact for any gates ``<= 0``.
Prefix sums are kept in two parts (``Cumsum``) so that their differences stay accurate when strong gates
make the sums themselves large.

Packed sequences (``cu_seqlens``) are laid out by the caller so that each starts a chunk; scalar-prefetched
per-chunk ``flags`` (``RESET``: load the sequence's initial state; ``LAST``: its last chunk) and ``seq``
(which sequence) steer the state; index maps fetch and write the state of sequence ``seq`` directly.

The backward sweeps the chunks in reverse, carrying ``dS`` (the gradient of the state leaving the chunk)
in VMEM, from the states entering each chunk that the forward saved (``[R, L / C, K, V]``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
LANES = 128
SUB = 16  # rows of a sub-block of the intra-chunk products (the bfloat16 sublane tile)
RESET, LAST = 1, 2  # bits of a chunk's flags
GRID_BITS = 8  # gates are split into multiples of 2^-GRID_BITS and a rest (see Cumsum)

NN = ((1,), (0,))  # x @ y
NT = ((1,), (1,))  # x @ y^T
TN = ((0,), (0,))  # x^T @ y


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static description of one call: the chunk length and the query scale."""

    chunk: int
    scale: float

    @property
    def sub(self) -> int:
        return min(self.chunk, SUB)


def _dot(x: Any, y: Any, dims: Any) -> Any:
    return lax.dot_general(x, y, (dims, ((), ())), precision=HIGHEST, preferred_element_type=F32)


def _iota(shape: tuple[int, int], axis: int) -> Any:
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _row(x: Any, i: Any) -> Any:
    """Row ``i`` (static or traced) of ``x`` as ``[1, D]``: a masked sum (exact; no unaligned sublane slice)."""
    return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def _col(x: Any, j: Any) -> Any:
    """Column ``j`` of ``x`` as ``[R, 1]`` (a masked sum)."""
    return jnp.sum(jnp.where(_iota(x.shape, 1) == j, x, 0.0), axis=1, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Cumsum:
    """Prefix sums of a chunk's log gates (token t included) as ``hi + lo`` ``[C, K]``.

    ``hi`` sums the gates rounded down to multiples of ``2^-GRID_BITS``: exactly, in any order (the MXU's
    too), while the sums stay below ``2^(24 - GRID_BITS)``; ``lo`` sums the small rests. A difference of two
    prefix sums (``a - b``, what every decay here is the exponential of) is then as accurate as the gates
    between the two tokens, however large strong gates make the sums themselves: one float32 sum of them
    would lose ``|P| * 2^-24`` of every exponent, 1e-4 relative error per decay at ``|P| ~ 1000``.
    """

    hi: Any
    lo: Any

    def rows(self, start: int, stop: int) -> Cumsum:
        return Cumsum(self.hi[start:stop], self.lo[start:stop])

    def row(self, i: Any) -> Cumsum:
        return Cumsum(_row(self.hi, i), _row(self.lo, i))

    def total(self) -> Any:
        return self.hi + self.lo

    def __sub__(self, other: Cumsum) -> Any:
        return (self.hi - other.hi) + (self.lo - other.lo)


def _gates(g: Any) -> tuple[Cumsum, Cumsum, Any]:
    """``(P, P_L = P[C - 1], exp(P_L) [K, 1])`` of a chunk's log gates ``g [C, K]`` (float32)."""
    c = g.shape[0]
    g_hi = jnp.floor(g * float(2**GRID_BITS)) * float(2**-GRID_BITS)
    tril = jnp.where(_iota((c, c), 0) >= _iota((c, c), 1), 1.0, 0.0)
    p = Cumsum(_dot(tril, g_hi, NN), _dot(tril, g - g_hi, NN))
    last = jnp.where(_iota((c, LANES), 0) == c - 1, 1.0, 0.0)  # P_L as a column: one-hot products, exact
    p_last_col = _dot(p.hi, last, TN)[:, :1] + _dot(p.lo, last, TN)[:, :1]
    return p, p.row(c - 1), jnp.exp(p_last_col)


def _scores(geo: Geometry, q: Any, k: Any, p: Cumsum, a_ref: Any) -> None:
    """``a_ref[t, s] = sum_i q[t, i] k[s, i] exp(p[t, i] - p[s, i])`` for ``s <= t``, else 0. ``[C, C]``."""
    c, sub = geo.chunk, geo.sub
    lane, row = _iota((sub, c), 1), _iota((sub, c), 0)
    for i in range(c // sub):
        lo = i * sub
        q_i, k_i, p_i = q[lo : lo + sub], k[lo : lo + sub], p.rows(lo, lo + sub)  # [SUB, K]
        b_a = jnp.zeros((sub, c), F32)
        if i > 0:  # earlier sub-blocks: around r = P just before this sub-block (both factors <= 1)
            r = p.row(lo - 1)
            k_r = k * jnp.exp(jnp.minimum(r - p, 0.0))  # rows >= lo are clamped, then masked
            b_a = jnp.where(lane < lo, _dot(q_i * jnp.exp(p_i - r), k_r, NT), 0.0)

        def diagonal(s: Any, b_a: Any, lo: int = lo, q_i: Any = q_i, k_i: Any = k_i, p_i: Cumsum = p_i) -> Any:
            decay = jnp.exp(jnp.minimum(p_i - p_i.row(s), 0.0))  # rows t < s are masked below
            col = jnp.sum(q_i * _row(k_i, s) * decay, axis=1, keepdims=True)  # [SUB, 1]
            return jnp.where((lane == lo + s) & (row >= s), col, b_a)

        a_ref[lo : lo + sub, :] = lax.fori_loop(0, sub, diagonal, b_a)


def _left(geo: Geometry, w_ref: Any, b: Any, p: Cumsum, out_ref: Any) -> None:
    """``out[t] = sum_{s <= t} w[t, s] b[s] exp(p[t] - p[s])`` (``w`` lower triangular ``[C, C]``). ``[C, D]``."""
    c, sub = geo.chunk, geo.sub
    lane = _iota((sub, c), 1)
    for i in range(c // sub):
        lo = i * sub
        w_i, b_i, p_i = w_ref[lo : lo + sub, :], b[lo : lo + sub], p.rows(lo, lo + sub)
        acc = jnp.zeros(b_i.shape, F32)
        if i > 0:
            r = p.row(lo - 1)
            b_r = b * jnp.exp(jnp.minimum(r - p, 0.0))
            acc = _dot(jnp.where(lane < lo, w_i, 0.0), b_r, NN) * jnp.exp(p_i - r)

        def diagonal(s: Any, acc: Any, lo: int = lo, w_i: Any = w_i, b_i: Any = b_i, p_i: Cumsum = p_i) -> Any:
            decay = jnp.exp(jnp.minimum(p_i - p_i.row(s), 0.0))
            return acc + _col(w_i, lo + s) * _row(b_i, s) * decay

        out_ref[lo : lo + sub, :] = lax.fori_loop(0, sub, diagonal, acc)


def _right(geo: Geometry, wt_ref: Any, a: Any, p: Cumsum, out_ref: Any) -> None:
    """``out[s] = sum_{t >= s} w[t, s] a[t] exp(p[t] - p[s])``, given ``wt = w^T`` (upper triangular). ``[C, D]``."""
    c, sub = geo.chunk, geo.sub
    lane = _iota((sub, c), 1)
    for j in range(c // sub):
        lo, hi = j * sub, (j + 1) * sub
        w_j, a_j, p_j = wt_ref[lo:hi, :], a[lo:hi], p.rows(lo, hi)
        acc = jnp.zeros(a_j.shape, F32)
        if hi < c:  # later sub-blocks: around r = P at the end of this sub-block
            r = p.row(hi - 1)
            a_r = a * jnp.exp(jnp.minimum(p - r, 0.0))
            acc = _dot(jnp.where(lane >= hi, w_j, 0.0), a_r, NN) * jnp.exp(r - p_j)

        def diagonal(t: Any, acc: Any, lo: int = lo, w_j: Any = w_j, a_j: Any = a_j, p_j: Cumsum = p_j) -> Any:
            decay = jnp.exp(jnp.minimum(p_j.row(t) - p_j, 0.0))
            return acc + _col(w_j, lo + t) * _row(a_j, t) * decay

        out_ref[lo:hi, :] = lax.fori_loop(0, sub, diagonal, acc)


def _compiler_params(interpret: Any) -> Any:
    if interpret:
        # JAX's TPU interpreter does not extend dimension_semantics by the grid axes that vmap prepends.
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


# ----------------------------------------------------------------------------------------- forward


def _fwd_kernel(
    geo: Geometry,
    save: bool,
    flags_ref: Any,
    seq_ref: Any,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    g_ref: Any,
    h0_ref: Any,
    o_ref: Any,
    ht_ref: Any,
    *refs: Any,
) -> None:
    hs_ref, (state_sc, a_sc) = (refs[0], refs[1:]) if save else (None, refs)
    n = pl.program_id(1)

    @pl.when((flags_ref[n] & RESET) != 0)
    def _start() -> None:
        state_sc[...] = h0_ref[0]

    s_in = state_sc[...]  # [K, V]
    if hs_ref is not None:
        hs_ref[0, 0] = s_in
    b_q = q_ref[0].astype(F32) * geo.scale  # [C, K]
    b_k = k_ref[0].astype(F32)
    b_v = v_ref[0].astype(F32)  # [C, V]
    b_p, p_last, decay = _gates(g_ref[0])

    _scores(geo, b_q, b_k, b_p, a_sc)
    b_o = _dot(a_sc[...], b_v, NN) + _dot(b_q * jnp.exp(b_p.total()), s_in, NN)
    o_ref[0] = b_o.astype(o_ref.dtype)

    s_out = decay * s_in + _dot(b_k * jnp.exp(p_last - b_p), b_v, TN)
    state_sc[...] = s_out
    # Written at every chunk: the last chunk of the sequence writes last (the block is its sequence's).
    ht_ref[0] = s_out


def forward(
    geo: Geometry, flags: Any, seq: Any, q: Any, k: Any, v: Any, g: Any, h0: Any, save: bool, interpret: Any
) -> Any:
    """``(o [R, L, V], final states [N * R, K, V] f32[, states entering each chunk [R, L / C, K, V] f32])``.

    ``g`` is float32; ``h0`` ``[N * R, K, V]`` float32. The final state of a sequence no chunk belongs to
    (empty) is not written.
    """
    rows, length, dk = q.shape
    dv = v.shape[-1]
    c = geo.chunk
    n_chunks = length // c

    def tokens(width: int) -> Any:
        return pl.BlockSpec((1, c, width), lambda r, n, flags, seq: (r, n, 0))

    state = pl.BlockSpec((1, dk, dv), lambda r, n, flags, seq: (seq[n] * rows + r, 0, 0))
    out_specs = [tokens(dv), state]
    out_shape = [jax.ShapeDtypeStruct((rows, length, dv), q.dtype), jax.ShapeDtypeStruct(h0.shape, F32)]
    if save:
        out_specs.append(pl.BlockSpec((1, 1, dk, dv), lambda r, n, flags, seq: (r, n, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((rows, n_chunks, dk, dv), F32))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, geo, save),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(rows, n_chunks),
            in_specs=[tokens(dk), tokens(dk), tokens(dv), tokens(dk), state],
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((dk, dv), F32), pltpu.VMEM((c, c), F32)],
        ),
        out_shape=out_shape,
        compiler_params=_compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_gla_fwd",
    )(flags, seq, q, k, v, g, h0)


# ---------------------------------------------------------------------------------------- backward


def _bwd_kernel(
    geo: Geometry,
    flags_ref: Any,
    seq_ref: Any,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    g_ref: Any,
    do_ref: Any,
    hs_ref: Any,
    dht_ref: Any,
    dq_ref: Any,
    dk_ref: Any,
    dv_ref: Any,
    dg_ref: Any,
    dh0_ref: Any,
    ds_sc: Any,
    a_sc: Any,
    w_sc: Any,
    wt_sc: Any,
    dq_sc: Any,
    dk_sc: Any,
) -> None:
    i = pl.program_id(1)
    flags = flags_ref[pl.num_programs(1) - 1 - i]  # chunks are visited last to first
    c = geo.chunk

    @pl.when(i == 0)
    def _start() -> None:
        ds_sc[...] = jnp.zeros(ds_sc.shape, F32)

    # dS: gradient of the state leaving this chunk (the carried one, plus the final state's at a sequence end).
    @pl.when((flags & LAST) != 0)
    def _sequence_end() -> None:
        ds_sc[...] += dht_ref[0]

    ds_out = ds_sc[...]  # [K, V]
    s_in = hs_ref[0, 0]
    b_q = q_ref[0].astype(F32) * geo.scale
    b_k = k_ref[0].astype(F32)
    b_v = v_ref[0].astype(F32)
    b_do = do_ref[0].astype(F32)
    b_p, p_last, decay = _gates(g_ref[0])
    rows, cols = _iota((c, c), 0), _iota((c, c), 1)

    _scores(geo, b_q, b_k, b_p, a_sc)
    # dA without its diagonal (the pairs s = t, added below): they change no gate's gradient, and keeping
    # them out of dP avoids a cancellation of undecayed terms that strong gates make large against dg.
    w_sc[...] = jnp.where(rows > cols, _dot(b_do, b_v, NT), 0.0)  # dA, strictly lower
    wt_sc[...] = jnp.where(cols > rows, _dot(b_v, b_do, NT), 0.0)  # its transpose
    da_diag = jnp.sum(b_do * b_v, axis=1, keepdims=True)  # [C, 1]
    b_kd = b_k * jnp.exp(p_last - b_p)  # keys decayed to the chunk's end

    b_dv = _dot(a_sc[...], b_do, TN) + _dot(b_kd, ds_out, NN)
    _left(geo, w_sc, b_k, b_p, dq_sc)
    b_dq = dq_sc[...] + jnp.exp(b_p.total()) * _dot(b_do, s_in, NT)  # w.r.t. q' = scale q, diagonal pairs aside
    _right(geo, wt_sc, b_q, b_p, dk_sc)
    b_dk_intra = dk_sc[...]
    b_dk_inter = jnp.exp(p_last - b_p) * _dot(b_v, ds_out, NT)

    # Gates: P_t enters as exp(P_t) on q'_t and exp(-P_t) on k_t, and g_u feeds every P_t with t >= u: a pair
    # (t, s) of the chunk reaches g_u for s < u <= t only. The state leaving the chunk holds
    # exp(P_L) S_in (every g_u of the chunk) and k_s exp(P_L - P_s) v_s (the g_u with u > s).
    b_dg = _dot(jnp.where(cols >= rows, 1.0, 0.0), b_q * b_dq - b_k * b_dk_intra, NN)
    b_dg += _dot(jnp.where(cols < rows, 1.0, 0.0), b_k * b_dk_inter, NN)
    b_dg += _dot(jnp.ones((8, s_in.shape[1]), F32), ds_out * (decay * s_in), NT)[:1]  # [1, K], every row

    ds_in = decay * ds_out + _dot(b_q * jnp.exp(b_p.total()), b_do, TN)
    # Written at every chunk: a sequence's first chunk comes last, and there dS_in is d initial_state.
    dh0_ref[0] = ds_in
    ds_sc[...] = ds_in

    @pl.when((flags & RESET) != 0)
    def _sequence_start() -> None:  # the state entering a sequence's first chunk is its initial state
        ds_sc[...] = jnp.zeros(ds_sc.shape, F32)

    dq_ref[0] = ((b_dq + da_diag * b_k) * geo.scale).astype(dq_ref.dtype)
    dk_ref[0] = (b_dk_intra + b_dk_inter + da_diag * b_q).astype(dk_ref.dtype)
    dv_ref[0] = b_dv.astype(dv_ref.dtype)
    dg_ref[0] = b_dg


def backward(
    geo: Geometry,
    flags: Any,
    seq: Any,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    do: Any,
    hs: Any,
    dht: Any,
    interpret: Any,
) -> Any:
    """``(dq, dk [R, L, K], dv [R, L, V], dg [R, L, K] f32, d initial states [N * R, K, V] f32)``.

    ``hs``: the states entering each chunk (``forward(save=True)``); ``dht``: the gradient of the final
    states. The initial-state gradient of an empty sequence is not written.
    """
    rows, length, dk = q.shape
    dv = v.shape[-1]
    c = geo.chunk
    n_chunks = length // c

    def rev(n: Any) -> Any:
        return n_chunks - 1 - n

    def tokens(width: int) -> Any:
        return pl.BlockSpec((1, c, width), lambda r, n, flags, seq: (r, rev(n), 0))

    state = pl.BlockSpec((1, dk, dv), lambda r, n, flags, seq: (seq[rev(n)] * rows + r, 0, 0))
    return pl.pallas_call(
        functools.partial(_bwd_kernel, geo),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(rows, n_chunks),
            in_specs=[
                tokens(dk),
                tokens(dk),
                tokens(dv),
                tokens(dk),
                tokens(dv),
                pl.BlockSpec((1, 1, dk, dv), lambda r, n, flags, seq: (r, rev(n), 0, 0)),
                state,
            ],
            out_specs=[tokens(dk), tokens(dk), tokens(dv), tokens(dk), state],
            scratch_shapes=[
                pltpu.VMEM((dk, dv), F32),
                pltpu.VMEM((c, c), F32),
                pltpu.VMEM((c, c), F32),
                pltpu.VMEM((c, c), F32),
                pltpu.VMEM((c, dk), F32),
                pltpu.VMEM((c, dk), F32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(g.shape, F32),
            jax.ShapeDtypeStruct(dht.shape, F32),
        ],
        compiler_params=_compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_gla_bwd",
    )(flags, seq, q, k, v, g, do, hs, dht)
