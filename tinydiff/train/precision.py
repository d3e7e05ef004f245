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
`check_fits` refuses, before any work, a batch whose step cannot fit on the device even at its floor.
The scaler's state is part of the training state (`state_dict`), so a resumed fp16 run continues
exactly. Leaves out: fp8, master-weight copies (autocast keeps the weights in float32).
"""
import os
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


def step_floor(model, dtype: str, batch_size: int) -> tuple[int, int]:
    """(bytes, bytes per window): what a training step holds at least. Every trainable parameter's weight,
    gradient and Adam's two moments (16 bytes; a frozen target's weights, 4), and per token, per layer, what
    the backward keeps of a block: its input and two norm outputs, q, k, v and the attention's output (6 x
    d_model), the feed-forward's gate, up and their product (3 x d_ff), in the autocast dtype. A floor, not an
    estimate: the runtime, attention, the logits' chunks and the allocator come on top (`13m` steps measured
    2.6-2.9x it, `tiny`'s 4.8-6.1x)."""
    c = model.config
    per_window = getattr(c, "n_layer", 1) * (6 * c.d_model + 3 * c.d_ff) * (2 if dtype in AUTOCAST else 4) * c.context
    weights = sum((16 if p.requires_grad else 4) * p.numel() for p in model.parameters())
    return weights + per_window * batch_size, per_window


def device_memory(device: str) -> int:
    """Bytes of memory on `device`: the GPU's, or this machine's RAM, or less where this process's address space
    is capped (`ulimit -v`, the hostile-input tests' cap): an allocation past the cap fails as if the RAM ran out."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(device).total_memory
    if not hasattr(os, "sysconf"):  # Windows: not known here, so nothing is refused
        return 1 << 62
    import resource  # Unix only, as sysconf is
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cap = resource.getrlimit(resource.RLIMIT_AS)[0]
    return ram if cap == resource.RLIM_INFINITY else min(ram, cap)


def check_fits(model, dtype: str, batch_size: int, device: str, smaller: str = "--preset or --context"):
    """Refuse a batch whose step_floor passes the device's memory, naming the largest --batch-size whose
    floor x 3 fits (what the measured steps held), or, where no batch does, the flags (`smaller`) that shrink
    the model. `model` may be on the meta device: only its parameters' sizes are read."""
    total = device_memory(device)
    floor, per_window = step_floor(model, dtype, batch_size)
    if floor <= total:
        return
    fits = (total // 3 - (floor - per_window * batch_size)) // per_window
    fix = f"pass --batch-size {fits} or less" if fits >= 1 else f"pass a smaller {smaller}"
    where = "GPU" if device.startswith("cuda") else "machine"
    raise UserError(f"--batch-size {batch_size} cannot fit: a step holds at least {floor / 1e9:.2f} GB, and this "
                    f"{where} has {total / 1e9:.2f} GB; {fix}")
