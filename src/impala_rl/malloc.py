"""glibc malloc settings for the learner process.

By default glibc gives freed memory back to the OS once the heap's free top exceeds its trim
threshold (twice a dynamic mmap threshold: at most 64 MB) and serves blocks above the mmap
threshold with fresh mappings. A learner frees hundreds of MB of activations after every
update and allocates them again in the next, so it faults the same pages in every time: the
`pong` preset's learner update (Nature CNN, 80 x 8 batch, one thread) took 40-70k minor page
faults and 100-180 ms of kernel time of its 650-800 ms. With the mmap threshold fixed at its
maximum and trimming only past 2 GB it takes 1-5k faults and 2-11 ms
(``benchmarks/pong_throughput.py`` shows the learner's cost per step). Blocks above 32 MB are
still mapped afresh; RSS stays at the process's peak, which a trainer reaches in its first
update anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: 2 GB of free heap top before a trim


def keep_freed_memory() -> bool:
    """Serve allocations up to 32 MB from the heap and keep freed memory in the process;
    returns whether the settings took (False off Linux/glibc: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
