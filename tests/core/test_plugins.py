"""Plugin loading through real entry points (fake distributions on ``sys.path``), and the registry's checks."""

from __future__ import annotations

import textwrap
import warnings

import pytest

from ejkernel.kernels import Backend, KernelRegistry, Platform, kernel_registry
from ejkernel.plugins import PluginError, PluginWarning, manager, plugin_records, register_plugin, unregister_plugin

GOOD = """
    from ejkernel.plugins import BackendInfo, hookimpl

    @hookimpl
    def ejkernel_register_kernels(registry):
        registry.register("flash_attention", "{name}", "any", priority=1, impl="{module}_impl:attention", version="2.0")

    @hookimpl
    def ejkernel_backend_info():
        return BackendInfo(name="{name}", version="2.0", platforms=("{name}",), available=True)
"""
IMPL = """
    def attention(query, key, value, bias=None, *, attention_mask=None, q_segment_ids=None, kv_segment_ids=None,
                  softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None, dropout_prob=0.0,
                  dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, fwd_params=None, bwd_params=None):
        return query
"""
RAISES_ON_IMPORT = "raise ImportError('libfoo.so: cannot open shared object file')"
RAISES_ON_REGISTER = """
    from ejkernel.plugins import hookimpl

    @hookimpl
    def ejkernel_register_kernels(registry):
        registry.register("flash_attention", "half", "any", impl=lambda q: q)  # wrong signature
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Make fake distributions with ``ejkernel`` entry points; plugin state is reloaded around the test."""
    root = tmp_path / "site"
    root.mkdir()
    for var in ("EJKERNEL_PLUGINS", "EJKERNEL_DISABLE_PLUGINS", "EJKERNEL_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(root))

    def add(ep_name, module, source, *, requires="ejkernel-core>=0.1,<0.2", impl=IMPL):
        dist = root / f"ejk_{ep_name}-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: ejk-{ep_name}\nVersion: 1.0\nRequires-Dist: {requires}\n"
        )
        (dist / "entry_points.txt").write_text(f"[ejkernel]\n{ep_name} = {module}\n")
        (root / f"{module}.py").write_text(textwrap.dedent(source.format(name=ep_name, module=module)))
        (root / f"{module}_impl.py").write_text(textwrap.dedent(impl))

    manager.reset()
    yield add
    manager.reset()


def _record(name):
    return next(r for r in plugin_records() if r.name == name)


def test_entry_point_plugin_is_loaded_lazily(site):
    site("alpha", "alpha_plugin", GOOD)
    impl = kernel_registry.implementations("flash_attention", platform="alpha")[0]
    assert (impl.plugin, impl.version, impl._fn) == ("alpha", "2.0", None)  # not imported yet
    assert impl.fn.__name__ == "attention"
    rec = _record("alpha")
    assert (rec.status, rec.distribution, rec.version, rec.info.available) == ("loaded", "ejk-alpha", "1.0", True)


def test_plugin_raising_on_import_is_skipped_with_a_warning_naming_it(site):
    site("alpha", "alpha_plugin", GOOD)
    site("broken", "broken_plugin", RAISES_ON_IMPORT)
    with pytest.warns(PluginWarning, match="plugin 'broken' was skipped: ImportError: libfoo.so"):
        records = plugin_records()
    assert {r.name: r.status for r in records}["broken"] == "failed"
    assert "libfoo.so" in _record("broken").error
    assert kernel_registry.implementations("flash_attention", platform="alpha")  # the others still load


def test_plugin_raising_on_registration_is_skipped_and_leaves_nothing_behind(site):
    site("half", "half_plugin", RAISES_ON_REGISTER)
    with pytest.warns(PluginWarning, match="'half' was skipped: TypeError: .*lacks parameter 'query'"):
        assert kernel_registry.implementations("flash_attention", platform="half") == []
    assert _record("half").status == "failed"


def test_strict_mode_raises(site, monkeypatch):
    site("broken", "broken_plugin", RAISES_ON_IMPORT)
    monkeypatch.setenv("EJKERNEL_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="'broken' failed to load: ImportError"):
        kernel_registry.implementations("flash_attention")


def test_allow_and_block_lists(site, monkeypatch):
    site("alpha", "alpha_plugin", GOOD)
    site("beta", "beta_plugin", GOOD)
    monkeypatch.setenv("EJKERNEL_PLUGINS", "beta")
    assert {i.platform for i in kernel_registry.implementations("flash_attention", backend="all")} == {"beta"}
    assert _record("alpha").status == "disabled"
    manager.reset()
    monkeypatch.delenv("EJKERNEL_PLUGINS")
    monkeypatch.setenv("EJKERNEL_DISABLE_PLUGINS", "beta")
    platforms = {i.platform for i in kernel_registry.implementations("flash_attention", backend="all")}
    assert "alpha" in platforms and "beta" not in platforms


def test_plugin_for_another_core_version_is_refused_naming_both(site):
    site("future", "future_plugin", GOOD, requires="ejkernel-core>=0.5,<0.6")
    with pytest.warns(PluginWarning, match=r"ejk-future 1.0 needs ejkernel-core<0.6,>=0.5, but ejkernel-core 0.1.0"):
        plugin_records()


def test_in_test_plugin_object_registers_and_unregisters():
    class Plugin:
        from ejkernel.plugins import hookimpl

        @hookimpl
        def ejkernel_register_kernels(self, registry):
            registry.register("flash_attention", "inproc", "cpu", impl="ejkernel_xla_missing:fn")

    register_plugin(Plugin(), "inproc-test")
    try:
        assert [
            i.name for i in kernel_registry.implementations("flash_attention", platform="inproc", backend="cpu")
        ] == ["inproc:cpu"]
        with pytest.raises(ValueError, match="already registered"):
            register_plugin(Plugin(), "inproc-test")
    finally:
        unregister_plugin("inproc-test")
    assert kernel_registry.implementations("flash_attention", platform="inproc", backend="all") == []


def test_lazy_reference_that_does_not_import_is_skipped_with_its_reason():
    import jax.numpy as jnp

    from ejkernel.modules import flash_attention

    class Plugin:
        from ejkernel.plugins import hookimpl

        @hookimpl
        def ejkernel_register_kernels(self, registry):
            registry.register("flash_attention", "ghost", "any", priority=10**6, impl="ejk_no_such_module:fn")

    register_plugin(Plugin(), "ghost-test")
    try:
        q = jnp.ones((1, 4, 1, 8))
        from ejkernel.ops.config.chain import ConfigError

        with pytest.raises(ConfigError, match="platform 'ghost' cannot serve.*No module named 'ejk_no_such_module'"):
            flash_attention(q, q, q, platform="ghost")
    finally:
        unregister_plugin("ghost-test")


CANONICAL = (
    "query, key, value, bias=None, *, attention_mask=None, q_segment_ids=None, kv_segment_ids=None, "
    "softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None, dropout_prob=0.0, "
    "dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, fwd_params=None, bwd_params=None"
)


def _make(params: str):
    namespace: dict = {}
    exec(f"def _attention({params}):\n    return query", namespace)
    return namespace["_attention"]


_attention = _make(CANONICAL)


def test_decorator_form_and_priorities_with_deterministic_ties():
    reg = KernelRegistry()
    for platform, backend, prio in (
        ("b", Backend.ANY, 5),
        ("a", Backend.ANY, 5),
        (Platform.TRITON, Backend.GPU, 100),
        ("c", Backend.CPU, 5),
    ):
        reg.register("flash_attention", platform, backend, priority=prio, plugin=f"p-{platform}")(_attention)
    assert [i.name for i in reg.implementations("flash_attention", backend="cpu")] == ["a:any", "b:any", "c:cpu"]
    assert [i.name for i in reg.implementations("flash_attention", backend="gpu")][0] == "triton:gpu"
    assert reg.get("flash_attention", platform="triton", backend="gpu") is _attention
    with pytest.raises(ValueError, match="already registered by p-a"):
        reg.register("flash_attention", "a", "any", impl=_attention, plugin="someone-else")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.replace("causal=False, ", ""), "lacks parameter 'causal'"),
        (
            lambda s: s.replace("*, attention_mask=None", "attention_mask=None, *"),
            "'attention_mask' of 'flash_attention' must be keyword-only",
        ),
        (
            lambda s: s.replace("dropout_prob=0.0", "dropout_prob=0.1"),
            "'dropout_prob' of 'flash_attention' must default to 0.0",
        ),
        (lambda s: s.replace("bwd_params=None", "bwd_params=None, extra=1"), "unexpected parameter 'extra'"),
        (
            lambda s: s.replace("query, key, value", "key, query, value"),
            "'query' of 'flash_attention' must be at position 0",
        ),
    ],
)
def test_wrong_signature_is_refused_naming_the_parameter(edit, message):
    with pytest.raises(TypeError, match=message):
        KernelRegistry().register("flash_attention", "bad", "any", impl=_make(edit(CANONICAL)))


def test_missing_implementation_error_names_the_distribution():
    reg = KernelRegistry()
    with pytest.raises(LookupError, match="No implementation of 'flash_attention' is installed.*ejkernel-xla"):
        reg.get("flash_attention")


def test_plugin_warning_is_emitted_once_per_load(site):
    site("broken", "broken_plugin", RAISES_ON_IMPORT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin_records()
        plugin_records()
        kernel_registry.implementations("flash_attention")
    assert len([w for w in caught if issubclass(w.category, PluginWarning)]) == 1
