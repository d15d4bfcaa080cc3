"""ejkernel-triton: ejkernel's Triton backend (flash attention forward and backward).

``import ejkernel_triton`` stays light: it imports neither Triton nor jax-triton. The kernels load
with ``ejkernel_triton.flash_attention``; the core finds them through the ``ejkernel`` entry point
(``ejkernel_triton.plugin``).

On a CUDA GPU the kernels run through ``jax_triton.triton_call``. Without one (tests on CPU), set
``EJKERNEL_TRITON_INTERPRET=1`` before ``ejkernel_triton.flash_attention`` is first imported: the
same kernels then run in Triton's interpreter (slow; for tests only).
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
    # Triton decorates its own tl.* helpers when it is first imported, so the interpreter switch must
    # be in the environment before that; loading this plugin is usually early enough.
    os.environ["TRITON_INTERPRET"] = "1"

__all__ = ["__version__"]
