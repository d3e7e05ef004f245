"""What every entry point's command line shares: a parser whose --help names the command as it is
typed and shows each flag's default."""
import argparse

import torch


class DefaultsHelp(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already names its default, the flag
    has none (None: unset, the program decides) or it is a switch that takes no value."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0 or \
                action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser for `prog` ("python train.py", "python -m tinydiff.bench", ...)."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=DefaultsHelp)


def add_device(parser: argparse.ArgumentParser):
    """--device, the same on every entry point."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when a GPU is visible, else cpu)")
