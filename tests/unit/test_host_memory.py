"""A CPU engine's freed host memory is reused, not faulted in afresh (runner/device.py:
keep_freed_host_memory). Each case runs in its own interpreter, since the setting is the
process's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

# Minor page faults of touching a freed 64 MB block's successor (glibc's malloc, as torch's CPU
# allocator calls it), then a 200 MB tensor from a thread other than the main one (glibc's other
# arenas cannot map it with mmap off: it must come from the main heap), then the switch's answer.
SCRIPT = """
import ctypes, resource, threading, torch
from pagoda.runner.device import keep_freed_host_memory

kept = keep_freed_host_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def touch(nbytes):
    p = libc.malloc(nbytes)
    libc.memset(p, 1, nbytes)
    libc.free(p)

touch(64 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch(64 << 20)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
seen = []
thread = threading.Thread(target=lambda: seen.append(int(torch.ones(200 << 20, dtype=torch.uint8)[-1])))
thread.start()
thread.join()
print(kept, faults, seen)
"""

PAGES = (64 << 20) // os.sysconf("SC_PAGESIZE")


def _run(switch: str) -> tuple[bool, int, str]:
    env = {**os.environ, "PAGODA_CPU_MALLOC": switch}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    kept, faults, seen = out.stdout.split(maxsplit=2)
    return kept == "True", int(faults), seen.strip()


def test_freed_memory_is_taken_again_without_page_faults() -> None:
    kept, faults, seen = _run("keep")
    if platform.libc_ver()[0] != "glibc":
        assert not kept and seen == "[1]"  # glibc's allocator only: elsewhere a no-op
        return
    assert kept
    assert faults < PAGES // 20, f"{faults} faults touching {PAGES} pages a second time"
    assert seen == "[1]"  # a 200 MB block from a thread's allocation, with mmap off


def test_system_keeps_glibcs_defaults() -> None:
    kept, faults, seen = _run("system")
    assert not kept
    assert faults > PAGES // 2, "glibc maps a 64 MB block afresh each time"
    assert seen == "[1]"
