"""tinydiff: a small, tested reference for masked diffusion LMs and fast-inference methods."""
from tinydiff.io.cpu_memory import keep_freed_memory

keep_freed_memory()  # why: tinydiff/io/cpu_memory.py
