"""What every entry point's command line shares: a parser whose --help names the command as it is
typed and shows each flag's default, one-line errors, and `run_main`, which turns what can end a
program early into one line and an exit status instead of a traceback:
  a user mistake (UserError, a bad flag)  -> "error: ..." on stderr, status 1 (argparse's: 2)
  Ctrl-C outside a training loop           -> "interrupted: ..." on stderr, status 130
  stdout closed by its reader (`| head`)   -> quiet, status 1 (Python's own convention for EPIPE)
A training loop catches Ctrl-C itself, to save first (files.StopOnSignal). The entry points that
write a story (generate.py, the variants' own in tinydiff/extras/) share `story_parser`'s flags, the
prompt's encoding and `print_story`; the ones that train (train.py, extras/sudoku_train.py) share
`check_fits`, which refuses before any work a batch whose step cannot fit on the device even at its floor.
"""
import argparse
import json
import os
import sys

import torch

from tinydiff.checks import COUNT, SEED, TEMPERATURE, UserError
from tinydiff.io.cpu_memory import keep_freed_memory
from tinydiff.tokenizer import EOT, Tokenizer

COMPILE_MODES = ("default", "max-autotune")  # what --compile takes; a bare --compile is "default"


class DefaultsHelp(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already names its default, the flag
    has none (None: unset, the program decides) or it is a switch that takes no value."""

    def _get_help_string(self, action):
        text = action.help or ""
        says_default = "default" in text
        positional_or_switch = not action.option_strings or action.nargs == 0
        if says_default or positional_or_switch or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line that says where the flags are listed."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser for `prog` ("python train.py", "python -m tinydiff.bench", ...)."""
    return OneLineParser(prog=prog, description=description, formatter_class=DefaultsHelp)


def flag(dest: str) -> str:
    """The command-line flag of a setting or parser dest: max_steps -> --max-steps."""
    return "--" + dest.replace("_", "-")


def given_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The dests of the flags `argv` sets, whatever their values: argparse fills a default only where
    the namespace lacks the attribute, so a namespace preset to a marker keeps it for every flag not given."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != "help"})
    return {dest for dest, value in vars(parser.parse_args(argv, namespace)).items() if value is not unset}


def add_device(parser: argparse.ArgumentParser):
    """--device, the same on every entry point."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when a GPU is visible, else cpu)")


def add_compile(parser: argparse.ArgumentParser, what: str):
    """--compile [MODE], the same on every entry point that decodes; `what`: the help's second half."""
    parser.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                        help="static-shape decode steps compiled with torch.compile (CUDA graphs on a GPU); MODE is "
                        "default, or max-autotune: also time inductor's own matrix products against the BLAS and "
                        f"keep the faster (minutes of compiling on a CPU){what}")


def check_device(device: str):
    """Before any work: a device this machine has."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} but no CUDA GPU is visible; pass --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"--device must be cpu or cuda (cuda:N), got {device!r}")


def run_main(main, argv=None, interrupted: str = "nothing was written") -> int:
    """Run an entry point's main(argv); the exit status, with what ended it early said in one line."""
    keep_freed_memory()  # why: tinydiff/io/cpu_memory.py
    try:
        main(argv)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler, not at interpreter exit
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python's advice: point stdout at devnull so the interpreter's own flush at exit stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def clamp_drafts(k: int, new: int, flag: str = "--k", say: bool = True) -> int:
    """k drafts a round, at most what a round of a `new`-token story can draft (its new tokens less the one the
    target adds): a larger k drafts no more, so it is clamped, said once on stderr (where `say`) before it sizes
    anything."""
    most = max(1, new - 1)
    if k > most and say:
        print(f"notice: {flag} {k} is more than the {most} drafts a round of a {new}-token story can use; drafting at "
              f"most {most} a round", file=sys.stderr)
    return min(k, most)


def story_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the flags every entry point that writes a story shares."""
    p = make_parser(prog, description)
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py (or a folder tinydiff.tools.export "
                   "wrote)")
    p.add_argument("--prompt", required=True, help="the story's opening")
    p.add_argument("--seed", type=SEED, default=1337, help="seeds every random choice: same seed, same output")
    add_device(p)
    p.add_argument("--json", action="store_true", help="print one JSON object {text, prompt_ids, ids, stats}")
    p.add_argument("--temperature", type=TEMPERATURE, help="0 = greedy (default: 0.8 for an AR model, 0 for "
                   "a diffusion LM)")
    p.add_argument("--max-new-tokens", type=COUNT, help="tokens to write (default: until the story ends or the "
                   "context is full; a diffusion LM: 128, as many as fit)")
    return p


def encode_prompt(text: str) -> tuple[Tokenizer, list[int]]:
    """The tokenizer, and the prompt's ids: EOT (every training story follows one: how a model knows a story
    starts), then the text as plain text."""
    if not text.strip():
        raise UserError("the prompt is empty; pass some text, e.g. --prompt 'Once upon a time'")
    tokenizer = Tokenizer()
    return tokenizer, [EOT] + tokenizer.encode(text)


def write_story(args, kinds, decode):
    """What a story-writing entry point does once its flags are parsed: check the device, load --ckpt (a model of
    one of `kinds`), encode --prompt, run decode(model, prompt, generator) -> (new ids, result), print."""
    from tinydiff.io.checkpoint import load_model
    check_device(args.device)
    model, _ = load_model(args.ckpt, args.device, kinds=kinds)
    tokenizer, prompt = encode_prompt(args.prompt)
    ids, result = decode(model, prompt, torch.Generator(args.device).manual_seed(args.seed))
    print_story(args, tokenizer, prompt, ids, result.row())


def print_story(args, tokenizer, prompt: list[int], ids: list[int], stats: dict):
    """The prompt and the new ids up to the story's end (its first EOT) to stdout, the stats on one line to
    stderr; with --json one object to stdout instead."""
    story = ids[:ids.index(EOT)] if EOT in ids else ids
    text = args.prompt + tokenizer.decode(story)
    if args.json:
        print(json.dumps({"text": text, "prompt_ids": prompt, "ids": ids, "stats": stats}))
        return
    print(text)
    print(stats_line(stats), file=sys.stderr)


def stats_line(stats: dict) -> str:
    """One line of stats; what does not apply to this method (None: a tree's alpha) is left out."""
    def shown(v):
        if isinstance(v, list):
            return "[" + ", ".join("-" if x is None else shown(x) for x in v) + "]"
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    names = {"tau": "tau (tokens per round)"}  # a round is one verify forward; the prompt's prefill is not one
    return " | ".join(f"{names.get(k, k)} {shown(v)}" for k, v in stats.items() if v is not None)


# ---- a training step's memory, checked before any work

def step_floor(model, dtype: str, batch_size: int) -> tuple[int, int]:
    """(bytes, bytes per window): what a training step holds at least. Every trainable parameter's weight,
    gradient and Adam's two moments (16 bytes; a frozen target's weights, 4), and per token, per layer, what
    the backward keeps of a block: its input and two norm outputs, q, k, v and the attention's output (6 x
    d_model), the feed-forward's gate, up and their product (3 x d_ff), in the autocast dtype. A floor, not an
    estimate: the runtime, attention, the logits' chunks and the allocator come on top (`13m` steps measured
    2.6-2.9x it, `tiny`'s 4.8-6.1x)."""
    c = model.config
    width = 2 if dtype in ("bf16", "fp16") else 4  # bytes a value: autocast keeps activations in 16 bits
    per_window = getattr(c, "n_layer", 1) * (6 * c.d_model + 3 * c.d_ff) * width * c.context
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
