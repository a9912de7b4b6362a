"""The zeroer's driver launch: the parameter block read back from PTX, and what it refuses (CPU)."""

from __future__ import annotations

import ctypes
import types

import pytest

from kvcore.runtime.zeroer import driver_launch
from kvcore.runtime.zeroer.driver_launch import DriverLaunch, ptx_params

_PTX = """
.visible .entry _zero_blocks_kernel(
	.param .u64 .ptr .global .align 1 _zero_blocks_kernel_param_0,
	.param .u64 .ptr .global .align 1 _zero_blocks_kernel_param_1,
	.param .u32 _zero_blocks_kernel_param_2,
	.param .u32 _zero_blocks_kernel_param_3,
	.param .u32 _zero_blocks_kernel_param_4,
	.param .u64 .ptr .global .align 1 _zero_blocks_kernel_param_5,
	.param .u32 _zero_blocks_kernel_param_6,
	.param .u64 .ptr .global .align 1 _zero_blocks_kernel_param_7,
	.param .u64 .ptr .global .align 1 _zero_blocks_kernel_param_8
)
{
	.reg .b32 %r<4>;
}
"""
_POINTERS = [True, True, False, False, False, True, False]


def _compiled(ptx=_PTX, **meta):
    fields = dict(num_warps=2, shared=0, num_ctas=1, cluster_dims=None, launch_cooperative_grid=False,
                  launch_pdl=False, global_scratch_size=0, profile_scratch_size=0)
    fields.update(meta)
    return types.SimpleNamespace(metadata=types.SimpleNamespace(**fields), asm={"ptx": ptx}, function=0xF00)


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def fake(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        array = (ctypes.c_void_p * 9).from_address(params)
        widths = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                  ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64]
        values = [w.from_address(a).value for w, a in zip(widths, array)]
        seen.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
        return 0

    monkeypatch.setattr(driver_launch, "cu_launch_kernel", lambda: fake)
    return seen


def test_ptx_params_reads_widths_and_pointers():
    assert ptx_params(_PTX) == [(64, True), (64, True), (32, False), (32, False), (32, False), (64, True),
                                (32, False), (64, True), (64, True)]
    with pytest.raises(ValueError, match="no kernel entry"):
        ptx_params(".version 8.0\n")


def test_launch_passes_the_values_written_last(calls):
    launch = DriverLaunch(_compiled(), [0x1000, 0x2000, 0, 0, 77, 0x3000, 12], _POINTERS)
    assert launch.limit == 1 << 31
    launch.params[1].value, launch.params[2].value, launch.params[3].value = 0x2400, 64, 5
    assert launch(40, 0xABC) == 0
    launch.params[3].value = 9
    assert launch(41, 0xDEF) == 0
    (f, grid, block, shared, stream, values, extra), second = calls
    assert (f, grid, block, shared, stream, extra) == (0xF00, (40, 1, 1), (64, 1, 1), 0, 0xABC, None)
    # The scratch pointers Triton appends stay NULL; the kernel has no scratch memory.
    assert values == [0x1000, 0x2400, 64, 5, 77, 0x3000, 12, 0, 0]
    assert second[1] == (41, 1, 1) and second[5][3] == 9 and second[4] == 0xDEF


@pytest.mark.parametrize("meta", [dict(num_ctas=2), dict(cluster_dims=(2, 1, 1)), dict(launch_pdl=True),
                                  dict(launch_cooperative_grid=True), dict(global_scratch_size=128),
                                  dict(profile_scratch_size=8)], ids=repr)
def test_special_launches_are_left_to_triton(calls, meta):
    with pytest.raises(ValueError, match="clusters, a special launch or scratch"):
        DriverLaunch(_compiled(**meta), [1, 2, 0, 0, 3, 4, 5], _POINTERS)


def test_another_parameter_list_is_refused(calls):
    # A kernel with an integer specialized away: six parameters of its own, not seven.
    lines = _PTX.splitlines()
    fewer = "\n".join(line for line in lines if "_param_4," not in line)
    with pytest.raises(ValueError, match="do not match"):
        DriverLaunch(_compiled(fewer), [1, 2, 0, 0, 3, 4, 5], _POINTERS)
    # A pointer where an integer is passed.
    with pytest.raises(ValueError, match="do not match"):
        DriverLaunch(_compiled(), [1, 2, 0, 0, 3, 4, 5], [True, True, True, False, False, True, False])
    # Values wider than the kernel's 32-bit integers.
    with pytest.raises(ValueError, match="does not fit"):
        DriverLaunch(_compiled(), [1, 2, 0, 0, 1 << 31, 4, 5], _POINTERS)
    assert calls == []


def test_without_the_driver_library_nothing_is_built(monkeypatch):
    monkeypatch.setattr(driver_launch, "cu_launch_kernel", lambda: None)
    with pytest.raises(ValueError, match="cuLaunchKernel"):
        DriverLaunch(_compiled(), [1, 2, 0, 0, 3, 4, 5], _POINTERS)


def test_an_empty_triton_hook_chain_is_no_hook(monkeypatch):
    from kvcore.runtime.zeroer import kernel

    runtime = types.SimpleNamespace(launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=None)
    monkeypatch.setattr(kernel.triton, "knobs", types.SimpleNamespace(runtime=runtime), raising=False)
    hooks = kernel._launch_hooks()
    assert hooks() == (None, None)
    runtime.launch_enter_hook.calls.append(print)
    assert hooks()[0] is runtime.launch_enter_hook
    runtime.launch_exit_hook = print  # a plain callable (older Triton) is a hook
    assert hooks() == (runtime.launch_enter_hook, print)


def test_packed_id_words_hold_two_ids_each(calls):
    ptx = _PTX.replace(".param .u32 _zero_blocks_kernel_param_6", ".param .u64 _zero_blocks_kernel_param_6")
    ptx = ptx.replace(".param .u32 _zero_blocks_kernel_param_4", ".param .u64 _zero_blocks_kernel_param_4")
    launch = DriverLaunch(_compiled(ptx), [1, 2, 0, 0, 0, 4, 0], _POINTERS)
    with pytest.raises(ValueError, match="not all 64-bit"):
        launch.pack_ints(3, 2, 2)
    launch.params[4].value = 123  # replaced below: the packed array backs it from now on
    words = launch.pack_ints(4, 1, 2)
    words[:2] = [5, 9]
    assert launch.params[4].value == 5 | 9 << 32
    launch(1, 0)
    array = (ctypes.c_void_p * 9).from_address(launch._array_address)
    assert ctypes.c_uint64.from_address(array[4]).value == 5 | 9 << 32
    assert ctypes.c_int32.from_address(array[3]).value == 0 and len(calls) == 1
