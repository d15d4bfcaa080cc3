"""The XLA blockwise MLA: small blocks against the dense reference, block skipping, and its memory.

Block sizes divide nothing (T, S, lengths not multiples of the blocks; the dense last key block
overlaps its predecessor; paged blocks are whole pages), so partial blocks and skipping are all
exercised. Inputs are fresh each run; set ``EJKERNEL_TEST_SEED`` to the seed a failure names.
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams
from ejkernel.testing.reference import multi_head_latent_attention as reference

from ejkernel_xla.multi_head_latent_attention import default_blocks, multi_head_latent_attention
from ejkernel_xla.multi_head_latent_attention._blockwise import Options, _Geometry

SEED = int(os.environ.get("EJKERNEL_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
DL, DR = 16, 8

CASES: dict[str, dict] = {
    "dense_causal_t_lt_s": {"T": 13, "S": 29, "causal": True},
    "dense_causal_t_gt_s": {"T": 29, "S": 13, "causal": True},  # 16 rows see no key
    "dense_overlapping_last_block": {"T": 5, "S": 30, "blocks": (4, 8)},  # 30 = 3 * 8 + 6
    "paged_causal_shared_pages": {"T": 6, "lens": (29, 3), "causal": True, "page": 4, "shared": 1},
    "paged_decode_empty_cache": {"T": 1, "lens": (0, 22), "page": 4, "blocks": (1, 12)},  # 3 pages per block
    "paged_page_longer_than_block": {"T": 3, "lens": (19, 9), "page": 16, "blocks": (2, 4)},  # one page per block
    # one query block and one key block in both passes: taken without the loops (an accelerator's default)
    "dense_causal_one_block": {"T": 29, "S": 13, "causal": True, "blocks": (29, 13)},
    "paged_one_block_empty_cache": {"T": 2, "lens": (0, 22), "page": 4, "blocks": (2, 64)},
}


def _inputs(name: str, c: dict) -> tuple[tuple, dict, jax.Array]:
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    b, t, h = 2, c["T"], 3
    q = jnp.asarray(rng.standard_normal((b, t, h, DL + DR)), jnp.float32)
    kw: dict = {"latent_dim": DL, "causal": c.get("causal", False)}
    if "lens" in c:
        page = c["page"]
        maxp = -(-max(c["lens"]) // page) + 1
        num_pages = b * maxp + 2
        kv = jnp.asarray(rng.standard_normal((num_pages, page, DL + DR)), jnp.float32)
        tables = rng.permutation(num_pages)[: b * maxp].reshape(b, maxp)
        tables[1, : c.get("shared", 0)] = tables[0, : c.get("shared", 0)]
        for i, n in enumerate(c["lens"]):
            tables[i, -(-n // page) :] = 10**6  # never read
        kw["block_tables"] = jnp.asarray(tables, jnp.int32)
        kw["cache_seqlens"] = jnp.asarray(c["lens"], jnp.int32)
    else:
        kv = jnp.asarray(rng.standard_normal((b, c["S"], DL + DR)), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((b, t, h, DL)), jnp.float32)
    return (q, kv), kw, dout


@pytest.mark.parametrize("name", list(CASES))
def test_small_blocks_match_reference(name: str) -> None:
    c = CASES[name]
    (q, kv), kw, dout = _inputs(name, c)
    bq, bk = c.get("blocks", (4, 8))
    params = {"fwd_params": FwdParams(q_blocksize=bq, kv_blocksize=bk), "bwd_params": BwdParams(bq + 1, bk * 2)}
    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kw.items() if k not in arrays}

    def run(fn):
        def loss(q, kv, arrays):
            out = fn(q, kv, **arrays, **static)
            return jnp.sum(out * dout), out

        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(q, kv, arrays)

    (dq, dkv), out = run(lambda *a, **k: multi_head_latent_attention(*a, **k, **params))
    (want_dq, want_dkv), want = run(reference)
    for what, got, ref in (("out", out, want), ("dq", dq, want_dq), ("dkv", dkv, want_dkv)):
        got, ref = np.asarray(got), np.asarray(ref)
        assert np.isfinite(got).all(), f"{what}: not finite (EJKERNEL_TEST_SEED={SEED})"
        err = float(np.abs(got - ref).max()) / max(1.0, float(np.abs(ref).max()))
        assert err <= 2e-5, f"{name} {what}: error {err:.3g} (EJKERNEL_TEST_SEED={SEED})"


def _geometry(t: int, s: int, causal: bool, lens: tuple[int, ...] | None = None) -> _Geometry:
    q = jax.ShapeDtypeStruct((len(lens or (1,)), t, 2, 8), jnp.float32)
    o = Options(latent_dim=4, scale=1.0, causal=causal, fwd_blocks=(128, 128), bwd_blocks=(128, 128))
    if lens is None:
        return _Geometry(o, q, jax.ShapeDtypeStruct((1, s, 8), jnp.float32), None, None, o.fwd_blocks)
    tables = jnp.zeros((len(lens), s // 32), jnp.int32)
    return _Geometry(o, q, jnp.zeros((64, 32, 8)), tables, jnp.asarray(lens), o.fwd_blocks)


@pytest.mark.parametrize(
    ("t", "s", "causal", "lens", "visited"),
    [
        (1024, 1024, False, None, 64),
        (1024, 1024, True, None, 36),  # the lower triangle of 8 x 8 blocks
        (512, 1024, True, None, 4 * 4 + 10),  # bottom-right: query block i sees key blocks up to 4 + i
        (256, 1024, True, (1024, 300), 7 + 8),  # the longest sequence bounds each query block
        (1, 1024, False, (0, 129), 2),  # decode: 129 keys are two blocks; the empty cache adds none
        (1, 1024, False, (0, 0), 0),
    ],
)
def test_only_visible_key_blocks_are_visited(t, s, causal, lens, visited) -> None:
    assert int(_geometry(t, s, causal, lens).n_blocks.sum()) == visited


def _temp_bytes(fn, *shapes) -> int:
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def test_training_memory_is_linear_in_length() -> None:
    """Forward+backward never holds a T x S matrix: temp memory is far below it and grows linearly."""
    h, d = 4, 64 + 16

    def temp(t: int) -> int:
        p = {"fwd_params": FwdParams(256, 256), "bwd_params": BwdParams(256, 256)}

        def loss(q, kv):
            return multi_head_latent_attention(q, kv, latent_dim=64, causal=True, **p).sum()

        return _temp_bytes(jax.value_and_grad(loss, argnums=(0, 1)), (1, t, h, d), (1, t, d))

    t = 8192
    small, large = temp(t // 2), temp(t)
    dense_scores = h * t * t * 4  # one float32 score matrix of the dense algorithm: 1 GiB
    assert large < dense_scores / 8, f"temp {large / 2**20:.1f} MiB vs dense scores {dense_scores / 2**20:.0f} MiB"
    assert large / small < 2.2, f"temp grew {large / small:.2f}x when T doubled"


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_decode_reads_the_latents_in_place(paged: bool) -> None:
    """A decode step copies neither the keys nor anything per head: temp memory stays far below the latents."""
    b, h, s, d = 2, 16, 32768, 576
    kv_bytes = b * s * d * 4  # 144 MiB
    if paged:
        tables = jnp.arange(b * s // 64, dtype=jnp.int32).reshape(b, -1)
        lens = jnp.full((b,), s, jnp.int32)

        def fn(q, kv):
            return multi_head_latent_attention(q, kv, block_tables=tables, cache_seqlens=lens)

        temp = _temp_bytes(fn, (b, 1, h, d), (b * s // 64, 64, d))
    else:
        temp = _temp_bytes(lambda q, kv: multi_head_latent_attention(q, kv), (b, 1, h, d), (b, s, d))
    assert temp < kv_bytes / 16, f"temp {temp / 2**20:.1f} MiB vs the latents' {kv_bytes / 2**20:.0f} MiB"


def test_heuristic_keeps_tiles_small() -> None:
    # DeepSeek decode (B=4, H=128): one query row, key blocks of B*bk*D <= 2**20 elements.
    assert default_blocks(4, 128, 1, 8192, 576, 512, "cpu") == (1, 256)
    # Prefill (B=1, H=16): the float32 accumulator caps the query block at 128 rows.
    assert default_blocks(1, 16, 4096, 4096, 576, 512, "cpu") == (128, 512)
    assert default_blocks(1, 1, 3, 5, 24, 16, "cpu") == (3, 5)  # tiny shapes: one block


def test_heuristic_on_accelerators_takes_few_large_steps() -> None:
    # DeepSeek-V3 decode at B64 x 4096 keys and B1 x 32768: the whole context in one step.
    assert default_blocks(64, 128, 1, 4096, 576, 512, "gpu") == (1, 4096)
    assert default_blocks(1, 128, 1, 32768, 576, 512, "gpu") == (1, 32768)
    # Longer contexts halve the key block until the gathered latents fit 2**28 elements
    # (B64 x 16384: 4 steps of 4096 keys).
    assert default_blocks(64, 128, 1, 16384, 576, 512, "tpu") == (1, 4096)
    # Prefill (B=1, H=128, 8192 tokens): 256 query rows against 2048 keys (2**26 scores).
    assert default_blocks(1, 128, 8192, 8192, 576, 512, "gpu") == (256, 2048)


def test_autotune_under_jit_gets_valid_page_tables(monkeypatch) -> None:
    """Tuning a traced paged call times the candidates on inputs from ``make_inputs`` (valid tables)."""
    from ejkernel.modules import multi_head_latent_attention as public

    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    (q, cache), kw, _ = _inputs("autotune", {"T": 1, "lens": (9, 30), "page": 8})
    got = jax.jit(lambda q, c, t, n: public(q, c, latent_dim=DL, block_tables=t, cache_seqlens=n, platform="xla"))(
        q, cache, kw["block_tables"], kw["cache_seqlens"]
    )
    want = reference(q, cache, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
