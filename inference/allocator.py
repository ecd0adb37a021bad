"""glibc's malloc told to keep the memory a frame frees, so that the next frame does not fault it in anew.

At 64 x 2048 a frame allocates and frees tens of megabytes at a time: the condition (16 MB), the network's
activations (8 MB a map at the first level), the sweeps' point arrays. glibc hands a freed block above its
mmap threshold back to the system at once, and trims the top of its heap once more than twice that lies free;
the next frame, or the next sampler step, touches that memory again one page fault at a time. On the shared
2-core VM a 64 x 2048 frame took 5 k-60 k page faults, most inside the network's forward passes, and 17-240 ms
of kernel time under load (the bare network, called in a loop, took none); with the thresholds below, none
and 2-12 ms.

The thresholds: blocks up to `MMAP_THRESHOLD` (the most `mallopt` accepts) come from the heap, and up to
`TRIM_THRESHOLD` free at its top stay there. The process keeps what its largest frame needed instead of
giving it back between frames; its peak does not change. Other C libraries are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from functools import cache

logger = logging.getLogger(__name__)

#: `mallopt` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap: glibc's ceiling for the mmap threshold on 64-bit systems.
MMAP_THRESHOLD = 32 * 2**20
#: Free memory kept at the top of the heap.
TRIM_THRESHOLD = 2**30


@cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; False where the C library is not glibc or
    refuses them (nothing changes then)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not done:
        logger.info("glibc refused the malloc thresholds; freed memory goes back to the system as before")
    return done
