"""``mesh``/``in_specs``/``out_specs`` run the op under ``jax.shard_map`` (8 simulated CPU devices in CI)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ejkernel.modules import flash_attention
from ejkernel.testing import reference

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs >= 4 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
)


def _inputs(b=4, t=16, h=4, k=2, d=8):
    keys = jax.random.split(jax.random.key(np.random.randint(2**31)), 3)
    return (
        jax.random.normal(keys[0], (b, t, h, d)),
        jax.random.normal(keys[1], (b, t, k, d)),
        jax.random.normal(keys[2], (b, t, k, d)),
    )


def test_three_specs_for_q_k_v_shard_batch_and_heads():
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q, k, v = _inputs()
    spec = P("data", None, "model", None)
    out = flash_attention(q, k, v, causal=True, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    np.testing.assert_allclose(out, reference.flash_attention(q, k, v, causal=True), atol=2e-5)


def test_specs_cover_array_keywords_too_and_grad_flows():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = _inputs()
    seg = jnp.repeat(jnp.arange(2), 8)[None].repeat(4, 0)
    spec, seg_spec = P("data"), P("data")

    def loss(q):
        out = flash_attention(
            q,
            k,
            v,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            mesh=mesh,
            in_specs=(spec, spec, spec, seg_spec, seg_spec),
            out_specs=spec,
        )
        return out.sum()

    def ref_loss(q):
        return reference.flash_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg).sum()

    np.testing.assert_allclose(jax.jit(jax.grad(loss))(q), jax.grad(ref_loss)(q), atol=5e-5)


def test_dict_in_specs_name_arrays():
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = _inputs(b=2)
    out = flash_attention(
        q, k, v, mesh=mesh, in_specs={"query": P("data"), "key": P("data"), "value": P("data")}, out_specs=P("data")
    )
    np.testing.assert_allclose(out, reference.flash_attention(q, k, v), atol=2e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"in_specs": (P(),) * 3, "out_specs": P()}, "only used with mesh="),
        (
            {"mesh": "M", "in_specs": (P(),) * 2, "out_specs": P()},
            r"one spec per array passed \(\['query', 'key', 'value'\]\), got 2",
        ),
        ({"mesh": "M", "out_specs": P()}, "pass in_specs"),
        ({"mesh": "M", "in_specs": {"bias": P()}, "out_specs": P()}, r"in_specs names \['bias'\]"),
    ],
)
def test_bad_sharding_arguments_are_explained(kwargs, message):
    if kwargs.get("mesh") == "M":
        kwargs = {**kwargs, "mesh": jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))}
    q, k, v = _inputs(b=2)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, **kwargs)
