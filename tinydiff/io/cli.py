"""What every entry point's command line shares: a parser whose --help names the command as it is
typed and shows each flag's default, one-line errors, and `run_main`, which turns what can end a
program early into one line and an exit status instead of a traceback:
  a user mistake (UserError, a bad flag)  -> "error: ..." on stderr, status 1 (argparse's: 2)
  Ctrl-C outside a training loop           -> "interrupted: ..." on stderr, status 130
  stdout closed by its reader (`| head`)   -> quiet, status 1 (Python's own convention for EPIPE)
A training loop catches Ctrl-C itself, to save first (checkpoint.StopOnSignal).
"""
import argparse
import os
import sys

import torch

from tinydiff.checks import UserError


class DefaultsHelp(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already names its default, the flag
    has none (None: unset, the program decides) or it is a switch that takes no value."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0 or \
                action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line that says where the flags are listed."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser for `prog` ("python train.py", "python -m tinydiff.bench", ...)."""
    return OneLineParser(prog=prog, description=description, formatter_class=DefaultsHelp)


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


COMPILE_MODES = ("default", "max-autotune")  # what --compile takes; a bare --compile is "default"
