"""Every way to install, test, lint and demo ejkernel; ``nox -l`` lists the sessions.

- ``tests``: the core and every plugin installed together (editable): the doctests of the core's modules and of
  README.md, then the test suite on 8 simulated CPU devices with Triton kernels in Triton's interpreter: every
  conformance suite against every implementation (this is the "everything" configuration), the plugins' own
  tests (``tests/xla`` among them), the model-library examples and the typing test. Four directories run in other
  sessions, so that the two lanes of ``.ci/run`` take about as long: ``tests/reference`` in ``core``,
  ``tests/core`` in ``xla``, most of ``tests/triton`` in ``triton`` (its linear-attention files run here),
  ``tests/pallas`` in ``pallas``.
- ``core``, ``xla``, ``triton``, ``pallas``, ``cuda``: one install configuration each, the core alone
  or the core with exactly that plugin, installed as a user installs them (not editable). Each
  checks that exactly the expected plugins load (``tests/install``, told by ``EJKERNEL_EXPECT_PLUGINS``).
  ``core`` runs the references' hand-checked cases without any plugin (``tests/reference``); ``xla`` the core's
  own tests (``tests/core``: they register the references as a plugin, and some need the XLA kernels);
  ``triton`` and ``pallas`` the conformance suites' float32 comparisons with the reference against their kernels
  installed alone (Triton's GPU registrations, interpreted; the Mosaic TPU kernels in JAX's TPU interpreter);
  then each plugin's own tests (``tests/triton``, ``tests/pallas``; ``tests/xla`` runs in ``tests``).
- ``lint``: ``ruff format --check``, ``ruff check`` and ``mypy`` (configured in pyproject.toml).
- ``demo``: the core and the XLA plugin; runs demo/transformer_block.py, then ``ejkernel info``.
- ``docs``: builds the documentation site (mkdocs.yml: docs/ and the API reference generated from the
  docstrings) with warnings as errors; ``mkdocs serve`` browses it locally.

Arguments after ``--`` replace the default pytest arguments, e.g. ``nox -s xla -- tests/core -x``.
Virtual environments are reused between runs (``nox -R`` skips the installs; ``--reuse-venv=no``,
or deleting ``.nox/``, starts afresh); uv makes them when it is installed (``pip install nox[uv]``).
"""

from __future__ import annotations

from pathlib import Path

import nox
from nox.command import CommandFailed

nox.needs_version = ">=2024.10.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "tests"]

ROOT = Path(__file__).parent
PYTHON = "3.11"
PLUGINS = ("xla", "triton", "pallas", "cuda")
# Plugins that register kernels, so that the conformance suites have something of theirs to check, and
# the pytest options that select them: Triton's kernels are registered for GPUs, and on a CPU the
# suites run them in Triton's interpreter (EJKERNEL_TRITON_INTERPRET=1 below).
# The smoke test of an installed plugin: the suites' float32 comparisons with the reference (``tests`` runs
# every case and dtype once, with every plugin installed).
SMOKE = "(match_reference or matches_reference) and not candidate and float32"
# Triton alone also leaves out recurrent's two packed strong-gate cases (~35 s each in the interpreter on CI; `tests`
# runs them).
CONFORMANCE = {
    "triton": ("--ejkernel-backend=gpu", "-k", f"{SMOKE} and not strong_gates_varlen"),
    "pallas": ("-k", SMOKE),
}
# The CPU test set-up of docs/design.md §11: 8 simulated devices for sharding, Triton kernels interpreted.
TEST_ENV = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    "EJKERNEL_TRITON_INTERPRET": "1",
    # An annotation that refuses a call the op's contract accepts fails the test (users get a warning).
    "EJKERNEL_TYPECHECK": "strict",
}
# Per plugin session: Pallas's TPU kernels register for the CPU too, and run in JAX's TPU interpret mode.
# Only there: interpreting them is slow, and once per CI run is enough (``tests/pallas`` runs them in
# ``tests`` directly, at shapes the conformance suites do not cover).
PLUGIN_ENV = {"pallas": {"EJKERNEL_PALLAS_INTERPRET": "1"}}
# Suites that run in a plugin's session rather than in ``tests`` (so that the two lanes of .ci/run take about as
# long): the Triton and Pallas plugins' own tests, and the core's own tests with the XLA plugin, which their
# XLA-needing cases need (the XLA kernels' conformance suites and ``tests/xla`` run in ``tests``); the Pallas kernels
# run in JAX's TPU and Mosaic GPU interpreters, the Triton kernels in Triton's.
# tests/triton's other linear-attention files (the fused recurrent and the simple/value chunked ones) run in ``tests``
# (2026-12-06, alone: the tests lane 2784 s, the other lane 2472 s, of which triton 1000; the chunked gated delta
# rule's file, ~2.5 min, moved to triton to even them out).
PLUGIN_SUITES = {
    "xla": ("tests/core",),
    "triton": tuple(
        f"tests/triton/{name}.py"
        for name in (
            "test_decode_interpret",
            "test_flash_attention_interpret",
            "test_gdr_chunk_interpret",
            "test_gla_chunk_interpret",
            "test_mla_interpret",
            "test_ring_on_triton_blocks",
        )
    ),
    "pallas": ("tests/pallas",),
}
LINT_TOOLS = ("ruff==0.17.6", "mypy==2.4.1")
# The documentation site (mkdocs.yml); ruff formats the API reference's signatures.
DOCS_TOOLS = ("mkdocs==1.6.1", "mkdocstrings[python]==1.0.8", "mkdocstrings-python==2.0.11", LINT_TOOLS[0])


def _install(session: nox.Session, *distributions: str, editable: bool, extras: str = "") -> None:
    """Install ``ejkernel-<name>`` from this checkout for each name (the core with its testing extra, plus
    ``extras``: the README's ``ejkernel-core[gpu|tpu|all]``, resolved to the plugins' folders given beside it)."""
    args: list[str] = []
    for name in distributions:
        path = f"./ejkernel-core[testing{',' + extras if extras else ''}]" if name == "core" else f"./ejkernel-{name}"
        args += ["-e", path] if editable else [path]
    if not editable and session.venv_backend == "uv":
        # uv keeps a reused environment's copy of a local project until its pyproject.toml changes;
        # rebuild ours so that the installed code is the checkout's. (pip always reinstalls local paths.)
        for name in distributions:
            args += ["--reinstall-package", f"ejkernel-{name}"]
    session.install(*args)


def _pytest(
    session: nox.Session, *default_args: str, expect: tuple[str, ...] | None, extra_env: dict[str, str] | None = None
) -> None:
    """Run pytest (``session.posargs`` replace ``default_args``) with the CPU test environment.

    ``expect``: the entry-point names ``tests/install`` must find loaded (``None``: not checked).
    """
    args = list(session.posargs) or list(default_args)
    missing = [a for a in args if a.startswith("tests") and not (ROOT / a.split("::")[0]).exists()]
    if missing:
        session.error(f"test suites missing from the checkout: {', '.join(missing)}")
    env = {
        **TEST_ENV,
        **(extra_env or {}),
        "EJKERNEL_CACHE_DIR": str(Path(session.create_tmp()) / "ejkernel-cache"),
        # JAX's persistent compilation cache, one per session (.ci/run runs two sessions at once, and JAX locks
        # a shared cache only when it has a size limit): it speeds up local re-runs. No size limit: with one,
        # every write lists and stats the whole directory under the lock, and at the ~20k entries of a full
        # run that made the interpreted tests ~9x slower (CI took 61 min; 41 without the limit).
        "JAX_COMPILATION_CACHE_DIR": str(session.cache_dir / "jax" / session.name),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    if expect is not None:
        env["EJKERNEL_EXPECT_PLUGINS"] = ",".join(expect)
    session.run("pytest", *args, env=env)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The core and every plugin, editable: the doctests of the core and README.md, then the whole test suite."""
    _install(session, "core", *PLUGINS, editable=True, extras="all")
    session.install("flax", "equinox")
    if not session.posargs:  # the doctests first: they take seconds, the suite minutes
        _pytest(
            session,
            "--doctest-modules",
            "--doctest-glob=README.md",
            # The conformance suites that ship in the core run from tests/conformance; not twice.
            "--ignore=ejkernel-core/src/ejkernel/testing/conformance",
            "ejkernel-core/src/ejkernel",
            "README.md",
            expect=None,
        )
    # tests/reference runs in ``core``, the others below in their plugin's session (see PLUGIN_SUITES).
    ignore = ["--ignore=tests/reference", *(f"--ignore={d}" for dirs in PLUGIN_SUITES.values() for d in dirs)]
    _pytest(session, "tests", *ignore, expect=PLUGINS)


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """The core alone, as a user installs it: no plugin loads, and a call says what to install; the references'
    hand-checked cases."""
    _install(session, "core", editable=False)
    _pytest(session, "tests/reference", "tests/install", expect=())


def _plugin_session(plugin: str) -> None:
    def session_fn(session: nox.Session) -> None:
        # The TPU set-up as the README installs it: ejkernel-core[tpu] is the core and ejkernel-pallas.
        _install(session, "core", plugin, editable=False, extras="tpu" if plugin == "pallas" else "")
        suites = ["tests/install"]
        if plugin in CONFORMANCE:
            suites += ["tests/conformance", *CONFORMANCE[plugin]]
        _pytest(session, *suites, expect=(plugin,), extra_env=PLUGIN_ENV.get(plugin))
        if plugin in PLUGIN_SUITES and not session.posargs:  # unfiltered
            _pytest(session, *PLUGIN_SUITES[plugin], expect=(plugin,), extra_env=PLUGIN_ENV.get(plugin))

    session_fn.__name__ = plugin
    session_fn.__doc__ = f"The core with ejkernel-{plugin} alone, as a user installs them: only that plugin loads" + (
        ", and its kernels pass the conformance suites' float32 comparisons." if plugin in CONFORMANCE else "."
    )
    nox.session(name=plugin, python=PYTHON)(session_fn)


for _plugin in PLUGINS:
    _plugin_session(_plugin)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff format --check, ruff check and mypy over the whole checkout."""
    session.install(*LINT_TOOLS)
    _install(session, "core", *PLUGINS, editable=True)  # mypy follows imports into jax, triton, ...
    failed = []
    for command in (("ruff", "format", "--check", "."), ("ruff", "check", "."), ("mypy",)):
        try:
            session.run(*command)
        except CommandFailed:
            failed.append(" ".join(command))  # run the other checks too, so one run shows every problem
    if failed:
        session.error(f"failed: {'; '.join(failed)}")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The core and the XLA plugin: a transformer block's forward and backward on CPU, then ``ejkernel info``."""
    _install(session, "core", "xla", editable=True)
    session.run("python", "demo/transformer_block.py")
    session.run("ejkernel", "info")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site, built from docs/ and the docstrings (mkdocstrings) with warnings as errors."""
    session.install(*DOCS_TOOLS)
    _install(session, "core", *PLUGINS, editable=True)
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site))
    session.log(f"site built in {site}; `mkdocs serve` browses it locally")
