"""keep_freed_memory: a 16 MiB block comes from the reusable heap, not from its own mmap."""

import ctypes
import subprocess
import sys

import pytest

CHECK = """
import ctypes, sys
from hybridflow.utils.memory import keep_freed_memory
if sys.argv[1] == "on":
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.mallinfo2.restype = Mallinfo2
before = libc.mallinfo2().hblks
block = libc.malloc(16 << 20)  # above glibc's default mmap threshold (128 KiB .. 32 MiB), below the raised one
print(libc.mallinfo2().hblks - before)  # blocks served by their own mmap
"""


def _mmapped_blocks(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHECK, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_a_large_block_comes_from_the_heap_only_with_the_setting():
    try:
        _ = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("libc is not glibc >= 2.33")
    assert _mmapped_blocks("off") == 1  # default glibc: its own mmap, unmapped again on free
    assert _mmapped_blocks("on") == 0
