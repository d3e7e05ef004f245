"""Mixed precision for training: which dtype a device trains in, its autocast, and fp16's gradient scaler.

  auto   bf16 autocast on a GPU with bf16 units (compute capability >= 8.0: A100, H100, RTX 30xx);
         fp16 autocast with a gradient scaler on one without (T4, V100, P100: the free GPUs), where
         bf16 is emulated and slower than fp32; fp32 on a CPU.
  fp16   autocast to float16 and `torch.amp.GradScaler` (train.py's step): the loss is scaled up
         before backward so small gradients survive float16, the gradients are unscaled before
         clipping, and a step whose gradients hold inf or NaN is skipped (the scale halves) and
         counted. nanoGPT's recipe.
  bf16   autocast to bfloat16 (float32's range: no scaler); refused on a GPU without bf16 units.
  fp32   no autocast.
The scaler's state is part of the training state (`state_dict`), so a resumed fp16 run continues
exactly. Leaves out: fp8, master-weight copies (autocast keeps the weights in float32).
"""
from contextlib import nullcontext

import torch

from tinydiff.checks import UserError

DTYPES = ("auto", "fp32", "bf16", "fp16")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bf16_units(device: str) -> bool:
    return device.startswith("cuda") and torch.cuda.is_bf16_supported(including_emulation=False)


def choose_dtype(requested: str, device: str) -> str:
    """The dtype a run trains in: `requested`, or for "auto" the fastest this device has."""
    if requested not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    cuda = device.startswith("cuda")
    if requested == "auto":
        return "bf16" if bf16_units(device) else "fp16" if cuda else "fp32"
    if requested == "bf16" and cuda and not bf16_units(device):
        name = torch.cuda.get_device_name(device)
        raise UserError(f"--dtype bf16: the {name} has no bf16 units (emulated bf16 is slower than fp32); "
                        "pass --dtype fp16 (or auto, which picks it)")
    return requested


class MixedPrecision:
    """A run's precision: autocast for the forward, the gradient scaler train.py's step goes through
    (fp16's; a disabled one, whose calls pass the loss and the step through, for bf16 and fp32), and
    the count of steps fp16's scaler skipped."""

    def __init__(self, dtype: str, device: str):
        kind = "cuda" if device.startswith("cuda") else "cpu"
        self.dtype, self.skipped = dtype, 0
        self.autocast = torch.autocast(kind, dtype=AUTOCAST[dtype]) if dtype in AUTOCAST else nullcontext()
        self.scaler = torch.amp.GradScaler(kind, enabled=dtype == "fp16")

    def describe(self) -> str:
        return {"fp32": "fp32 (no autocast)", "bf16": "bf16 autocast",
                "fp16": "fp16 autocast with a gradient scaler (skipped steps are counted)"}[self.dtype]

    def state_dict(self) -> dict:
        return {"dtype": self.dtype, "skipped": self.skipped, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict):
        """A checkpoint's precision state; a run resumed in another dtype starts a fresh scaler."""
        if state.get("dtype") != self.dtype:
            return
        self.skipped = int(state.get("skipped", 0))
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
