"""What ``ejkernel bench`` knows of each op: its shape letters, inputs, how to call it, its reference and metric.

A shape is a dict of named sizes and options (``{"B": 2, "H": 16, "T": 8192, "D": 128, "causal": True}``);
on the command line ``B=2,H=16,T=8192,D=128,causal=1`` or the op's shorthand ``2x16x8192x128`` (its
``letters`` in order). Inputs are random (never zeros), seeded, so every implementation and peer gets the
same arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Shape = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The arrays of one call (positional), the options (keyword) and which arrays are differentiated."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    diff: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Case:
    """One op as the benchmark runs it.

    ``make(shape, dtype)`` gives the :class:`Inputs`; ``call(platform, inputs)`` runs ``ejkernel.modules.<op>``
    (``platform=None``: the default dispatch); ``reference(inputs)`` the float32 truth; ``work(shape, pass)``
    the FLOPs or bytes of one call and ``unit``/``model`` name the metric and its model; ``x`` is the letter
    plots put on their x axis.
    """

    op: str
    letters: tuple[str, ...]
    defaults: Shape
    make: Callable[[Shape, Any], Inputs]
    work: Callable[[Shape, str, Any], float]
    unit: str
    model: str
    x: str
    # The ``ejkernel.modules`` function when it is not ``op`` (``gla-decode`` runs ``gla``), and the names of
    # the trailing arrays of ``Inputs.args`` it takes by keyword (``initial_state``).
    kernel: str = ""
    keywords: tuple[str, ...] = ()
    # What is checked and timed of the op's result: its main output, or everything (a decode step's state).
    outputs: Callable[[Any], Any] = dataclasses.field(default=lambda out: first(out))
    # A reference of the case's own, given the (maybe traced) float32 inputs and the same inputs concrete, for
    # shapes where ``ejkernel.testing.reference``'s plain form does not fit the device.
    own_reference: Callable[[Inputs, Inputs], Any] | None = None

    @property
    def function(self) -> str:
        return self.kernel or self.op

    def _arguments(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        n = len(args) - len(self.keywords)
        return args[:n], dict(zip(self.keywords, args[n:], strict=True))

    def call(self, platform: str | None, inputs: Inputs) -> Any:
        import ejkernel.modules as modules

        args, named = self._arguments(inputs.args)
        return self.outputs(getattr(modules, self.function)(*args, **named, **inputs.kwargs, platform=platform))

    def reference(self, inputs: Inputs, concrete: Inputs | None = None) -> Any:
        """The float32 truth of ``inputs``; ``concrete``: the same inputs as arrays when ``inputs`` are traced."""
        from ejkernel.testing import reference

        args = tuple(a.astype(jnp.float32) if _is_float(a) else a for a in inputs.args)
        if self.own_reference is not None:
            return self.own_reference(Inputs(args, inputs.kwargs, inputs.diff), concrete or inputs)
        args, named = self._arguments(args)
        return self.outputs(getattr(reference, self.function)(*args, **named, **inputs.kwargs))

    def parse(self, text: str) -> Shape:
        """``"2x16x8192x128"`` (the letters in order) or ``"B=2,T=8192,causal=1"``, over the defaults."""
        shape = dict(self.defaults)
        if "=" in text:
            for part in text.split(","):
                name, _, value = part.partition("=")
                if name not in shape and name not in self.letters:
                    raise ValueError(f"{self.op}: unknown size or option {name!r} (known: {', '.join(shape)})")
                shape[name] = value.lower() in ("1", "true", "yes") if isinstance(shape.get(name), bool) else int(value)
        else:
            sizes = [int(v) for v in text.split("x")]
            if len(sizes) > len(self.letters):
                raise ValueError(f"{self.op}: {text!r} has more sizes than {'x'.join(self.letters)}")
            shape.update(zip(self.letters, sizes))
        return shape


def first(out: Any) -> Any:
    """The op's main output (ops returning ``(out, state)`` are compared and timed on ``out``)."""
    return out[0] if isinstance(out, tuple) else out


def _is_float(a: Any) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def label(shape: Shape) -> str:
    """``B2 H16 T8192 D128 causal``: sizes by letter, true options by name (false ones and sizes 0 left out)."""
    parts = [f"{k}{v}" for k, v in shape.items() if not isinstance(v, bool) and v != 0]
    return " ".join(parts + [k for k, v in shape.items() if v is True])


def _normal(key: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _attention(s: Shape, dtype: Any) -> Inputs:
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = _normal(kq, (s["B"], s["T"], s["H"], s["D"]), dtype)
    kvh = s["K"] or s["H"]
    k = _normal(kk, (s["B"], s["S"] or s["T"], kvh, s["D"]), dtype)
    v = _normal(kv, (s["B"], s["S"] or s["T"], kvh, s["D"]), dtype)
    return Inputs((q, k, v), {"causal": bool(s["causal"])}, (0, 1, 2))


def _attention_flops(s: Shape, pass_: str, dtype: Any) -> float:
    f = 4.0 * s["B"] * s["H"] * s["T"] * (s["S"] or s["T"]) * s["D"] * (0.5 if s["causal"] else 1.0)
    return f * (3.5 if pass_ == "fwd_bwd" else 1.0)


def _paged(s: Shape, dtype: Any) -> Inputs:
    n, page, length = s["N"], s["P"], s["L"]
    per_seq = -(-length // page)
    kq, kk, kv, kp = jax.random.split(jax.random.key(0), 4)
    q = _normal(kq, (n, s["H"], s["D"]), dtype)
    kc = _normal(kk, (n * per_seq, page, s["K"], s["D"]), dtype)
    vc = _normal(kv, (n * per_seq, page, s["K"], s["D"]), dtype)
    tables = jax.random.permutation(kp, n * per_seq).reshape(n, per_seq).astype(jnp.int32)
    return _fp8(s, Inputs((q, kc, vc, jnp.full((n,), length, jnp.int32), tables), {}, ()))


FP8_SCALES = {"k_scale": 0.5, "v_scale": 2.0}  # per-tensor dequantization scales of the bench's float8 caches


def _fp8(s: Shape, inputs: Inputs) -> Inputs:
    """With ``fp8``: the caches (arguments 1 and 2) in float8_e4m3fn, read with :data:`FP8_SCALES`."""
    if not s.get("fp8"):
        return inputs
    q, k, v, *rest = inputs.args
    cast = (q, k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn), *rest)
    return Inputs(cast, {**inputs.kwargs, **FP8_SCALES}, inputs.diff)


def _decode_bytes(s: Shape, pass_: str, dtype: Any) -> float:
    size = jnp.dtype(dtype).itemsize
    cache = 1 if s.get("fp8") else size  # a float8 cache: one byte per element
    rows = s["N"] if "N" in s else s["B"]
    return float(rows * (2 * s["L"] * s["K"] * s["D"] * cache + 2 * s["H"] * s["D"] * size))


def _ragged_decode(s: Shape, dtype: Any) -> Inputs:
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = _normal(kq, (s["B"], s["H"], s["D"]), dtype)
    k = _normal(kk, (s["B"], s["L"], s["K"], s["D"]), dtype)
    v = _normal(kv, (s["B"], s["L"], s["K"], s["D"]), dtype)
    start = jnp.zeros((s["B"],), jnp.int32)
    return _fp8(s, Inputs((q, k, v, start, jnp.full((s["B"],), s["L"], jnp.int32)), {}, ()))


def _mixed(s: Shape, dtype: Any) -> Inputs:
    """A ragged serving batch: ``N`` decode rows and ``F`` prefills of ``Q`` new tokens, every sequence at ``L``
    tokens (the new ones included), pages of ``P`` in random order."""
    seqs, page, length = s["N"] + s["F"], s["P"], s["L"]
    per_seq = -(-length // page)
    q_lens = np.array([1] * s["N"] + [s["Q"]] * s["F"], np.int32)
    kq, kk, kv, kp = jax.random.split(jax.random.key(0), 4)
    q = _normal(kq, (int(q_lens.sum()), s["H"], s["D"]), dtype)
    kc = _normal(kk, (seqs * per_seq, page, s["K"], s["D"]), dtype)
    vc = _normal(kv, (seqs * per_seq, page, s["K"], s["D"]), dtype)
    tables = jax.random.permutation(kp, seqs * per_seq).reshape(seqs, per_seq).astype(jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.full((seqs,), length, jnp.int32)
    return Inputs((q, kc, vc, lens, tables, cu, jnp.array([seqs], jnp.int32)), {}, ())


def _mixed_flops(s: Shape, pass_: str, dtype: Any) -> float:
    """``4·H·D`` per (query row, admitted key): decode rows admit ``L`` keys, prefill row ``r`` ``L - Q + r + 1``."""
    keys = s["N"] * s["L"] + s["F"] * (s["Q"] * (s["L"] - s["Q"]) + s["Q"] * (s["Q"] + 1) // 2)
    return 4.0 * s["H"] * s["D"] * keys


def _latent(s: Shape, dtype: Any) -> Inputs:
    """MLA decode: one query token per row against a paged latent cache ``[pages, P, D + R]`` (latent ``D`` plus
    rope ``R`` dims; values are the first ``D``), every row at length ``L``, pages in random order."""
    n, page, length, dk = s["B"], s["P"], s["L"], s["D"] + s["R"]
    per_seq = -(-length // page)
    kq, kk, kp = jax.random.split(jax.random.key(0), 3)
    q = _normal(kq, (n, 1, s["H"], dk), dtype)
    kv = _normal(kk, (n * per_seq, page, dk), dtype)
    tables = jax.random.permutation(kp, n * per_seq).reshape(n, per_seq).astype(jnp.int32)
    return Inputs((q, kv, tables, jnp.full((n,), length, jnp.int32)), {"latent_dim": s["D"]}, ())


def _latent_bytes(s: Shape, pass_: str, dtype: Any) -> float:
    size = jnp.dtype(dtype).itemsize
    return float(size * s["B"] * (s["L"] * (s["D"] + s["R"]) + s["H"] * (2 * s["D"] + s["R"])))


def zipf_group_sizes(m: int, g: int, exponent: float = 1.2, empty: int = 2, seed: int = 0) -> np.ndarray:
    """Group sizes of ``m`` rows routed to ``g`` experts by a Zipf law (expert of rank ``r`` drawn with probability
    ``∝ r ** -exponent``, ranks shuffled), the ``empty`` least likely experts left without rows (when ``g > empty``).

    >>> sizes = zipf_group_sizes(16384, 8)
    >>> int(sizes.sum()), int((sizes == 0).sum()), int(sizes.max()) > 3 * 16384 // 8  # the largest: over 3x a fair share
    (16384, 2, True)
    """
    rng = np.random.default_rng(seed)
    p = np.arange(1, g + 1, dtype=np.float64) ** -exponent
    if g > empty:
        p[g - empty :] = 0.0
    p = p[rng.permutation(g)]
    return np.bincount(rng.choice(g, size=m, p=p / p.sum()), minlength=g).astype(np.int32)


def _grouped(s: Shape, dtype: Any) -> Inputs:
    kl, kr = jax.random.split(jax.random.key(0))
    lhs = _normal(kl, (s["M"], s["K"]), dtype)
    rhs = _normal(kr, (s["G"], s["K"], s["N"]), dtype)
    if s["zipf"]:  # imbalanced routing, some experts empty
        sizes = jnp.asarray(zipf_group_sizes(s["M"], s["G"]))
    else:
        sizes = jnp.full((s["G"],), s["M"] // s["G"], jnp.int32)
    return Inputs((lhs, rhs, sizes), {}, (0, 1))


PLAIN_GROUPED_MAX = 1 << 28  # G·M·N up to which the bench checks grouped_matmul with the plain reference (1 GiB)
GROUP_ROWS = 256  # rows per step of the group-by-group check


def _grouped_reference(inputs: Inputs, concrete: Inputs) -> jax.Array:
    """Tile by tile with the concrete group sizes: ``ejkernel.testing.reference.grouped_matmul`` multiplies every
    row by every group's matrix ([G, M, N] in float32: 64 GiB at G256 M32768 N2048); this does about M·K·N.

    One ``lax.scan`` over (group, ``GROUP_ROWS``-row tile) steps, all one dot shape: a dot per group (256 shapes at
    the DeepSeek-V3 shape) made XLA compile and autotune for minutes. The step is rematerialized so that the
    backward keeps no ``rhs[g]`` per step."""
    from ejkernel.testing import reference

    lhs, rhs, sizes = inputs.args
    m, n = lhs.shape[0], rhs.shape[2]
    if inputs.kwargs or rhs.shape[0] * m * n <= PLAIN_GROUPED_MAX:
        return reference.grouped_matmul(lhs, rhs, sizes, **inputs.kwargs)
    ends = np.cumsum(np.asarray(concrete.args[2], np.int64)).clip(max=m)
    starts = np.concatenate([[0], ends[:-1]])
    steps = np.array([(g, a) for g, (s, e) in enumerate(zip(starts, ends)) for a in range(s, e, GROUP_ROWS)], np.int32)
    steps = steps.reshape(-1, 2)
    # Output row r of group g, tile row i: position (step, i) of the stacked tiles; rows past every group: a zero row.
    where = np.full(m, len(steps) * GROUP_ROWS, np.int64)
    for j, (g, a) in enumerate(steps):
        rows = np.arange(a, min(a + GROUP_ROWS, ends[g]))
        where[rows] = j * GROUP_ROWS + rows - a
    padded = jnp.pad(lhs, ((0, GROUP_ROWS), (0, 0)))

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def step(_: None, ga: jax.Array) -> tuple[None, jax.Array]:
        rows = jax.lax.dynamic_slice_in_dim(padded, ga[1], GROUP_ROWS)
        return None, jnp.dot(rows, rhs[ga[0]], precision="highest", preferred_element_type=jnp.float32)

    _, tiles = jax.lax.scan(step, None, jnp.asarray(steps))
    flat = jnp.concatenate([tiles.reshape(-1, n), jnp.zeros((1, n), jnp.float32)])
    return jnp.take(flat, jnp.asarray(where), axis=0).astype(lhs.dtype)


def _grouped_flops(s: Shape, pass_: str, dtype: Any) -> float:
    return 2.0 * s["M"] * s["K"] * s["N"] * (3.0 if pass_ == "fwd_bwd" else 1.0)


def _gla(s: Shape, dtype: Any) -> Inputs:
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    b, t, h, dk, dv = s["B"], s["T"], s["H"], s["K"], s["V"]
    q, k = _normal(kq, (b, t, h, dk), dtype), _normal(kk, (b, t, h, dk), dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (b, t, h, dk), jnp.float32) + 3.0).astype(dtype)  # decays near 1
    return Inputs((q * dk**-0.5, k * dk**-0.5, _normal(kv, (b, t, h, dv), dtype), g), {}, (0, 1, 2, 3))


def _delta(s: Shape, dtype: Any) -> Inputs:
    kq, kk, kv, kg, kb = jax.random.split(jax.random.key(0), 5)
    b, t, h, dk, dv = s["B"], s["T"], s["H"], s["K"], s["V"]
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731 - keys of norm 1 keep the rule stable
    q = unit(jax.random.normal(kq, (b, t, h, dk))).astype(dtype)
    k = unit(jax.random.normal(kk, (b, t, h, dk))).astype(dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (b, t, h)) + 3.0).astype(dtype)
    beta = jax.nn.sigmoid(jax.random.normal(kb, (b, t, h))).astype(dtype)
    return Inputs((q, k, _normal(kv, (b, t, h, dv), dtype), g, beta), {}, (0, 1, 2, 3, 4))


def _lightning(s: Shape, dtype: Any) -> Inputs:
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    b, t, h, dk, dv = s["B"], s["T"], s["H"], s["K"], s["V"]
    q, k = _normal(kq, (b, t, h, dk), dtype), _normal(kk, (b, t, h, dk), dtype)
    slope = 2.0 ** -jnp.arange(1, h + 1, dtype=jnp.float32)  # ALiBi-like per-head decays, as lightning models use
    return Inputs((q * dk**-0.5, k * dk**-0.5, _normal(kv, (b, t, h, dv), dtype), slope), {}, (0, 1, 2))


def _recurrent(s: Shape, dtype: Any) -> Inputs:
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    b, t, h, dk, dv = s["B"], s["T"], s["H"], s["K"], s["V"]
    q, k = _normal(kq, (b, t, h, dk), dtype), _normal(kk, (b, t, h, dk), dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (b, t, h), jnp.float32) + 3.0).astype(dtype)  # a scalar gate a head
    args: tuple[Any, ...] = (q * dk**-0.5, k * dk**-0.5, _normal(kv, (b, t, h, dv), dtype), g)
    if s["gk"] or s["gv"]:  # the key and value gates (log decays per channel), None where left out
        kk2, kv2 = jax.random.split(kg)
        gate = lambda key, d: jax.nn.log_sigmoid(jax.random.normal(key, (b, t, h, d)) + 5.0).astype(dtype)  # noqa: E731
        args += (gate(kk2, dk) if s["gk"] else None, gate(kv2, dv) if s["gv"] else None)
    return Inputs(args, {}, tuple(i for i, a in enumerate(args) if a is not None))


# Above this many float32 elements of the per-token state (B·T·H·K·V), the linear-attention training cases check
# against the XLA implementation run in float32 at the highest dot precision (itself held to the plain reference by
# the conformance suites): the plain reference keeps the state of every token for its backward (64 GiB at B4 T4096
# H16 K=V=128, more than the H200 has free next to the inputs).
PLAIN_LINEAR_MAX = 1 << 30


def _linear_reference(op: str) -> Callable[[Inputs, Inputs], Any]:
    def reference_of(inputs: Inputs, concrete: Inputs) -> Any:
        import ejkernel.modules as modules
        from ejkernel.testing import reference

        q, v = inputs.args[0], inputs.args[2]
        big = q.shape[0] * q.shape[1] * q.shape[2] * q.shape[3] * v.shape[-1] > PLAIN_LINEAR_MAX
        if not big:
            return first(getattr(reference, op)(*inputs.args, **inputs.kwargs))
        with jax.default_matmul_precision("highest"):
            return first(getattr(modules, op)(*inputs.args, **inputs.kwargs, platform="xla"))

    return reference_of


def _decode_state(make: Callable[[Shape, Any], Inputs]) -> Callable[[Shape, Any], Inputs]:
    """A decode step of a linear-attention op: its inputs plus a float32 state ``[B, H, K, V]`` (passed last, by
    keyword); the final state is returned (and checked, and timed)."""

    def inputs(s: Shape, dtype: Any) -> Inputs:
        base = make(s, dtype)
        state = 0.1 * jax.random.normal(jax.random.key(7), (s["B"], s["H"], s["K"], s["V"]), jnp.float32)
        return Inputs((*base.args, state), {**base.kwargs, "output_final_state": True}, ())

    return inputs


def _state_bytes(s: Shape, pass_: str, dtype: Any) -> float:
    """The float32 state read and written, plus q, k, v, the gates and the output once."""
    size = jnp.dtype(dtype).itemsize
    tokens = s["B"] * s["T"] * s["H"]
    return float(2 * 4 * s["B"] * s["H"] * s["K"] * s["V"] + size * tokens * (3 * s["K"] + 2 * s["V"]))


CHUNK = 64


def _linear_flops(extra_kv: int) -> Callable[[Shape, str, Any], float]:
    def flops(s: Shape, pass_: str, dtype: Any) -> float:
        per_token = (2 + extra_kv) * s["K"] * s["V"] + CHUNK * (s["K"] + s["V"])
        return 2.0 * s["B"] * s["T"] * s["H"] * per_token * (3.0 if pass_ == "fwd_bwd" else 1.0)

    return flops


# K (key/value heads) 0: K = H; S (key length) 0: S = T.
_ATTN = {"B": 2, "H": 16, "K": 0, "T": 1024, "S": 0, "D": 128, "causal": False}
CASES: dict[str, Case] = {
    c.op: c
    for c in (
        Case(
            "flash_attention",
            ("B", "H", "T", "D"),
            _ATTN,
            _attention,
            _attention_flops,
            "TFLOP/s",
            "4·B·H·T·S·D, ½ when causal; fwd_bwd 3.5×",
            "T",
        ),
        Case(
            "page_attention",
            ("N", "H", "K", "D", "L", "P"),
            {"N": 64, "H": 32, "K": 8, "D": 128, "L": 4096, "P": 16, "fp8": False},
            _paged,
            _decode_bytes,
            "TB/s",
            "bytes of K and V read once (N·L·K·D·2; fp8: ·1) plus Q and O (N·H·D·2), over time",
            "L",
        ),
        Case(
            "ragged_decode_attention",
            ("B", "H", "K", "D", "L"),
            {"B": 64, "H": 32, "K": 8, "D": 128, "L": 4096, "fp8": False},
            _ragged_decode,
            _decode_bytes,
            "TB/s",
            "bytes of K and V read once (B·L·K·D·2; fp8: ·1) plus Q and O (B·H·D·2), over time",
            "L",
        ),
        Case(
            "ragged_page_attention",
            ("N", "F", "Q", "L", "H", "K", "D", "P"),
            {"N": 48, "F": 4, "Q": 512, "L": 4096, "H": 32, "K": 8, "D": 128, "P": 16},
            _mixed,
            _mixed_flops,
            "TFLOP/s",
            "4·H·D per query row and admitted key (decode rows: L keys; prefill row r: L−Q+r+1); "
            "with F=0 (decode only, bf16) TB/s of K and V = this × K/H",
            "L",
        ),
        Case(
            "multi_head_latent_attention",
            ("B", "H", "L", "D", "R", "P"),
            {"B": 64, "H": 128, "L": 4096, "D": 512, "R": 64, "P": 64},
            _latent,
            _latent_bytes,
            "TB/s",
            "bytes of the latent cache read once (B·L·(D+R)·2) plus Q and O (B·H·(2·D+R)·2), over time",
            "L",
            keywords=("block_tables", "cache_seqlens"),
        ),
        Case(
            "grouped_matmul",
            ("G", "M", "K", "N"),
            {"G": 8, "M": 16384, "K": 4096, "N": 4096, "zipf": False},
            _grouped,
            _grouped_flops,
            "TFLOP/s",
            "2·M·K·N; fwd_bwd 3×",
            "M",
            own_reference=_grouped_reference,
        ),
        Case(
            "gla",
            ("B", "T", "H", "K", "V"),
            {"B": 4, "T": 4096, "H": 16, "K": 128, "V": 128},
            _gla,
            _linear_flops(0),
            "TFLOP/s",
            f"chunked form, chunk C={CHUNK}: 2·B·T·H·(2·K·V + C·(K+V)); fwd_bwd 3×",
            "T",
            own_reference=_linear_reference("gla"),
        ),
        Case(
            "gated_delta_rule",
            ("B", "T", "H", "K", "V"),
            {"B": 4, "T": 4096, "H": 16, "K": 128, "V": 128},
            _delta,
            _linear_flops(1),
            "TFLOP/s",
            f"chunked form, chunk C={CHUNK}: 2·B·T·H·(3·K·V + C·(K+V)); fwd_bwd 3×",
            "T",
            own_reference=_linear_reference("gated_delta_rule"),
        ),
        Case(
            "lightning_attn",
            ("B", "T", "H", "K", "V"),
            {"B": 4, "T": 4096, "H": 16, "K": 128, "V": 128},
            _lightning,
            _linear_flops(0),
            "TFLOP/s",
            f"chunked form, chunk C={CHUNK}: 2·B·T·H·(2·K·V + C·(K+V)); fwd_bwd 3×",
            "T",
            own_reference=_linear_reference("lightning_attn"),
        ),
        Case(
            "recurrent",
            ("B", "T", "H", "K", "V"),
            # gk, gv: key and value gates beside the scalar one (the chunked kernels' other paths)
            {"B": 4, "T": 4096, "H": 16, "K": 128, "V": 128, "gk": False, "gv": False},
            _recurrent,
            _linear_flops(0),
            "TFLOP/s",
            f"chunked form, chunk C={CHUNK}: 2·B·T·H·(2·K·V + C·(K+V)); fwd_bwd 3×",
            "T",
            own_reference=_linear_reference("recurrent"),
        ),
        Case(
            "gla-decode",
            ("B", "T", "H", "K", "V"),
            {"B": 64, "T": 1, "H": 16, "K": 128, "V": 128},
            _decode_state(_gla),
            _state_bytes,
            "TB/s",
            "the float32 state read and written (2·B·H·K·V·4) plus q, k, g, v, o once, over time",
            "B",
            kernel="gla",
            keywords=("initial_state",),
            outputs=lambda out: out,
        ),
        Case(
            "lightning_attn-decode",
            ("B", "T", "H", "K", "V"),
            {"B": 64, "T": 1, "H": 16, "K": 128, "V": 128},
            _decode_state(_lightning),
            _state_bytes,
            "TB/s",
            "the float32 state read and written (2·B·H·K·V·4) plus q, k, v, o once, over time",
            "B",
            kernel="lightning_attn",
            keywords=("initial_state",),
            outputs=lambda out: out,
        ),
        Case(
            "gated_delta_rule-decode",
            ("B", "T", "H", "K", "V"),
            {"B": 64, "T": 1, "H": 16, "K": 128, "V": 128},
            _decode_state(_delta),
            _state_bytes,
            "TB/s",
            "the float32 state read and written (2·B·H·K·V·4) plus q, k, v, o once, over time",
            "B",
            kernel="gated_delta_rule",
            keywords=("initial_state",),
            outputs=lambda out: out,
        ),
    )
}
