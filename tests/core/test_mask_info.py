"""``MaskInfo`` and the interval form of the attention rules (``mask_intervals``), without any kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.kernels.signatures._attention import attention_allowed, mask_intervals
from ejkernel.modules import MaskInfo


def _dense_from_intervals(lo, hi, t, s):
    j = np.arange(s)[None, None, :]
    return (j >= np.asarray(lo)[:, :, None]) & (j < np.asarray(hi)[:, :, None])


@pytest.mark.parametrize("seed", range(16))
def test_intervals_are_exactly_the_rules(seed):
    """Row and column intervals admit exactly what ``attention_allowed`` admits, for random rule mixes."""
    rng = np.random.default_rng(seed)
    b, t, s = 3, int(rng.integers(1, 24)), int(rng.integers(1, 24))
    causal = bool(rng.integers(2))
    window = None if rng.integers(2) else (int(rng.integers(0, 8)), int(rng.integers(0, 8)))
    rules = dict(causal=causal, sliding_window=window)
    packed = rng.integers(3) == 0
    if packed:
        cuq = np.sort(rng.integers(0, t + 1, 4)).astype(np.int32)
        cuk = np.sort(rng.integers(0, s + 1, 4)).astype(np.int32)
        rules.update(cu_seqlens_q=jnp.asarray(cuq), cu_seqlens_k=jnp.asarray(cuk))
    else:
        if rng.integers(2):
            rules["kv_lengths"] = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
        if causal and rng.integers(2):
            rules["prefix_lengths"] = jnp.asarray(rng.integers(0, s + 1, b), jnp.int32)
    allowed = np.asarray(attention_allowed(t, s, **rules))
    allowed = np.broadcast_to(allowed, (b, t, s)) if allowed.ndim == 2 else allowed
    row_lo, row_hi, col_lo, col_hi = mask_intervals(t, s, **rules)
    nb = row_lo.shape[0]
    rows = np.broadcast_to(_dense_from_intervals(row_lo, row_hi, t, s), (b, t, s) if nb == 1 else (nb, t, s))
    cols = np.broadcast_to(_dense_from_intervals(col_lo, col_hi, s, t).transpose(0, 2, 1), rows.shape)
    np.testing.assert_array_equal(rows, np.broadcast_to(allowed, rows.shape), err_msg=f"rows, {rules}")
    np.testing.assert_array_equal(cols, np.broadcast_to(allowed, rows.shape), err_msg=f"columns, {rules}")
    # Empty rows/keys are normalized so that they never widen a kernel's block range.
    row_lo, row_hi, col_lo, col_hi = (np.asarray(x) for x in (row_lo, row_hi, col_lo, col_hi))
    assert ((row_lo == s) & (row_hi == 0) | (row_lo < row_hi)).all()
    assert ((col_lo == t) & (col_hi == 0) | (col_lo < col_hi)).all()


def test_mask_info_combines_rules():
    lengths, prefix = jnp.array([5, 3]), jnp.array([2, 0])
    mask = MaskInfo.from_lengths(lengths) & MaskInfo.prefix_lm(prefix) & MaskInfo.window((4, 1))
    assert mask.causal and mask.sliding_window == (4, 1)
    want = attention_allowed(6, 6, causal=True, sliding_window=(4, 1), kv_lengths=lengths, prefix_lengths=prefix)
    np.testing.assert_array_equal(mask.to_dense(6, 6)[:, 0], want)
    # Windows intersect, key lengths take the minimum.
    both = mask & MaskInfo(sliding_window=2, kv_lengths=jnp.array([4, 4]))
    assert both.sliding_window == (2, 1)
    np.testing.assert_array_equal(both.kv_lengths, [4, 3])


def test_mask_info_is_a_pytree():
    mask = MaskInfo.from_lengths(jnp.array([3, 1]), causal=True)
    leaves, tree = jax.tree.flatten(mask)
    assert len(leaves) == 1
    again = jax.tree.unflatten(tree, leaves)
    assert again.causal and again.kv_lengths is leaves[0]
    doubled = jax.jit(lambda m: m.kv_lengths * 2)(mask)
    np.testing.assert_array_equal(doubled, [6, 2])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MaskInfo(causal=1), "causal must be a bool"),
        (lambda: MaskInfo(q_segment_ids=jnp.zeros((1, 2), jnp.int32)), "pass both q_segment_ids"),
        (lambda: MaskInfo(prefix_lengths=jnp.array([1])), "prefix_lengths needs causal=True"),
        (lambda: MaskInfo.prefix_lm(jnp.array([1])) & MaskInfo.prefix_lm(jnp.array([2])), "both masks set"),
    ],
)
def test_mask_info_refuses_contradictions(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()
