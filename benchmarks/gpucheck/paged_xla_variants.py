"""The XLA ``page_attention`` fallback's key-block update in several formulations, timed on a GPU against the naive
gather + dense attention (the serving issue's goal: XLA >= gather), at N64 H32 K8 D128 L4096 pages of 16 bf16 and
N256 x 1024. Each variant replaces ``ejkernel_xla._paged.update`` (the fold of one gathered key block into the online
softmax) and is checked against the current one first:

- ``base``: today's (two dot_generals over the gathered block; the values at non-key positions zeroed in blocks
  past the shortest length);
- ``mask-all``: the same, zeroing the values of every block (the form before 2026-12-04);
- ``reduce``: products and sums as elementwise ops and reductions (XLA may fuse the gather into them: one read);
- ``blockdiag``: one matmul per sequence over all kv heads at once ([K*G, D] x [bk*K, D]^T, the off-diagonal
  head pairs discarded; the value product with the probabilities spread block-diagonally), so that no gathered
  block is transposed; ``blockdiag-nomask`` likewise without the value mask;
- ``steps-x4`` / ``steps-x0.25``: today's update with the accelerator budget (``_paged.ACCELERATOR_BUDGET``, the
  gathered block's elements) four times larger (at N64 x 4096: one step of 4096 keys, as the gather) or smaller;
- ``direct`` / ``direct-nomask``: not an update but the whole call without a loop (every page gathered at once,
  today's update applied once from the empty state), with and without the zeroing of the values past each length:
  whether the loop (a while loop of dynamic bounds, its carried state) is what keeps ``steps-x4`` below the gather,
  which is the same gather and the same two products.

Run on the GPU machine after ``bash .ci/gpu setup``: ``PYTHONPATH=/tmp/ejk-site python3
benchmarks/gpucheck/paged_xla_variants.py``. ``--small``: tiny shapes on a CPU (a dry run).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_ms  # benchmarks/gpucheck/_timing.py (the script's folder is on sys.path)

from ejkernel_xla import _paged
from ejkernel_xla.page_attention.interface import page_attention

F32 = jnp.float32
SMALL = "--small" in sys.argv
BASE = _paged.update


def _softmax_step(o, state, s, allowed):
    m, l, acc = state
    if o.soft_cap is not None:
        s = F32(o.soft_cap) * jnp.tanh(s / F32(o.soft_cap))
    s = jnp.where(allowed[:, None, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    return m_new, alpha * l + p.sum(axis=-1), acc * alpha[..., None], p


def mask_all(o, state, q, k, v, allowed, key_ok):
    key_ok = allowed.any(axis=1) if key_ok is None else key_ok  # decode rows: the keys are those admitted
    return BASE(o, state, q, k, v, allowed, key_ok)


def _vmask(v, key_ok):
    return v if key_ok is None else jnp.where(key_ok[:, :, None, None], v, jnp.zeros((), v.dtype))


def reduce(o, state, q, k, v, allowed, key_ok):
    kt = k.astype(F32).transpose(0, 2, 1, 3)[:, :, None, None]  # [C, K, 1, 1, bk, D]
    s = jnp.sum(q.astype(F32)[:, :, :, :, None, :] * kt, axis=-1) * F32(o.scale)  # [C, K, G, R, bk]
    m, l, acc, p = _softmax_step(o, state, s, allowed)
    vt = _vmask(v, key_ok).astype(F32).transpose(0, 2, 1, 3)[:, :, None, None]
    p = p.astype(q.dtype).astype(F32)  # as the dots round p
    return m, l, acc + jnp.sum(p[..., None] * vt, axis=-2)


def _blockdiag(mask_v):
    def update(o, state, q, k, v, allowed, key_ok):
        c, kh, g, r, d = q.shape
        bk, dv = k.shape[1], v.shape[-1]
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        qf = q.transpose(0, 3, 1, 2, 4).reshape(c, r * kh * g, d)  # rows (r, k, g)
        sf = jnp.einsum("cid,cjd->cij", qf, k.reshape(c, bk * kh, d), preferred_element_type=F32)
        sf = sf.reshape(c, r, kh, g, bk, kh)
        s = jnp.diagonal(sf, axis1=2, axis2=5).transpose(0, 4, 2, 1, 3) * F32(o.scale)  # [C, K, G, R, bk]
        m, l, acc, p = _softmax_step(o, state, s, allowed)
        eye = jnp.eye(kh, dtype=bool)[None, None, :, None, None, :]
        pf = jnp.where(eye, p.transpose(0, 3, 1, 2, 4)[..., None], 0.0).astype(v.dtype)  # [C, R, K, G, bk, K']
        if mask_v:
            v = _vmask(v, key_ok)
        pv = jnp.einsum("cij,cjd->cid", pf.reshape(c, r * kh * g, bk * kh), v.reshape(c, bk * kh, dv),
                        preferred_element_type=F32)  # fmt: skip
        return m, l, acc + pv.reshape(c, r, kh, g, dv).transpose(0, 2, 3, 1, 4)

    return update


VARIANTS = {"base": BASE, "mask-all": mask_all, "reduce": reduce, "blockdiag": _blockdiag(True),
            "blockdiag-nomask": _blockdiag(False), "steps-x4": BASE, "steps-x0.25": BASE}  # fmt: skip
BUDGET = _paged.ACCELERATOR_BUDGET


def _budget(name):
    if not name.startswith("steps-x"):
        return BUDGET
    f = float(name[len("steps-x") :])
    return dataclasses.replace(
        BUDGET, kv_elements=int(BUDGET.kv_elements * f), tile_elements=int(BUDGET.tile_elements * f)
    )


def gathered(q, kc, vc, lens, tables):
    n, per_seq = tables.shape
    k = kc[tables].reshape(n, per_seq * kc.shape[1], *kc.shape[2:])
    v = vc[tables].reshape(n, per_seq * vc.shape[1], *vc.shape[2:])
    return jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lens, implementation="xla")[:, 0]


def _direct(mask_v):
    """The whole call as one ``_paged.update`` of every page from the empty state and ``_paged.finish``: today's
    arithmetic, no loop."""

    def call(q, kc, vc, lens, tables):
        n, h, d = q.shape
        kh, dv = kc.shape[2], vc.shape[-1]
        length = tables.shape[1] * kc.shape[1]
        key_ok = jnp.arange(length)[None, :] < lens[:, None]  # [N, L]
        state = _paged.update(
            _paged.options(d, None, None, None),
            _paged.init_state((n, kh, h // kh, 1), dv),
            _paged.heads_grouped(q[:, None], kh),
            kc[tables].reshape(n, length, kh, d),
            vc[tables].reshape(n, length, kh, dv),
            key_ok[:, None, :],
            key_ok if mask_v else None,
        )
        return _paged.heads_last(_paged.finish(state, q.dtype))[:, 0]

    return call


DIRECT = {"direct": _direct(True), "direct-nomask": _direct(False)}


def ms(f, *args):
    return median_ms(f, *args, n=15, warmup=1, reps=5)


def main():
    shapes = [(4, 8, 2, 32, 64, 16)] if SMALL else [(64, 32, 8, 128, 4096, 16), (256, 32, 8, 128, 1024, 16)]
    for n, h, kh, d, length, page in shapes:
        rng = np.random.default_rng(0)
        per = -(-length // page)
        bf = jnp.bfloat16
        q = jnp.asarray(rng.standard_normal((n, h, d)), bf)
        kc = jnp.asarray(rng.standard_normal((n * per, page, kh, d)), bf)
        vc = jnp.asarray(rng.standard_normal((n * per, page, kh, d)), bf)
        tables = jnp.asarray(rng.permutation(n * per).reshape(n, per), jnp.int32)
        for label, lens in (("full", np.full(n, length)), ("ragged", rng.integers(1, length + 1, n))):
            lens = jnp.asarray(lens, jnp.int32)
            args = (q, kc, vc, lens, tables)
            gbytes = 2 * n * length * kh * d * 2 / 1e9
            t_g = ms(jax.jit(gathered), *args)
            want = None
            print(f"N{n} H{h} K{kh} D{d} L{length} P{page} lens {label}: gather-xla {t_g:.3f} ms "
                  f"({gbytes / t_g:.2f} TB/s at full lengths)", flush=True)  # fmt: skip
            for name, fn in [*VARIANTS.items(), *DIRECT.items()]:
                _paged.update = BASE if name in DIRECT else fn
                _paged.ACCELERATOR_BUDGET = _budget(name)
                try:
                    f = jax.jit(DIRECT[name] if name in DIRECT else (lambda *a: page_attention(*a)))
                    got = f(*args).astype(F32)
                    if want is None:
                        want = got
                    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                    t = ms(f, *args)
                    print(f"  {name:17s} {t:7.3f} ms  {t_g / t:5.2f}x gather  rel err vs base {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name:17s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                finally:
                    _paged.update, _paged.ACCELERATOR_BUDGET = BASE, BUDGET


if __name__ == "__main__":
    main()
