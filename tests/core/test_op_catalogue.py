"""The op catalogue: every core op defined once (its public function), the rest derived from it."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

from ejkernel.kernels import kernel_registry
from ejkernel.kernels.signatures import DISPATCH_ONLY, OPS, canonical_signature
from ejkernel.plugins import manager


def _public(op: str) -> object:
    spec = OPS[op]
    module, _, attr = spec._stub.partition(":")  # type: ignore[union-attr]
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("op", [name for name, spec in OPS.items() if spec.owner == "ejkernel-core"])
def test_the_canonical_signature_is_the_public_function_less_dispatch(op):
    public = inspect.signature(_public(op))  # type: ignore[arg-type]
    sig = OPS[op].signature
    assert sig == canonical_signature(_public(op))  # type: ignore[arg-type]
    names = list(sig.parameters)
    assert names[-2:] == ["fwd_params", "bwd_params"]
    assert [n for n in public.parameters if n not in DISPATCH_ONLY] == names[:-2]
    assert all(sig.parameters[n].annotation == public.parameters[n].annotation for n in names[:-2])


def test_the_block_backward_takes_the_forwards_options():
    fwd, bwd = OPS["flash_attention_block"].signature, OPS["flash_attention_block_bwd"].signature
    options = [p for p in fwd.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert all(bwd.parameters[p.name] == p for p in options)


def test_the_xla_plugin_implements_every_core_op():
    kernel_registry.algorithms()  # loads the plugins
    if not manager.is_loaded("xla"):
        pytest.skip("the ejkernel-xla plugin is not loaded")
    for op, spec in OPS.items():
        if spec.owner != "ejkernel-core":
            continue
        plugins = {impl.plugin for impl in kernel_registry.implementations(op, backend="all")}
        assert "xla" in plugins, f"ejkernel-xla registers no implementation of {op!r}"
        assert spec.provided_by[0] == "ejkernel-xla"
        assert set(spec.provided_by) >= {manager.distribution_of(p) for p in plugins if manager.is_loaded(p)}


def test_importing_the_catalogue_imports_no_public_api():
    code = "import ejkernel.kernels, sys; from ejkernel.kernels.signatures import OPS; print('ejkernel.modules' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
