"""What the softmax-attention conformance suites share: random ``q``, ``k``, ``v``, the cases and inputs of
``attention`` and ``flash_attention`` (one contract but the weights), the refusals every one of them makes,
and the check that rows without a key give zeros.

Layout: B batch, T query length, S key length, H query heads, K kv heads, D head dim, Dv value dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

# (id, make(q, k, v, ...) -> (args, kwargs), a regular expression the message matches)
BadInput = tuple[str, Callable[..., Any], str]


class Shapes(Protocol):
    """A case with the sizes of the layout (``dv`` None: equal to ``d``)."""

    @property
    def b(self) -> int: ...
    @property
    def t(self) -> int: ...
    @property
    def s(self) -> int: ...
    @property
    def h(self) -> int: ...
    @property
    def k(self) -> int: ...
    @property
    def d(self) -> int: ...
    @property
    def dv(self) -> int | None: ...


def qkv(case: Shapes, dtype: str, keys: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Standard normal ``q [B, T, H, D]``, ``k [B, S, K, D]``, ``v [B, S, K, Dv]`` (``Dv = D`` unless given)."""
    kq, kk, kv = keys
    q = jax.random.normal(kq, (case.b, case.t, case.h, case.d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (case.b, case.s, case.k, case.d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (case.b, case.s, case.k, case.dv or case.d), jnp.float32).astype(dtype)
    return q, k, v


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of ``attention`` or ``flash_attention``: shape plus options; ``arrays`` names extra array
    inputs the case builds (see ``make_inputs``)."""

    name: str
    b: int = 2
    t: int = 37  # deliberately not a multiple of any block size
    s: int = 53
    h: int = 4
    k: int = 2
    d: int = 32
    dv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    arrays: tuple[str, ...] = ()


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(q, k, v[, bias])`` and the options, with the extra arrays ``case.arrays`` names:

    - ``bias_full``: bias ``[B, H, T, S]``; ``bias_heads``: bias ``[1, H, T, S]`` (broadcast over the batch);
    - ``attention_mask``: bool ``[B, 1, T, S]``, row 3 of batch 0 masked whole;
    - ``segment_ids``: sorted ``q_segment_ids``/``kv_segment_ids``, the last query in segment 7, which has no key;
    - ``cu_seqlens``: three packed sequences (B must be 1), the middle one empty on the query side;
    - ``kv_lengths``: ``[B]`` key lengths, sequence 0 whole, the last one (B >= 3) without keys, the rest at random;
    - ``prefix_lengths``: ``[B]`` prefix-LM prefixes at random in ``[0, S]`` (the case sets ``causal``).
    """
    kq, kk, kv, kb, km = jax.random.split(key, 5)
    q, k, v = qkv(case, dtype, (kq, kk, kv))
    kwargs: dict[str, Any] = dict(case.options)
    bias = None
    for name in case.arrays:
        if name == "bias_full":
            bias = jax.random.normal(kb, (case.b, case.h, case.t, case.s), jnp.float32).astype(dtype)
        elif name == "bias_heads":
            bias = jax.random.normal(kb, (1, case.h, case.t, case.s), jnp.float32).astype(dtype)
        elif name == "attention_mask":
            mask = jax.random.bernoulli(km, 0.7, (case.b, 1, case.t, case.s))
            kwargs["attention_mask"] = mask.at[0, 0, 3, :].set(False)  # one fully masked row
        elif name == "segment_ids":
            qs = jnp.sort(jax.random.randint(km, (case.b, case.t), 0, 3), axis=-1)
            ks = jnp.sort(jax.random.randint(kb, (case.b, case.s), 0, 3), axis=-1)
            kwargs["q_segment_ids"], kwargs["kv_segment_ids"] = qs.at[:, -1].set(7), ks  # segment 7: no keys
        elif name == "cu_seqlens":
            kwargs["cu_seqlens_q"] = jnp.array([0, 17, 17, case.t], jnp.int32)
            kwargs["cu_seqlens_k"] = jnp.array([0, 20, 31, case.s], jnp.int32)
        elif name == "kv_lengths":
            lengths = jax.random.randint(km, (case.b,), 1, case.s + 1).at[0].set(case.s)
            kwargs["kv_lengths"] = lengths.at[-1].set(0) if case.b >= 3 else lengths
        elif name == "prefix_lengths":
            kwargs["prefix_lengths"] = jax.random.randint(kb, (case.b,), 0, case.s + 1)
        else:
            raise ValueError(f"unknown extra array {name!r}")
    args = (q, k, v) if bias is None else (q, k, v, bias)
    return args, kwargs


def bad_input_qkv() -> tuple[jax.Array, jax.Array, jax.Array]:
    """The valid ``q [2, 8, 4, 16]``, ``k = v [2, 8, 2, 16]`` the ``BAD_INPUTS`` tables spoil one thing of."""
    return jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 2, 16)), jnp.ones((2, 8, 2, 16))


# Refusals of every attention op taking ``(query, key, value, ...)``: ``(id, make(q, k, v) -> (args, kwargs),
# a regular expression the message matches)``.
QKV_BAD_INPUTS: list[BadInput] = [
    ("query_ndim", lambda q, k, v: ((q[0], k, v), {}), "query must be 4-D"),
    ("dtype_mismatch", lambda q, k, v: ((q, k.astype(jnp.bfloat16), v), {}), "must share a dtype"),
    ("int_query", lambda q, k, v: ((q.astype(jnp.int32), k, v), {}), "query must be float32, bfloat16 or float16"),
    ("heads", lambda q, k, v: ((q[:, :, :3], k, v), {}), "multiple of key/value heads"),
    ("head_dim", lambda q, k, v: ((q, k[..., :8], v), {}), "key head dim must equal query head dim"),
]

# Refusals of the options ``attention`` and ``flash_attention`` share.
FLASH_OPTION_BAD_INPUTS: list[BadInput] = [
    (
        "bias_shape",
        lambda q, k, v: ((q, k, v, jnp.zeros((2, 4, 5, 5))), {}),
        r"bias must have shape \[B\|1, H\|1, T\|1, S\]",
    ),
    (
        "mask_dtype",
        lambda q, k, v: ((q, k, v), {"attention_mask": jnp.ones((1, 1, 8, 8))}),
        "attention_mask must be bool",
    ),
    (
        "dropout_seed",
        lambda q, k, v: ((q, k, v), {"dropout_prob": 0.1, "dropout_seed": 0.5}),
        "dropout_seed must be an int or a scalar integer array",
    ),
    (
        "dropout_prob",
        lambda q, k, v: ((q, k, v), {"dropout_prob": 1.0, "dropout_seed": 0}),
        r"dropout_prob must be a float in \[0, 1\)",
    ),
    ("window", lambda q, k, v: ((q, k, v), {"sliding_window": (-1, 2)}), "sliding_window must be"),
    ("soft_cap", lambda q, k, v: ((q, k, v), {"logits_soft_cap": 0.0}), "logits_soft_cap must be a positive"),
]


def assert_rows_without_keys_are_zero(
    out: jax.Array, grads: Sequence[jax.Array], rows: Any, seed: int, *, what: str = "rows without keys"
) -> None:
    """Finite output and ``(dq, dk, dv)``; the output and ``dq`` exactly zero at ``out[rows]`` (an index into
    ``[B, T, ...]``, e.g. ``np.s_[:, [2, 5]]`` or a bool ``[B, T]``)."""
    assert np.all(np.isfinite(out)), f"NaN/inf in the output (seed {seed})"
    assert np.all(np.asarray(out)[rows] == 0), f"{what} must be exactly zero (seed {seed})"
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        assert np.all(np.isfinite(g)), f"{name} has NaN/inf (seed {seed})"
    assert np.all(np.asarray(grads[0])[rows] == 0), f"dq of {what} must be exactly zero (seed {seed})"
