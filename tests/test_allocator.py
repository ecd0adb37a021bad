"""glibc's malloc keeps what a frame frees (`inference.allocator`): the next frame faults none of it in again."""

import platform
import subprocess
import sys

import pytest

from inference.allocator import keep_freed_memory

# a block freed and taken again, as a frame's condition and activations are: page faults of the second touch
PROBE = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from inference.allocator import keep_freed_memory
    assert keep_freed_memory()
size = 30 * 2**20 // 8
block = np.ones(size); del block  # grows the heap (or maps a block) and frees it
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = np.ones(size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the thresholds are glibc's")


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, cwd=".")
    return int(out.stdout.strip())


@glibc
def test_freed_memory_is_taken_again_without_page_faults():
    assert faults("default") > 200  # the block went back to the system (here 514 faults for its 30 MB)
    assert faults("keep") < 20


@glibc
def test_the_thresholds_are_set_once_per_process():
    assert keep_freed_memory() is True and keep_freed_memory() is True
