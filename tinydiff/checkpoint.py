"""Checkpoints: atomic save and safe load (tinydiff/kinds.py rebuilds the model one holds).

A checkpoint is a plain dict of tensors and Python primitives, so `torch.load(weights_only=True)`
can read it without unpickling code:
  format, version   marks the file as ours
  kind              "ar", "mdlm", "mdlm-moe", "ar-moe", "dflash", "eagle3": which objective trained it
  config            the ModelConfig as a dict
  model             the state dict
  optimizer         AdamW state (absent in weights-only exports)
  precision         the training dtype, its gradient scaler's state and the steps it skipped (fp16)
  step              optimizer steps taken
  rng               torch CPU (and CUDA) generator states
  data              where the data stream is: {"seed", "index"} of the next batch, and "tokens",
                    the sha256 of the token files (a resumed run must read the same data)
  args              the training settings, so --resume continues the same run
Saving goes through tinydiff/files.py's atomic write (a temp file beside it, fsynced, renamed over
it): a crash mid-save leaves the previous checkpoint intact, and a full disk is one line. Loading
checks every key's type and the weights' values before anything is built (check_contents).
A folder written by `python -m tinydiff.export` (or a Llama folder transformers saved) loads into
the same dict, without the training state (tinydiff/hf_format.py reads it; no pickle involved).
`StopOnSignal` lets a training loop finish its step and save on Ctrl-C / SIGTERM instead of dying
mid-step.
"""
import re
import signal
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from tinydiff.checks import COUNT_OR_NONE
from tinydiff.errors import UserError
from tinydiff.files import write_atomic
from tinydiff.hf_format import read_folder
from tinydiff.model import ModelConfig

FORMAT = "tinydiff-checkpoint"
VERSION = 1
KINDS = ("mdlm", "ar", "mdlm-moe", "ar-moe", "dflash", "eagle3")


def save_checkpoint(path, *, kind: str, config: ModelConfig, model, **extra):
    """Atomically write a checkpoint; `extra` adds optimizer, step, rng, data, args, ..."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "kind": kind, "config": asdict(config),
               "model": model.state_dict(), **extra}

    def write(f):
        try:
            torch.save(payload, f)
        except RuntimeError as e:  # torch's zip writer reports a full disk as a RuntimeError
            raise OSError(f"torch.save stopped part way, is the disk full? {brief_error(e, 80)}") from None

    write_atomic(path, write)


def load_checkpoint(path, map_location="cpu") -> dict:
    """Read and validate a checkpoint (a .pt file, or a folder `python -m tinydiff.export` wrote); every
    failure is a UserError that names the file."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():  # an exported folder (tinydiff/hf_format.py)
        ckpt = {"format": FORMAT, "version": VERSION, **read_folder(path)}
        check_contents(ckpt, path)
        return ckpt
    if path.is_dir():
        hint = f"pass {path / 'ckpt.pt'}" if (path / "ckpt.pt").is_file() else \
            "pass the ckpt.pt inside a run folder, or a folder written by `python -m tinydiff.export`"
        raise UserError(f"checkpoint {path} is a folder; {hint}")
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; pass the ckpt.pt written by train.py (e.g. out/ar-tiny/ckpt.pt)")
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickles; the one line below says it all
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types on garbage bytes
        refused = re.search(r"[Uu]nsupported (?:GLOBAL|global:) (\S+)", str(e))
        if refused:  # what the weights-only unpickler refuses: code, or objects that are not tensors
            raise UserError(f"{path} holds Python objects that are not tensors ({refused[1]}), which tinydiff "
                            "never unpickles; pass a checkpoint written by train.py") from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*Check the documentation", str(e), re.S)
        raise UserError(f"{path} is not a readable checkpoint (truncated or not a torch file: "
                        f"{brief_error(detail[1] if detail else e)}); re-run training or pick another file") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"{path} is not a tinydiff checkpoint (no '{FORMAT}' marker); pass one written by train.py")
    if ckpt.get("version") != VERSION:
        raise UserError(f"{path} has checkpoint version {ckpt.get('version')!r}, this code reads {VERSION}")
    check_contents(ckpt, path)
    return ckpt


def check_contents(ckpt: dict, path):
    """What a checkpoint holds, before anything is built from it: each key's type, a known kind, a
    step count, finite weights (the config's values are checked by its class, in kinds.config_from)."""
    if ckpt.get("kind") not in KINDS:
        raise UserError(f"{path} names no model kind this code knows (kind {ckpt.get('kind')!r}, not one of "
                        f"{', '.join(KINDS)}); pass a checkpoint written by train.py")
    config, weights = ckpt.get("config"), ckpt.get("model")
    if not isinstance(config, dict) or not all(isinstance(key, str) for key in config):
        raise UserError(f"{path} has no model config (a dict of settings): it is damaged; pass another checkpoint")
    if not isinstance(weights, dict) or not weights or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in weights.items()):
        raise UserError(f"{path} has no weights (a dict of named tensors): it is damaged; pass another checkpoint")
    for key in ("args", "optimizer", "rng", "data", "precision"):
        if key in ckpt and not isinstance(ckpt[key], dict):
            raise UserError(f"{path}: its {key} is a {type(ckpt[key]).__name__}, not a dict: it is damaged")
    if "step" in ckpt:
        COUNT_OR_NONE.check(f"{path}: the step count", ckpt["step"])
    if "rng" in ckpt and not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in ckpt["rng"].values()):
        raise UserError(f"{path}: its random-number states are not byte tensors: it is damaged")
    bad = next((key for key, value in weights.items() if value.is_floating_point() and not bool(value.isfinite().all())),
               None)
    if bad is not None:
        raise UserError(f"{path}: weight {bad} holds NaN or inf (the training diverged); use an earlier checkpoint, "
                        "or train again with a lower --lr")


def brief_error(error: Exception, limit: int = 160) -> str:
    """An exception's message squeezed onto one short line, cut at a word."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


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
