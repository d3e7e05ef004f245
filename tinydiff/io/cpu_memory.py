"""Keep freed tensor memory in the process on Linux, so the next step does not fault it back in.

glibc's malloc serves every allocation above its mmap threshold (at most 32 MiB by its own
adjustment) with a fresh `mmap`, and hands it back to the kernel with `munmap` when freed. A
training or decoding step here allocates several tensors of logits over the 50,258-id vocabulary
(a batch of 16 x 17 tokens: 55 MB each), frees them, and allocates them again the next step: every
page is zero-filled by a page fault each time. On a small model that kernel time rivals the
arithmetic (dev/LOG.md has the measurement). Raising the mmap and trim thresholds makes such
blocks come from malloc's heap and stay there for reuse, as PyTorch's caching allocator does on a
GPU. The cost: freed memory stays mapped to the process instead of going back to the system, so
its peak resident memory is higher (dev/LOG.md measures both sides); TINYDIFF_MALLOC=default
trades the speed back for it.

Set by every entry point (io/cli.run_main), the lessons (lessons/common.py) and the test suite; a
no-op off glibc (macOS, Windows, musl), and with TINYDIFF_MALLOC=default in the environment. Tensors
and results are unchanged: only where freed memory goes.
"""
import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameter ids
KEEP = 1 << 30  # bytes: blocks up to 1 GiB come from the heap, and up to 1 GiB of free heap top is kept


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True when they were set."""
    if not sys.platform.startswith("linux") or os.environ.get("TINYDIFF_MALLOC") == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, KEEP), (M_TRIM_THRESHOLD, KEEP), (M_TOP_PAD, 64 << 20)))
