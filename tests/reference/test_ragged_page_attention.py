"""The ``ragged_page_attention`` reference on cases worked out by hand.

Zero queries and keys give uniform attention: a row's output is the mean of the values it admits. Token
``j`` of sequence ``n`` holds the value ``100 * n + j``, so causal means are plain arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

# Compiled whole: eager op-by-op dispatch would compile every small op separately, which is slower.
ragged_page_attention = jax.jit(
    reference.ragged_page_attention, static_argnames=("softmax_scale", "logits_soft_cap", "sliding_window")
)

PAGE = 2


def cache(tables: list[list[int]], num_pages: int) -> jnp.ndarray:
    c = np.full((num_pages, PAGE, 1, 1), 1000.0, np.float32)
    for n, row in enumerate(tables):
        for i, p in enumerate(row):
            if p >= 0:
                c[p, :, 0, 0] = 100 * n + i * PAGE + np.arange(PAGE)
    return jnp.asarray(c)


TABLES = [[3, 0, 5], [1, 4, -1], [2, -1, -1]]
V = cache(TABLES, 6)
K = jnp.zeros_like(V)


def run(q_lens: list[int], kv_lens: list[int], num_seqs: int, t: int, **kw: object) -> list[float]:
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    out = ragged_page_attention(jnp.zeros((t, 1, 1)), K, V, jnp.array(kv_lens), jnp.array(TABLES), cu,
                                jnp.array([num_seqs]), **kw)  # fmt: skip
    return out[:, 0, 0].tolist()


def test_prefill_is_causal_and_decode_sees_its_whole_context():
    # Sequence 0: prefill of 3 (positions 0, 1, 2); sequence 1: decode at position 3; sequence 2: idle.
    # Row means: mean(0) = 0, mean(0, 1) = 0.5, mean(0..2) = 1; 100 + mean(0..3) = 101.5; then padding.
    assert run([3, 1, 0], [3, 4, 1], 3, t=6) == [0.0, 0.5, 1.0, 101.5, 0.0, 0.0]


def test_chunked_prefill_queries_are_the_last_tokens():
    # Sequence 0 has 5 tokens, the last 2 are queries (positions 3, 4): mean(0..3) = 1.5, mean(0..4) = 2.
    assert run([2, 0, 0], [5, 0, 0], 1, t=2) == [1.5, 2.0]


def test_rows_of_sequences_past_num_seqs_are_zeros():
    assert run([1, 2, 0], [2, 3, 0], 1, t=3) == [0.5, 0.0, 0.0]


def test_sliding_window():
    # Window 2: positions 0, 1, 2 of sequence 0 see (0), (0, 1), (1, 2); sequence 1 at position 3 sees (2, 3).
    assert run([3, 1, 0], [3, 4, 1], 2, t=4, sliding_window=2) == [0.0, 0.5, 1.5, 102.5]
