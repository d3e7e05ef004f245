"""The plumbing every lesson shares, kept here so that each lesson reads top to bottom as what it teaches.

Importing it puts the repository on sys.path (a lesson runs as a script, python lessons/NN_name.py) and
points tiktoken at the workspace's offline cache (../shared/tiktoken-cache) where there is one. Then:
  setup(__doc__, quick, **files)  the title, the flags (--quick, --seed, the files a lesson can show),
                                  one torch thread, freed memory kept (as every entry point) and the seed
  load(path, kinds, label)        a trained checkpoint's model, in eval mode
  load_drafter(path, target)      a trained DFlash drafter, around its target
  random_pair(), random_target()  the random AR models the speculative lessons use without checkpoints
  train(model, loss, steps, lr)   lesson 04's loop, for the toy models a later lesson trains on its way
and a user's mistake (a UserError: a file that is not the checkpoint a flag needs) ends a lesson in one line.
"""
import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
SHARED = ROOT.parent / "shared"  # the workspace's data and tokenizer cache, where there is one
STORIES = SHARED / "data" / "tinystories-sample.txt"
sys.path.insert(0, str(ROOT))
if not os.environ.get("TIKTOKEN_CACHE_DIR") and (SHARED / "tiktoken-cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken-cache")  # offline workspaces

import torch  # noqa: E402

from tinydiff.checks import UserError  # noqa: E402
from tinydiff.io.checkpoint import drafter_from, load_checkpoint, load_model  # noqa: E402
from tinydiff.io.cpu_memory import keep_freed_memory  # noqa: E402
from tinydiff.model import ModelConfig, Transformer  # noqa: E402


def _one_line(kind, error, traceback, default=sys.excepthook):
    """A user's mistake (a file that is not the checkpoint a flag needs) ends a lesson in one line, as
    io/cli.run_main ends an entry point; any other error keeps its traceback."""
    if issubclass(kind, UserError):
        print(f"error: {error}", file=sys.stderr)
    else:
        default(kind, error, traceback)


sys.excepthook = _one_line


def setup(doc: str, quick: str, needs: dict = {}, **files) -> argparse.Namespace:
    """Print the lesson's title (its docstring's first line) and parse its flags: --quick (help: `quick`),
    --seed, and one flag per file it can show, files = {flag: ((default path, ...), help)}. A file flag not
    given takes the first default that exists, unless --quick: args.flag is then a path or None. A flag
    given whose partner needs[flag] is then None is an error (a drafter without its target). Then one
    torch thread (small models run fastest so, and timings stay steady on shared cores), freed memory kept
    for the next step (tinydiff/io/cpu_memory.py: lesson 04 trains in half the time) and the seed."""
    title = doc.strip().splitlines()[0]
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--seed", type=int, default=0)
    for flag, (defaults, help) in files.items():
        parser.add_argument(f"--{flag}", help=f"{help} (default: {' or '.join(map(str, defaults))}, if there)")
    args = parser.parse_args()
    given = {flag for flag in files if getattr(args, flag)}
    for flag, (defaults, _) in files.items():
        if getattr(args, flag) is None and not args.quick:
            setattr(args, flag, next((str(p) for p in defaults if Path(p).exists()), None))
    for flag, partner in needs.items():
        if flag in given and not getattr(args, partner):
            parser.error(f"--{flag} needs --{partner} (no default {partner} was found)")
    torch.set_num_threads(1)
    keep_freed_memory()
    torch.manual_seed(args.seed)
    print(title + "\n")
    return args


def load(path, kinds, label="model"):
    """The model of the checkpoint at `path`, of one of `kinds` (its weights loaded and checked), in eval mode."""
    model, _ = load_model(path, kinds=kinds)
    print(f"{label}: {path}")
    return model.eval()


def load_drafter(path, target):
    """The DFlash drafter of the checkpoint at `path`, rebuilt around `target` (it borrows its embedding and head)."""
    drafter = drafter_from(load_checkpoint(path), target, path)
    print(f"drafter: {path}")
    return drafter.eval()


def random_pair():
    """A random 12-layer AR target whose later layers only nudge the residual stream, and a draft that is its
    first layer (a LayerSkip-style draft), so the two mostly agree: a speculative pair without training."""
    config = ModelConfig(context=256, n_layer=12, n_head=2, d_model=64, d_ff=192)
    target = Transformer(config).eval()
    with torch.no_grad():
        for name, w in target.named_parameters():
            if w.dim() == 2:  # weights large enough that the blocks, not the tied head, decide
                w.normal_(0, 0.3 if name == "embed.weight" else 0.1)
            if name.endswith(("wo.weight", "down.weight")) and not name.startswith("blocks.0."):
                w.mul_(0.05)
    draft = Transformer(ModelConfig(**{**config.__dict__, "n_layer": 1})).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("blocks.") or k.startswith("blocks.0.")})
    return target, draft


def random_target():
    """A tiny random 4-layer AR target whose blocks matter (large weights, as random_pair's): what a drafter
    drafts for without a trained target."""
    target = Transformer(ModelConfig(context=128, n_layer=4, n_head=2, d_model=64, d_ff=192)).eval()
    with torch.no_grad():
        for name, w in target.named_parameters():
            if w.dim() == 2:
                w.normal_(0, 0.3 if name == "embed.weight" else 0.5)
    return target


def train(model, loss, steps: int, lr: float, weight_decay: float = 0.01):
    """Lesson 04's loop: `steps` AdamW steps on loss(step) -> (loss, stats). Returns the last (loss, stats);
    the model is left in eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    for step in range(steps):
        value, stats = loss(step)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
    model.eval()
    return value, stats
