"""Running an entry point's main in the test process, as its `__main__` runs it (cli.run_main: a
user mistake becomes one stderr line and an exit status; anything else raises and fails the test).
It saves the interpreter's start (~1.5 s a call). Not a test file: the tests import from it."""
import contextlib
import io
import subprocess

import torch

from tinydiff.io.cli import run_main


def run_in_process(main, *args) -> subprocess.CompletedProcess:
    """main's exit status, stdout and stderr, like subprocess.run's."""
    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_main(main, [str(a) for a in args])
        except SystemExit as e:  # argparse ends a bad command line this way
            code = e.code
        finally:
            torch.set_num_threads(threads)  # e.g. SSD's CLI path pins one thread per model
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1]
