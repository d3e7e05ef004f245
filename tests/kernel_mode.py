"""The kernel tests' set-up: Triton's interpreter on CPU, compiled kernels on a GPU. Not a test file.

tests/test_kernels.py (each kernel against its reference), tests/test_kernel_paths.py (the
model paths with and without kernels) and tests/test_kernels_fp4.py (the FP4 experts' kernel and
path) import it before anything else from tinydiff, with
`from kernel_mode import DEVICE, INTERPRET, triton_mode`: the autouse fixture then applies to them.

@triton.jit decides between compiled and interpreted kernels when a kernel module is *imported*
(it reads TRITON_INTERPRET then), so the variable is set before the kernel imports below. Afterwards
it is put back as it was and set only while a kernel test runs (the fixture): on CPU,
kernels.use_triton() follows it, and the rest of the suite, in the same pytest process, keeps the
PyTorch references. With a CUDA GPU (scripts/gpu_check.sh sets TRITON_INTERPRET=0) the kernels run
compiled.
"""
import os

import pytest
import torch

OUTER = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = OUTER if OUTER is not None else "0" if torch.cuda.is_available() else "1"
pytest.importorskip("triton")

from tinydiff import kernels  # noqa: E402
from tinydiff.kernels import masked_attention, moe_ffn, sampler_step  # noqa: E402, F401 (now, see above)

INTERPRET = kernels.interpreting()
if INTERPRET != (type(sampler_step._sampler_step_kernel).__name__ == "InterpretedFunction"):
    raise RuntimeError("Triton was imported before the kernel tests set TRITON_INTERPRET (by an earlier "
                       "test or by library code importing a kernel module at import time). Import kernel "
                       "modules lazily, where kernels.for_inference() is True, or set TRITON_INTERPRET=1 "
                       "before pytest starts.")
if OUTER is None:
    del os.environ["TRITON_INTERPRET"]
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("the kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def triton_mode(monkeypatch):
    """While a kernel test runs, TRITON_INTERPRET says what the kernel modules were imported as."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if INTERPRET else "0")
