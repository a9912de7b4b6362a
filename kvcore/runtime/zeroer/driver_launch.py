"""Launch a compiled Triton kernel through the CUDA driver with a parameter block built once.

Triton's launcher binds every argument, reads launch hooks and scratch
allocators on each call; the zeroer's hot path launches one kernel whose
arguments barely change between calls. :class:`DriverLaunch` keeps one
ctypes value per kernel parameter and an array of their addresses, so a
launch is a few ``.value`` writes and one ``cuLaunchKernel`` call.

The parameter list is read from the compiled kernel's PTX entry, not
assumed: it must be exactly the arguments given (pointers where pointers are
expected) plus trailing pointer parameters (Triton's scratch buffers) that
the kernel does not use (their sizes are 0 in its metadata). Anything else —
clusters, cooperative or PDL launches, scratch memory, another parameter
list — raises ``ValueError`` and the caller keeps Triton's launcher.
"""

from __future__ import annotations

import ctypes
import functools
import re

_ENTRY = re.compile(r"\.entry\s+[\w$]+\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.([bsu])(8|16|32|64)\b([^,]*)")
_C_TYPES = {32: ctypes.c_int32, 64: ctypes.c_int64}


@functools.cache
def cu_launch_kernel():
    """``cuLaunchKernel`` from ``libcuda.so.1``, or None where the driver library is missing."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    return fn


def ptx_params(ptx: str) -> list[tuple[int, bool]]:
    """``(bits, is_pointer)`` of every parameter of the (one) kernel entry in ``ptx``."""
    entry = _ENTRY.search(ptx or "")
    if entry is None:
        raise ValueError("no kernel entry found in the PTX")
    return [(int(bits), ".ptr" in rest) for _, bits, rest in _PARAM.findall(entry.group(1))]


class DriverLaunch:
    """``cuLaunchKernel`` of one compiled kernel; ``params[i].value`` sets argument ``i``.

    ``pointers``: for each argument, whether it is a pointer (passed as an
    address). Integer arguments take the width the kernel was compiled with;
    ``limit`` is the bound of the narrowest one (what a value written per call
    must stay below).
    """

    def __init__(self, compiled, values: list[int], pointers: list[bool]) -> None:
        launch = cu_launch_kernel()
        if launch is None:
            raise ValueError("libcuda.so.1 has no cuLaunchKernel")
        meta = compiled.metadata
        cluster = getattr(meta, "cluster_dims", None) or (1, 1, 1)
        if (getattr(meta, "num_ctas", 1) != 1 or tuple(cluster) not in ((1, 1, 1), (1,), ())
                or getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False)
                or getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0)):
            raise ValueError("the kernel needs clusters, a special launch or scratch memory")
        params = ptx_params(compiled.asm["ptx"])
        own, extra = params[: len(values)], params[len(values):]
        if len(own) != len(values) or len(extra) > 2 or any(bits != 64 for bits, _ in extra):
            raise ValueError(f"the kernel's {len(params)} parameters do not match its {len(values)} arguments")
        for (bits, is_pointer), pointer in zip(own, pointers):
            if (pointer and bits != 64) or (not pointer and (is_pointer or bits not in _C_TYPES)):
                raise ValueError(f"parameter kinds {own} do not match the arguments' {pointers}")
        widths = [bits for bits, pointer in zip((b for b, _ in own), pointers) if not pointer]
        self.limit = 1 << (min(widths, default=64) - 1)
        if any(not p and not 0 <= v < 1 << (bits - 1) for v, p, (bits, _) in zip(values, pointers, own)):
            raise ValueError("an integer argument does not fit the kernel's parameter width")
        self.params = [ctypes.c_uint64(v) if p else _C_TYPES[bits](v)
                       for v, p, (bits, _) in zip(values, pointers, own)]
        self.params += [ctypes.c_uint64(0) for _ in extra]
        self._array = (ctypes.c_void_p * len(self.params))(*[ctypes.addressof(p) for p in self.params])
        self._array_address = ctypes.addressof(self._array)
        self._launch = launch
        self._function = compiled.function
        self._threads = 32 * meta.num_warps
        self._shared = meta.shared

    def pack_ints(self, first: int, count: int, per_param: int = 1) -> ctypes.Array:
        """Back parameters ``first : first + count`` by one ``c_int32`` array of ``count * per_param``.

        Each parameter (32-bit for ``per_param=1``, 64-bit for 2) covers
        ``per_param`` consecutive int32 values (little-endian: the first is
        the low half). Writing ``array[:n] = values`` then sets them in one step.
        """
        kind = {1: ctypes.c_int32, 2: ctypes.c_int64}[per_param]
        kept = self.params[first : first + count]
        if len(kept) != count or any(not isinstance(p, kind) for p in kept):
            raise ValueError(f"parameters {first}..{first + count - 1} are not all {32 * per_param}-bit integers")
        packed = (ctypes.c_int32 * (count * per_param))()
        width = 4 * per_param
        self.params[first : first + count] = [kind.from_buffer(packed, width * k) for k in range(count)]
        for k in range(count):
            self._array[first + k] = ctypes.addressof(packed) + width * k
        self._packed = packed  # NOTE: the parameter array points into it
        return packed

    def __call__(self, grid: int, stream: int) -> int:
        """Enqueue ``grid`` programs on ``stream``; the driver's status (0: launched)."""
        return self._launch(self._function, grid, 1, 1, self._threads, 1, 1, self._shared, stream,
                            self._array_address, None)
