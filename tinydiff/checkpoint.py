"""Checkpoints: atomic save and safe load (tinydiff/kinds.py rebuilds the model one holds).

A checkpoint is a plain dict of tensors and Python primitives, so `torch.load(weights_only=True)`
can read it without unpickling code:
  format, version   marks the file as ours
  kind              "ar", "mdlm", "mdlm-moe", "dflash", "eagle3": which objective trained it
  config            the ModelConfig as a dict
  model             the state dict
  optimizer         AdamW state (absent in weights-only exports)
  step              optimizer steps taken
  rng               torch CPU (and CUDA) generator states
  data              where the data stream is: {"seed", "index"} of the next batch
  args              the training settings, so --resume continues the same run
Saving writes a temp file in the same folder, flushes it to disk, then renames it over the target:
a crash mid-save leaves the previous checkpoint intact. `StopOnSignal` lets a training loop finish its
step and save on Ctrl-C / SIGTERM instead of dying mid-step.
"""
import os
import signal
from dataclasses import asdict
from pathlib import Path

import torch

from tinydiff.errors import UserError
from tinydiff.model import ModelConfig

FORMAT = "tinydiff-checkpoint"
VERSION = 1


def save_checkpoint(path, *, kind: str, config: ModelConfig, model, **extra):
    """Atomically write a checkpoint; `extra` adds optimizer, step, rng, data, args, ..."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "kind": kind, "config": asdict(config),
               "model": model.state_dict(), **extra}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path, map_location="cpu") -> dict:
    """Read and validate a checkpoint; every failure is a UserError that names the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; pass the ckpt.pt written by train.py (e.g. out/ar-tiny/ckpt.pt)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch's weights-only unpickler raises many types on garbage bytes
        raise UserError(f"{path} is not a readable checkpoint (truncated or not a torch file: "
                        f"{brief_error(e)}); re-run training or pick another file") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"{path} is not a tinydiff checkpoint (no '{FORMAT}' marker); pass one written by train.py")
    if ckpt.get("version") != VERSION:
        raise UserError(f"{path} has checkpoint version {ckpt.get('version')}, this code reads {VERSION}")
    return ckpt


def brief_error(error: Exception, limit: int = 160) -> str:
    """An exception's message squeezed onto one short line."""
    return " ".join(str(error).split())[:limit]


class StopOnSignal:
    """While active, the first Ctrl-C / SIGTERM asks the loop to save and stop after this step;
    a second one interrupts at once. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.requested = True
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
