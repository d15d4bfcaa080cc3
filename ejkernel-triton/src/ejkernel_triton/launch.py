"""The one wrapper around Triton kernel launches in ejkernel-triton.

Kernels never call ``jax_triton`` themselves; they call :func:`launch`, which

* on a CUDA GPU hands the ``@triton.jit`` kernel to ``jax_triton.triton_call`` (compiled by Triton,
  launched by XLA as a custom call), and
* in interpreter mode runs the *same* kernel in Triton's interpreter on the host, inside
  ``jax.pure_callback``, with :class:`HostTensor` standing in for the torch tensors the interpreter
  expects. This is how the kernels are tested on machines without a GPU. It is slow and for tests
  only.

The calling convention is jax-triton's: the kernel's parameters are the positional ``args`` (arrays
and Python scalars, in order), then one pointer per output of ``out_shape``, then the keyword
``constexprs``.

Interpreter mode is chosen once, when this module is first imported: it is on when
``EJKERNEL_TRITON_INTERPRET=1`` (this module then sets ``TRITON_INTERPRET=1``) or when
``TRITON_INTERPRET=1`` is already set. Triton 3.x reads ``TRITON_INTERPRET`` when ``@triton.jit``
*decorates* a function (``triton.knobs.runtime.interpret``, read at each access) -- and Triton's own
``triton.language`` helpers (``tl.max``, ``tl.sum``, ...) are decorated when ``triton`` is first
imported. So the variable must be set **before anything imports triton** (set it in the
environment of the process, or first thing in a ``conftest.py``); the kernel modules import this
module before they define their kernels. If Triton was imported earlier without it,
:data:`INTERPRET_PROBLEM` says so and :func:`launch` refuses to run interpreted kernels.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

INTERPRET_ENV = "EJKERNEL_TRITON_INTERPRET"
#: ``EJKERNEL_TRITON_COMPILE_ONLY=90`` (a CUDA compute capability): compile every launched kernel
#: for that GPU on this host, typed exactly as jax-triton would type the call, and return zeros
#: instead of running it. For CI without a GPU: catches Triton compile errors the interpreter
#: cannot (the interpreter is not the compiler). Incompatible with interpreter mode.
COMPILE_ONLY_ENV = "EJKERNEL_TRITON_COMPILE_ONLY"
#: ``EJKERNEL_TRITON_IR_DUMP=DIR`` (with ``COMPILE_ONLY``): also write each compiled kernel's TTGIR and PTX to
#: ``DIR``, a pair of files per kernel and specialisation. ``benchmarks/ir_compare.py`` compares two dumps: a
#: refactor that leaves every compiled kernel's operations as they were is shown so without a GPU.
IR_DUMP_ENV = "EJKERNEL_TRITON_IR_DUMP"

if os.environ.get(INTERPRET_ENV) == "1":
    # Must happen before any ``@triton.jit`` of ours runs (see the module docstring).
    os.environ["TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import triton  # noqa: E402

from ejkernel.device import cdiv, fold_vmap, shared_memory_per_block  # noqa: E402


def _triton_interpret_flag() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.4
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


#: Whether the kernels defined after this import run in Triton's interpreter.
INTERPRET: bool = _triton_interpret_flag()


def _interpret_problem() -> str | None:
    if not INTERPRET:
        return None
    from triton.language import standard

    if type(standard.max).__name__ == "JITFunction":
        return (
            "TRITON_INTERPRET=1 (or EJKERNEL_TRITON_INTERPRET=1) was set after triton had been imported, so "
            "triton.language's own helpers (tl.max, tl.sum, ...) are compiled-mode functions the interpreter cannot "
            "call; set the variable before anything imports triton (e.g. in the environment of the process)"
        )
    return None


#: Why interpreter mode cannot work in this process (None when it can, or when not interpreting).
INTERPRET_PROBLEM: str | None = _interpret_problem()

__all__ = ["COMPILE_ONLY_ENV", "INTERPRET", "INTERPRET_ENV", "INTERPRET_PROBLEM", "HostTensor", "cdiv", "launch"]


# --------------------------------------------------------------------------------------------------
# Host-array adapter for the interpreter.
#
# Triton's interpreter (3.x) copies every argument that has ``data_ptr()`` "to the host" with torch's
# storage API (``untyped_storage()``, ``new_empty``, ``set_``, ``copy_``), reads ``dtype`` to type the
# pointer, then works on raw addresses. Our arrays already live on the host, so the adapter shares
# one numpy buffer between "device" and "host" views and every copy is a no-op.
# --------------------------------------------------------------------------------------------------


class _HostStorage:
    def __init__(self, owner: HostTensor) -> None:
        self.owner = owner

    def data_ptr(self) -> int:
        return self.owner.data_ptr()

    def cpu(self) -> _HostStorage:
        return self

    def copy_(self, other: Any) -> _HostStorage:
        if other.data_ptr() != self.data_ptr():  # never the case for our no-op host copies
            raise RuntimeError("HostTensor storage copies across buffers are not supported")
        return self


class HostTensor:
    """A C-contiguous numpy array dressed as the torch tensor Triton's interpreter expects."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.ascontiguousarray(array)

    # what the interpreter and Triton's argument specialization read
    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def device(self) -> str:
        return "cpu"

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostStorage:
        return _HostStorage(self)

    def new_empty(self, *_: Any, **__: Any) -> HostTensor:
        return HostTensor(self.array)

    def set_(self, storage: _HostStorage, *_: Any) -> HostTensor:
        self.array = storage.owner.array
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return self.array.itemsize

    def numel(self) -> int:
        return self.array.size

    def cpu(self) -> HostTensor:
        return self

    def copy_(self, other: HostTensor) -> HostTensor:
        if other.data_ptr() != self.data_ptr():
            np.copyto(self.array, other.array)
        return self


def _patch_interpreter_for_numpy_2_4() -> None:
    """triton < 3.7's interpreter turns scalar tensors (numpy arrays of shape (1,)) into loop bounds
    with ``int(array)``, which numpy >= 2.4 refuses; newer Triton uses ``int(array.squeeze())``.
    Re-register ``__index__`` the way newer Triton does (interpreter only; no effect on GPU runs)."""
    try:
        int(np.ones((1,), np.int32))
        return  # numpy still converts size-1 arrays
    except TypeError:
        pass
    from triton.runtime import interpreter as _interp

    original = getattr(_interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_ejkernel_patched", False):
        return

    def _patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    _patch_lang_tensor._ejkernel_patched = True  # type: ignore[attr-defined]
    _interp._patch_lang_tensor = _patch_lang_tensor


if INTERPRET:
    _patch_interpreter_for_numpy_2_4()

# The interpreter keeps the current program id in module-level state: one launch at a time.
_INTERPRETER_LOCK = threading.Lock()


def _is_scalar(x: Any) -> bool:
    return isinstance(x, bool | int | float | np.integer | np.floating)


def _uninitialized(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Like device memory that nothing wrote: NaN for floats, a sentinel for integers, so that an
    output element a kernel forgets to store shows up in tests."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return np.full(shape, np.iinfo(dtype).max // 3, dtype)
    if dtype == np.bool_:
        return np.ones(shape, dtype)
    return np.full(shape, np.nan, dtype)


def _is_interpreted(kernel: Any) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def launch(
    kernel: Any,
    *args: Any,
    out_shape: Sequence[jax.ShapeDtypeStruct],
    grid: tuple[int, ...],
    num_warps: int = 4,
    num_stages: int = 2,
    zeroed_outputs: Sequence[int] = (),
    aliases: dict[int, int] | None = None,
    name: str = "",
    **constexprs: Any,
) -> tuple[jax.Array, ...]:
    """Launch ``kernel`` over ``grid``; returns one array per entry of ``out_shape``.

    ``args`` are arrays (inputs, passed as pointers) and Python scalars (runtime scalar arguments);
    outputs listed in ``zeroed_outputs`` are zero-filled before the launch, the others start
    uninitialized (NaN-filled in the interpreter, to catch missed stores). ``aliases`` maps the
    position in ``args`` of an array to an output that starts as that array and shares its buffer
    (the kernel gets both pointers; it writes some parts of the output and keeps the rest), so that
    launches of different kernels can fill one array.

    Python floats are passed as **float32** scalars (jax-triton would type a Python float as fp64,
    which silently turns float32 arithmetic with it into float64); ints as i32 (u32/i64 when they
    do not fit); a scalar equal to 1 becomes the compile-time constant 1 (jax-triton's rule).
    """
    args = tuple(np.float32(a) if isinstance(a, float) else a for a in args)
    out_shape = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape)
    grid = tuple(int(g) for g in grid)
    aliases = dict(aliases or {})
    for i, o in aliases.items():
        if _is_scalar(args[i]) or (args[i].shape, args[i].dtype) != (out_shape[o].shape, out_shape[o].dtype):
            raise ValueError(f"launch: aliases[{i}] = {o}: argument {i} is not an array like output {o}")
    if any(g == 0 for g in grid):  # an empty launch: nothing to compute
        return tuple(
            args[next(i for i, o in aliases.items() if o == j)]
            if j in aliases.values()
            else jax.numpy.zeros(s.shape, s.dtype)
            if j in zeroed_outputs
            else jax.numpy.empty(s.shape, s.dtype)
            for j, s in enumerate(out_shape)
        )
    array_at = [i for i, a in enumerate(args) if not _is_scalar(a)]
    # jax-triton numbers aliased inputs among the array arguments
    array_aliases = {array_at.index(i): o for i, o in aliases.items()}

    def call(*arrays: Any) -> tuple[jax.Array, ...]:
        full = list(args)
        for i, a in zip(array_at, arrays, strict=True):
            full[i] = a
        if _is_interpreted(kernel):
            return _launch_interpreted(
                kernel, tuple(full), out_shape, grid, tuple(zeroed_outputs), array_aliases, constexprs
            )
        if os.environ.get(COMPILE_ONLY_ENV):
            return _compile_only(
                kernel, tuple(full), out_shape, num_warps, num_stages, constexprs, int(os.environ[COMPILE_ONLY_ENV])
            )
        return _launch_compiled(
            kernel,
            tuple(full),
            out_shape,
            grid,
            num_warps,
            num_stages,
            tuple(zeroed_outputs),
            array_aliases,
            name,
            constexprs,
        )

    # jax-triton's primitive refuses vmap, and the grid and scalars here were sized for one element:
    # a vmapped launch runs once per element (fold_vmap's sequential rule). Launchers that know their
    # batch axis fold vmap into it before they get here (e.g. flash_attention.interface._forward).
    # Used in both modes, so that the interpreter tests run the same batching code as the GPU.
    return fold_vmap(call, in_axes=None, out_axes=None)(*(args[i] for i in array_at))


def _launch_compiled(
    kernel: Any,
    args: tuple[Any, ...],
    out_shape: tuple[jax.ShapeDtypeStruct, ...],
    grid: tuple[int, ...],
    num_warps: int,
    num_stages: int,
    zeroed_outputs: tuple[int, ...],
    aliases: dict[int, int],
    name: str,
    constexprs: dict[str, Any],
) -> tuple[jax.Array, ...]:
    try:
        import jax_triton
    except ImportError as e:  # jax-triton refuses to import without a CUDA/ROCm jaxlib
        raise RuntimeError(
            f"ejkernel-triton: cannot launch {getattr(kernel, '__name__', kernel)!r}: jax_triton is not usable "
            f"here ({e}). On a machine without a GPU, set {INTERPRET_ENV}=1 before anything imports triton to run "
            "the kernels in Triton's interpreter (tests only)."
        ) from e
    outs = jax_triton.triton_call(
        *args,
        kernel=kernel,
        out_shape=list(out_shape),
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        zeroed_outputs=zeroed_outputs,
        input_output_aliases=aliases,
        name=name or getattr(kernel, "__name__", ""),
        **constexprs,
    )
    return tuple(outs)


_TRITON_DTYPES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float64": "fp64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "uint16": "u16",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
    "bool": "i1",
}
_COMPILED_ONLY: set[Any] = set()


def _scalar_type(x: Any) -> str:
    # jax_triton.triton_lib.get_triton_type, for the scalars launch() passes on
    if isinstance(x, bool | np.bool_):
        return "B"
    if isinstance(x, np.float32):
        return "fp32"
    if isinstance(x, float | np.floating):
        return "fp64"
    v = int(x)
    if -(2**31) <= v < 2**31:
        return "i32"
    return "u32" if 0 <= v < 2**32 else ("i64" if -(2**63) <= v < 2**63 else "u64")


def _compile_only(
    kernel: Any,
    args: tuple[Any, ...],
    out_shape: tuple[jax.ShapeDtypeStruct, ...],
    num_warps: int,
    num_stages: int,
    constexprs: dict[str, Any],
    capability: int,
) -> tuple[jax.Array, ...]:
    """Compile ``kernel`` for CUDA ``capability`` the way jax-triton would (signature, constants,
    16-byte pointer alignment), through ptxas; return zeros. See ``COMPILE_ONLY_ENV``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", capability, 32)
    names = kernel.arg_names
    signature: dict[str, str] = {}
    constants: dict[str, Any] = dict(constexprs)
    attrs: dict[tuple[int, ...], Any] = {}
    aligned = make_backend(target).parse_attr("D")
    for i, a in enumerate((*args, *out_shape)):
        if _is_scalar(a):
            if a == 1:
                constants[names[i]] = 1
            else:
                signature[names[i]] = _scalar_type(a)
        else:
            signature[names[i]] = "*" + _TRITON_DTYPES[np.dtype(a.dtype).name]
            attrs[(i,)] = aligned
    for name in constants:
        signature[name] = "constexpr"
    key = (
        kernel,
        tuple(sorted(signature.items())),
        tuple(sorted((k, repr(v)) for k, v in constants.items())),
        num_warps,
        num_stages,
        capability,
    )
    if key not in _COMPILED_ONLY:
        compiled = triton.compile(
            ASTSource(kernel, signature, constants, attrs),
            target=target,
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
        # what Triton checks when it loads the kernel: opt-in shared memory per block
        limit = shared_memory_per_block(capability)
        if compiled.metadata.shared > limit:
            raise RuntimeError(
                f"{kernel.__name__}: needs {compiled.metadata.shared} bytes of shared memory, "
                f"sm_{capability} has {limit} (num_warps={num_warps}, num_stages={num_stages}, {constexprs})"
            )
        _COMPILED_ONLY.add(key)
        if dump := os.environ.get(IR_DUMP_ENV):
            tag = hashlib.sha1(repr(key[1:]).encode()).hexdigest()[:12]
            for ir in ("ttgir", "ptx"):
                with open(os.path.join(dump, f"{kernel.__name__}-{tag}.{ir}"), "w") as f:
                    f.write(f"// {key[1:]}\n{compiled.asm[ir]}")
    return tuple(jax.numpy.zeros(s.shape, s.dtype) for s in out_shape)


def _launch_interpreted(
    kernel: Any,
    args: tuple[Any, ...],
    out_shape: tuple[jax.ShapeDtypeStruct, ...],
    grid: tuple[int, ...],
    zeroed_outputs: tuple[int, ...],
    aliases: dict[int, int],
    constexprs: dict[str, Any],
) -> tuple[jax.Array, ...]:
    if INTERPRET_PROBLEM is not None:
        raise RuntimeError(
            f"ejkernel-triton: cannot run {getattr(kernel, '__name__', kernel)!r} interpreted: {INTERPRET_PROBLEM}"
        )
    scalar_at = {i: a for i, a in enumerate(args) if _is_scalar(a)}
    arrays = [a for i, a in enumerate(args) if i not in scalar_at]

    def host(*host_arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        start = {o: np.array(host_arrays[i]) for i, o in aliases.items()}
        it = iter(host_arrays)
        call_args = [
            (scalar_at[i].item() if isinstance(scalar_at[i], np.generic) else scalar_at[i])
            if i in scalar_at
            else HostTensor(np.asarray(next(it)))
            for i in range(len(args))
        ]
        outs = [
            start[i]
            if i in start
            else np.zeros(s.shape, s.dtype)
            if i in zeroed_outputs
            else _uninitialized(s.shape, s.dtype)
            for i, s in enumerate(out_shape)
        ]
        with _INTERPRETER_LOCK:
            kernel[grid](*call_args, *[HostTensor(o) for o in outs], **constexprs)
        return tuple(outs)

    return tuple(jax.pure_callback(host, out_shape, *arrays, vmap_method="sequential"))
