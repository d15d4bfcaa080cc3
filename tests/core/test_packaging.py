"""The install extras the README promises: ``ejkernel-core[gpu]``, ``[tpu]`` and ``[all]``.

Checked against the checkout's pyproject files (the nox sessions install them: ``tests`` through
``[all]``, ``pallas`` through ``[tpu]``), so an extra that names a missing plugin, a plugin version the
range excludes, or a README that forgot one fails here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = {
    "gpu": {"ejkernel-xla", "ejkernel-triton", "ejkernel-cuda"},
    "tpu": {"ejkernel-pallas"},
    "all": {"ejkernel-xla", "ejkernel-triton", "ejkernel-pallas", "ejkernel-cuda"},
}


def _project(folder: str) -> dict:
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_extra_names_the_plugins_at_their_versions(extra):
    requirements = [Requirement(r) for r in _project("ejkernel-core")["optional-dependencies"][extra]]
    assert {r.name for r in requirements} == EXTRAS[extra]
    for r in requirements:
        version = _project(r.name)["version"]
        assert r.specifier.contains(version), f"{extra}: {r} excludes the checkout's {r.name} {version}"


def test_readme_install_table_lists_every_extra():
    readme = (ROOT / "README.md").read_text()
    for extra in EXTRAS:
        assert re.search(rf"pip install .?ejkernel-core\[{extra}\]", readme), f"README: no install line for [{extra}]"
