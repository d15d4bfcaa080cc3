"""Griffe extension of the documentation build (mkdocs.yml): docstrings written for doctest and Sphinx, as Markdown.

ejkernel's docstrings keep their examples as bare doctests (``>>>`` lines at the docstring's own
indentation, run by ``pytest --doctest-modules``). Markdown would read ``>>>`` as three nested quotes and
join the lines; this fences each such example (from a ``>>>`` line to the next blank line) as a Python
console block, and drops ``# doctest:`` directives. Sphinx roles (``:func:`name```) become code spans.
Only the rendered text changes, never the source.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    """``text`` with each bare doctest example fenced.

    >>> fence_doctests("Example:\\n>>> f(1)  # doctest" ": +ELLIPSIS\\n2").splitlines()
    ['Example:', '', '```pycon', '>>> f(1)', '2', '```']
    >>> fence_doctests("See :func:`~ejkernel.ops.timing.measure`.")
    'See `ejkernel.ops.timing.measure`.'
    """
    out: list[str] = []
    fenced = in_example = False
    for line in text.splitlines():
        if in_example and not line.strip():
            out += ["```", line]
            in_example = False
            continue
        if in_example:
            out.append(_DIRECTIVE.sub("", line))
            continue
        if not fenced:
            line = _ROLE.sub(r"`\1`", line)
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith(">>>"):
            if out and out[-1].strip():
                out.append("")
            out += ["```pycon", _DIRECTIVE.sub("", line)]
            in_example = True
            continue
        out.append(line)
    if in_example:
        out.append("```")
    return "\n".join(out)


class FenceDoctests(griffe.Extension):
    """Fence the bare doctests of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
