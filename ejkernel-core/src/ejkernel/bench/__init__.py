"""``ejkernel bench``: every installed implementation of an op and its peers, checked, timed, recorded.

- :mod:`ejkernel.bench.cases`: per op, its shape letters, inputs, reference and FLOP/byte model.
- :mod:`ejkernel.bench.peers`: other libraries' kernels per op (skipped with a reason where missing).
- :mod:`ejkernel.bench.presets`: named shape sets (``--preset flash-h200``).
- :mod:`ejkernel.bench.run`: the run (timed with ``ejkernel.ops.timing``, the autotuner's timer).
- :mod:`ejkernel.bench.schema`: the results file, documented and validated.
- :mod:`ejkernel.bench.report`: markdown tables, PNG plots and BENCHMARKS.md's generated sections.

    >>> from ejkernel.bench import CASES, PRESETS
    >>> CASES["flash_attention"].parse("2x16x8192x128")["T"], PRESETS["flash-h200"].op
    (8192, 'flash_attention')
"""

from ejkernel.bench.cases import CASES, Case, Inputs
from ejkernel.bench.peers import PEERS, Peer, register
from ejkernel.bench.presets import PRESETS, Preset
from ejkernel.bench.schema import SCHEMA, SchemaError, load, validate

__all__ = [
    "CASES",
    "PEERS",
    "PRESETS",
    "SCHEMA",
    "Case",
    "Inputs",
    "Peer",
    "Preset",
    "SchemaError",
    "load",
    "register",
    "validate",
]
