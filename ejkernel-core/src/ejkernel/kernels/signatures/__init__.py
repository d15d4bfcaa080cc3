"""Canonical signatures: the contract every implementation of an op is checked against.

Each op has one stub function here (arrays positional, options keyword-only, jaxtyping
annotations) and one ``validate`` function that checks a call's arguments at trace time and
raises a ``ValueError``/``TypeError`` naming the argument, what was expected and what came.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ejkernel.kernels.signatures import attention as _attention
from ejkernel.kernels.signatures import block_sparse_attention as _block_sparse_attention
from ejkernel.kernels.signatures import flash_attention as _flash_attention
from ejkernel.kernels.signatures import flash_attention_block as _flash_attention_block
from ejkernel.kernels.signatures import gated_delta_rule as _gated_delta_rule
from ejkernel.kernels.signatures import gla as _gla
from ejkernel.kernels.signatures import grouped_matmul as _grouped_matmul
from ejkernel.kernels.signatures import lightning_attn as _lightning_attn
from ejkernel.kernels.signatures import mean_pooling as _mean_pooling
from ejkernel.kernels.signatures import multi_head_latent_attention as _multi_head_latent_attention
from ejkernel.kernels.signatures import native_sparse_attention as _native_sparse_attention
from ejkernel.kernels.signatures import page_attention as _page_attention
from ejkernel.kernels.signatures import ragged_decode_attention as _ragged_decode_attention
from ejkernel.kernels.signatures import ragged_page_attention as _ragged_page_attention
from ejkernel.kernels.signatures import recurrent as _recurrent
from ejkernel.kernels.signatures import ring_attention as _ring_attention
from ejkernel.kernels.signatures import scaled_dot_product_attention as _scaled_dot_product_attention


class OpSpec:
    """One op's contract: its canonical stub (arrays positional, options keyword-only), its validator and
    the distributions that implement it; ``reference`` (the plain function every implementation is checked
    against) and ``owner`` (``"ejkernel-core"``, or the plugin that registered the op through
    ``registry.register_op``)."""

    def __init__(
        self,
        name: str,
        stub: Callable[..., Any],
        validate: Callable[..., None],
        provided_by: tuple[str, ...],
        *,
        reference: Callable[..., Any] | None = None,
        owner: str = "ejkernel-core",
    ):
        self.name = name
        self.stub = stub
        self.validate = validate
        self.provided_by = provided_by
        self.reference = reference
        self.owner = owner
        self.signature = inspect.signature(stub)


OPS: dict[str, OpSpec] = {
    "flash_attention": OpSpec(
        "flash_attention",
        _flash_attention.flash_attention,
        _flash_attention.validate,
        provided_by=("ejkernel-xla", "ejkernel-triton", "ejkernel-pallas", "ejkernel-cuda"),
    ),
    "multi_head_latent_attention": OpSpec(
        "multi_head_latent_attention",
        _multi_head_latent_attention.multi_head_latent_attention,
        _multi_head_latent_attention.validate,
        provided_by=("ejkernel-xla", "ejkernel-pallas"),
    ),
    "gated_delta_rule": OpSpec(
        "gated_delta_rule",
        _gated_delta_rule.gated_delta_rule,
        _gated_delta_rule.validate,
        provided_by=("ejkernel-xla",),
    ),
    "mean_pooling": OpSpec(
        "mean_pooling",
        _mean_pooling.mean_pooling,
        _mean_pooling.validate,
        provided_by=("ejkernel-xla",),
    ),
    "grouped_matmul": OpSpec(
        "grouped_matmul",
        _grouped_matmul.grouped_matmul,
        _grouped_matmul.validate,
        provided_by=("ejkernel-xla", "ejkernel-pallas"),
    ),
    "ring_attention": OpSpec(
        "ring_attention",
        _ring_attention.ring_attention,
        _ring_attention.validate,
        provided_by=("ejkernel-xla",),
    ),
    "page_attention": OpSpec(
        "page_attention",
        _page_attention.page_attention,
        _page_attention.validate,
        provided_by=("ejkernel-xla", "ejkernel-pallas"),
    ),
    "ragged_page_attention": OpSpec(
        "ragged_page_attention",
        _ragged_page_attention.ragged_page_attention,
        _ragged_page_attention.validate,
        provided_by=("ejkernel-xla", "ejkernel-pallas"),
    ),
    "ragged_decode_attention": OpSpec(
        "ragged_decode_attention",
        _ragged_decode_attention.ragged_decode_attention,
        _ragged_decode_attention.validate,
        provided_by=("ejkernel-xla", "ejkernel-pallas"),
    ),
    "attention": OpSpec(
        "attention",
        _attention.attention,
        _attention.validate,
        provided_by=("ejkernel-xla",),
    ),
    "scaled_dot_product_attention": OpSpec(
        "scaled_dot_product_attention",
        _scaled_dot_product_attention.scaled_dot_product_attention,
        _scaled_dot_product_attention.validate,
        provided_by=("ejkernel-xla",),
    ),
    "block_sparse_attention": OpSpec(
        "block_sparse_attention",
        _block_sparse_attention.block_sparse_attention,
        _block_sparse_attention.validate,
        provided_by=("ejkernel-xla", "ejkernel-pallas"),
    ),
    "native_sparse_attention": OpSpec(
        "native_sparse_attention",
        _native_sparse_attention.native_sparse_attention,
        _native_sparse_attention.validate,
        provided_by=("ejkernel-xla",),
    ),
    "gla": OpSpec(
        "gla",
        _gla.gla,
        _gla.validate,
        provided_by=("ejkernel-xla", "ejkernel-pallas"),
    ),
    "lightning_attn": OpSpec(
        "lightning_attn",
        _lightning_attn.lightning_attn,
        _lightning_attn.validate,
        provided_by=("ejkernel-xla",),
    ),
    "recurrent": OpSpec(
        "recurrent",
        _recurrent.recurrent,
        _recurrent.validate,
        provided_by=("ejkernel-xla",),
    ),
    # The attention-block contract that schedules (ring attention) are written in: see its module.
    "flash_attention_block": OpSpec(
        "flash_attention_block",
        _flash_attention_block.flash_attention_block,
        _flash_attention_block.validate,
        provided_by=("ejkernel-xla", "ejkernel-triton"),
    ),
    "flash_attention_block_bwd": OpSpec(
        "flash_attention_block_bwd",
        _flash_attention_block.flash_attention_block_bwd,
        _flash_attention_block.validate_bwd,
        provided_by=("ejkernel-xla", "ejkernel-triton"),
    ),
    # (one entry per op above this line, in the order of the catalogue)
}


def add_op(spec: OpSpec) -> None:
    """Make ``spec`` an op (a plugin's new op, through ``registry.register_op``).

    Raises:
        ValueError: an op of that name exists and belongs to someone else (the core or another plugin).
    """
    other = OPS.get(spec.name)
    if other is not None and other.owner != spec.owner:
        raise ValueError(f"{spec.owner}: an op named {spec.name!r} already exists (defined by {other.owner})")
    OPS[spec.name] = spec


def remove_ops(owner: str) -> None:
    """Forget the ops that ``owner`` (a plugin) added; the core's own stay."""
    for name in [n for n, spec in OPS.items() if spec.owner == owner and owner != "ejkernel-core"]:
        del OPS[name]


def check_call_signature(fn: Callable[..., Any], where: str) -> None:
    """Refuse ``fn`` unless it can be called as ``fn(call, *, fwd_params, bwd_params)`` (a bound-call implementation).

    Raises:
        TypeError: naming what does not fit.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: cannot read the signature of {fn!r}: {e}") from None
    try:
        sig.bind(object(), fwd_params=None, bwd_params=None)
    except TypeError as e:
        raise TypeError(
            f"{where}: a takes_call implementation must accept (call, *, fwd_params, bwd_params): {e}"
        ) from None


def check_signature(op: str, fn: Callable[..., Any], where: str) -> None:
    """Refuse ``fn`` unless its parameters match the canonical signature of ``op``, name for name.

    Keyword options with a default may be left out: the implementation does not support them and
    declines the calls that set them.

    Raises:
        TypeError: naming the first parameter that is missing, extra, misplaced or of the wrong kind.
    """
    if op not in OPS:
        return  # third-party ops have no canonical signature in the core
    expected = list(OPS[op].signature.parameters.values())
    try:
        got = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:  # builtins without a signature
        raise TypeError(f"{where}: cannot read the signature of {fn!r}: {e}") from None
    got_names = [p.name for p in got]
    for i, p in enumerate(expected):
        if p.name not in got_names:
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty:
                continue  # an option it does not support: it declines calls that set it (Implementation.declines)
            raise TypeError(f"{where}: implementation of {op!r} lacks parameter {p.name!r} ({_describe(p)})")
        q = got[got_names.index(p.name)]
        if q.kind != p.kind:
            raise TypeError(
                f"{where}: parameter {p.name!r} of {op!r} must be {_kind(p.kind)}, the implementation has it {_kind(q.kind)}"
            )
        if got_names.index(p.name) != i and p.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(
                f"{where}: parameter {p.name!r} of {op!r} must be at position {i}, found at {got_names.index(p.name)}"
            )
        if (p.default is inspect.Parameter.empty) != (q.default is inspect.Parameter.empty) or (
            p.default is not inspect.Parameter.empty and q.default != p.default
        ):
            raise TypeError(
                f"{where}: parameter {p.name!r} of {op!r} must default to {p.default!r}, found {q.default!r}"
            )
    extra = [n for n in got_names if n not in {p.name for p in expected}]
    if extra:
        raise TypeError(f"{where}: implementation of {op!r} has unexpected parameter {extra[0]!r}")


def _kind(kind: inspect._ParameterKind) -> str:
    return {
        inspect.Parameter.POSITIONAL_ONLY: "positional-only",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "*args",
        inspect.Parameter.KEYWORD_ONLY: "keyword-only",
        inspect.Parameter.VAR_KEYWORD: "**kwargs",
    }[kind]


def _describe(p: inspect.Parameter) -> str:
    d = _kind(p.kind)
    return d if p.default is inspect.Parameter.empty else f"{d}, default {p.default!r}"
