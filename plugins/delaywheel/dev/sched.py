"""The CPU slice the embedded cluster's processes ask the kernel's scheduler for, and why.

Beside CPU-bound neighbours (the contract's two `yes > /dev/null` loops on two cores) every durable commit took one
4-ms scheduler tick, whatever the statement (bench/results/2026-11-26-commit-flush.json): the backend sleeps in the
disk's cache flush, and when the flush completes, Linux's scheduler (EEVDF) lets the busy task on that core run on
and notices the woken backend at its next tick (HZ=250). Since Linux 6.12 a task may ask for a shorter slice than
the default (1.4 ms on two cores): `sched_setattr`'s `sched_runtime` under SCHED_OTHER. A woken task with a shorter
slice preempts the running one at once, and a backend asking for 0.5 ms committed beside the same loops in 0.11 ms
p50 instead of 4.0 (bench/results/2026-12-01-cluster-slice.json). A slice is not a priority: the processes' share of
the CPU (their nice weight) stays what it was; they wait less after waking and run in shorter stretches when the CPU
is contended. Kernels before 6.12 accept the request and ignore it. How much the embedded cluster asks for, and how
to change it: `embedded.server_slice_ns`.

The attribute is copied on fork and kept across exec, so the thread that starts the server asks for the slice while
it does (`slice_for_children`), and the postmaster and every process it forks have it. A server started otherwise
(systemd, a container, a managed service) keeps the kernel's default: docs/configuration.md says how to ask.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
from collections.abc import Iterator

SLICE_RANGE_US = (100, 100_000)  # what the kernel accepts (it clamps to this)

# sched_setattr / sched_getattr: glibc has no wrappers, and the numbers are the architecture's.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
# struct sched_attr (SCHED_ATTR_SIZE_VER1): size, policy, flags, nice, priority, runtime, deadline, period,
# util_min, util_max
_ATTR = struct.Struct("IIQiIQQQII")


def _syscall(number: int, *args: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, *args) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _attributes(pid: int) -> tuple[int, ...] | None:
    """Process `pid`'s sched_attr fields (_ATTR's order); None where the machine has no such call."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    attr = ctypes.create_string_buffer(_ATTR.size)
    _syscall(numbers[1], pid, attr, _ATTR.size, 0)
    return tuple(_ATTR.unpack(attr.raw))


def slice_of(pid: int = 0) -> int | None:
    """The slice, in nanoseconds, of process `pid` (0: the calling thread); None where this cannot be asked."""
    current = _attributes(pid)
    return None if current is None else current[5]


def set_slice(pid: int, slice_ns: int) -> bool:
    """Ask for `slice_ns` (0: the kernel's default) for process `pid` (0: the calling thread), keeping its policy and
    nice value. False where the machine has no such call (the request is then not made); another process's needs
    the same user or root."""
    current = _attributes(pid)
    if current is None:
        return False
    _, policy, _, nice, priority, *_ = current
    wanted = _ATTR.pack(_ATTR.size, policy, 0, nice, priority, slice_ns, 0, 0, 0, 0)
    _syscall(_SYSCALLS[platform.machine()][0], pid, ctypes.c_char_p(wanted), 0)
    return True


@contextlib.contextmanager
def slice_for_children(slice_ns: int) -> Iterator[None]:
    """While inside, the calling thread asks for `slice_ns`, so the processes it starts inherit it; it goes back to
    the kernel's default after. Nothing is asked when `slice_ns` is 0, and a kernel or sandbox that refuses the call
    (seccomp) leaves the default: the processes start either way (`slice_of` shows what they got)."""
    try:
        asked = bool(slice_ns) and set_slice(0, slice_ns)
    except OSError:
        asked = False
    try:
        yield
    finally:
        if asked:
            set_slice(0, 0)
