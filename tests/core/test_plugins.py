"""Plugin loading through real entry points (fake distributions on ``sys.path``), and the registry's checks."""

from __future__ import annotations

import os
import subprocess
import sys
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


def _site_dirs(tmp_path):
    """Where ``site`` puts distributions: ``later=True`` ones in the second, after the first on ``sys.path``."""
    return tmp_path / "site", tmp_path / "site-later"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Make fake distributions with ``ejkernel`` entry points; plugin state is reloaded around the test."""
    root, later_root = _site_dirs(tmp_path)
    root.mkdir()
    later_root.mkdir()
    for var in ("EJKERNEL_PLUGINS", "EJKERNEL_DISABLE_PLUGINS", "EJKERNEL_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(later_root))
    monkeypatch.syspath_prepend(str(root))

    def add(ep_name, module, source, *, requires="ejkernel-core>=0.1,<0.2", impl=IMPL, dist_name=None, later=False):
        dist_name = dist_name or f"ejk-{ep_name}"
        where = later_root if later else root
        dist = where / f"{dist_name.replace('-', '_')}-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.0\nRequires-Dist: {requires}\n"
        )
        (dist / "entry_points.txt").write_text(f"[ejkernel]\n{ep_name} = {module}\n")
        (where / f"{module}.py").write_text(textwrap.dedent(source.format(name=ep_name, module=module)))
        (where / f"{module}_impl.py").write_text(textwrap.dedent(impl))

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
    assert _record("future").status == "failed"  # refused: nothing of it registered
    assert kernel_registry.implementations("flash_attention", platform="future", backend="all") == []


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
        # An option may be left out (the implementation declines calls that set it); an array may not.
        (lambda s: s.replace("query, key, value", "query, key"), "lacks parameter 'value'"),
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


EXITS_ON_IMPORT = "import sys\nsys.exit(3)"
INTERRUPTS_ON_IMPORT = "raise KeyboardInterrupt"


def _twins(site):
    """Two distributions whose entry point is named ``twin``; ``ejk-twin-a`` is first on ``sys.path``."""
    site("twin", "twin_a_plugin", GOOD, dist_name="ejk-twin-a")
    site("twin", "twin_b_plugin", GOOD, dist_name="ejk-twin-b", later=True)


def test_second_distribution_with_a_taken_name_is_skipped_naming_both(site):
    import jax.numpy as jnp

    from ejkernel.modules import flash_attention

    _twins(site)
    with pytest.warns(PluginWarning, match=r"'twin' was skipped: ejk-twin-b 1.0 .* but ejk-twin-a 1.0 .*holds it"):
        records = [r for r in plugin_records() if r.name == "twin"]
    assert [(r.distribution, r.status) for r in records] == [("ejk-twin-a", "loaded"), ("ejk-twin-b", "failed")]
    assert "ejk-twin-a" in records[1].error
    [impl] = kernel_registry.implementations("flash_attention", platform="twin")
    assert impl.impl == "twin_a_plugin_impl:attention"
    q = jnp.ones((1, 4, 1, 8))
    assert flash_attention(q, q, q, platform="twin").shape == q.shape  # op calls work


def test_second_distribution_with_a_taken_name_raises_in_strict_mode(site, monkeypatch):
    _twins(site)
    monkeypatch.setenv("EJKERNEL_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="'twin' failed to load: ejk-twin-b 1.0 .*ejk-twin-a 1.0"):
        plugin_records()


def test_entry_point_with_the_name_of_an_in_process_plugin_is_skipped(site):
    from ejkernel.plugins import hookimpl

    class Plugin:
        @hookimpl
        def ejkernel_register_kernels(self, registry):
            pass

    site("twin", "twin_a_plugin", GOOD, dist_name="ejk-twin-a")
    register_plugin(Plugin(), "twin")
    with pytest.warns(PluginWarning, match="ejk-twin-a 1.0 .* but a plugin registered in-process holds it"):
        plugin_records()
    assert kernel_registry.implementations("flash_attention", platform="twin") == []


def test_plugin_calling_sys_exit_while_registering_is_skipped(site):
    from ejkernel.plugins import hookimpl

    class Plugin:
        @hookimpl
        def ejkernel_register_kernels(self, registry):
            registry.register("flash_attention", "quitter", "any", impl=_attention)
            raise SystemExit(5)

    with pytest.warns(PluginWarning, match="'quitter-test' was skipped: SystemExit: 5"):
        register_plugin(Plugin(), "quitter-test")
    assert _record("quitter-test").status == "failed"
    assert kernel_registry.implementations("flash_attention", platform="quitter") == []


def test_keyboard_interrupt_in_a_plugin_propagates_and_leaves_nothing_behind(site):
    from ejkernel.plugins import hookimpl

    class Plugin:
        @hookimpl
        def ejkernel_register_kernels(self, registry):
            registry.register("flash_attention", "stopper", "any", impl=_attention)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        register_plugin(Plugin(), "stopper-test")
    assert manager.plugin_manager().get_plugin("stopper-test") is None
    assert kernel_registry.implementations("flash_attention", platform="stopper") == []
    site("stopper", "stopper_plugin", INTERRUPTS_ON_IMPORT)
    manager.reset()  # the query above loaded the entry points already
    with pytest.raises(KeyboardInterrupt):
        plugin_records()


def _python(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` with the ``site`` distributions on ``PYTHONPATH``, in that order."""
    path = [str(d) for d in _site_dirs(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def test_plugin_calling_sys_exit_at_import_does_not_end_the_process(site, tmp_path):
    site("alpha", "alpha_plugin", GOOD)
    site("quitter", "quitter_plugin", EXITS_ON_IMPORT)
    site("lazyquit", "lazyquit_plugin", GOOD, impl=EXITS_ON_IMPORT)  # its kernel module exits when first used
    script = textwrap.dedent(
        """
        import jax.numpy as jnp

        from ejkernel.modules import flash_attention
        from ejkernel.ops.config.chain import ConfigError
        from ejkernel.plugins import plugin_records, register_plugin
        from ejkernel.testing.reference_plugin import ReferencePlugin

        register_plugin(ReferencePlugin(), "reference")  # a default implementation, even with the core alone
        q = jnp.ones((1, 4, 1, 8))
        print("alpha:", flash_attention(q, q, q, platform="alpha").shape)
        print("default:", flash_attention(q, q, q).shape)
        try:
            flash_attention(q, q, q, platform="lazyquit")
        except ConfigError as e:
            print("lazyquit:", e)
        print("quitter:", {r.name: (r.status, r.error) for r in plugin_records()}["quitter"])
        print("still running")
        """
    )
    run = _python(tmp_path, "-c", script)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "alpha: (1, 4, 1, 8)" in out and "default: (1, 4, 1, 8)" in out and "still running" in out, out
    assert "quitter: ('failed', 'SystemExit: 3')" in out, out
    assert "cannot import impl 'lazyquit_plugin_impl:attention': SystemExit: 3" in out, out
    assert "ejkernel plugin 'quitter' was skipped: SystemExit: 3" in run.stderr, run.stderr


def test_info_shows_skipped_plugins_with_their_reasons(site, tmp_path):
    _twins(site)
    site("quitter", "quitter_plugin", EXITS_ON_IMPORT)
    run = _python(tmp_path, "-m", "ejkernel", "info")
    assert run.returncode == 0, run.stderr
    lines = {line.split()[2]: line for line in run.stdout.splitlines() if line.split()[:1] in (["twin"], ["quitter"])}
    assert "loaded" in lines["ejk-twin-a"], run.stdout
    assert "failed" in lines["ejk-twin-b"] and "ejk-twin-a 1.0 (first on sys.path) holds it" in lines["ejk-twin-b"]
    assert "failed" in lines["ejk-quitter"] and "SystemExit: 3" in lines["ejk-quitter"], run.stdout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"backend": "quantum"},
            "flash_attention: backend must be one of 'cpu', 'gpu', 'tpu', 'any', 'auto', got 'quantum'",
        ),
        ({"backend": "all"}, "backend must be one of .*, got 'all'"),  # the registry's listing value, not a device
        (
            {"platform": "reference:quantum"},
            "the backend of platform='reference:quantum' must be one of 'cpu', 'gpu', 'tpu', 'any', got",
        ),
    ],
)
def test_unknown_backend_is_refused_listing_the_known_ones(kwargs, message):
    import jax.numpy as jnp

    from ejkernel.modules import flash_attention

    q = jnp.ones((1, 4, 1, 8))
    with pytest.raises(ValueError, match=message):
        flash_attention(q, q, q, **kwargs)


def test_known_backend_names_and_jax_aliases_are_accepted():
    import jax.numpy as jnp

    from ejkernel.modules import flash_attention
    from ejkernel.modules.operations.configs import FlashAttentionConfig

    q = jnp.ones((1, 4, 1, 8))
    assert flash_attention(q, q, q, backend="any", platform="reference").shape == q.shape
    assert flash_attention(q, q, q, backend=Backend.ANY, platform="reference:any").shape == q.shape
    assert FlashAttentionConfig(backend="CUDA").backend == "gpu"


def test_config_with_an_unknown_backend_is_refused():
    from ejkernel.modules.operations.configs import FlashAttentionConfig

    with pytest.raises(ValueError, match="FlashAttentionConfig: backend must be one of .*'auto', got 'quantum'"):
        FlashAttentionConfig(backend="quantum")


def test_unknown_platform_is_an_error_listing_the_installed_ones():
    import jax.numpy as jnp

    from ejkernel.modules import flash_attention
    from ejkernel.modules.operations.configs import FlashAttentionConfig
    from ejkernel.ops.config.chain import ConfigError
    from ejkernel.plugins import hookimpl

    class Plugin:
        @hookimpl
        def ejkernel_register_kernels(self, registry):
            registry.register("flash_attention", "tpuonly", "tpu", impl=_attention)

    q = jnp.ones((1, 4, 1, 8))
    listed = r"platform 'quantum' is installed; the installed platforms of 'flash_attention' are .*'reference'"
    with pytest.raises(ConfigError, match=listed):
        flash_attention(q, q, q, platform="quantum")
    with pytest.raises(ConfigError, match=listed):
        flash_attention(q, q, q, cfg=FlashAttentionConfig(platform="quantum"))
    register_plugin(Plugin(), "tpuonly-test")
    try:
        with pytest.raises(ConfigError, match=r"'tpuonly' runs on backend 'cpu'\. Installed: .*tpuonly:tpu"):
            flash_attention(q, q, q, platform="tpuonly", backend="cpu")
    finally:
        unregister_plugin("tpuonly-test")
