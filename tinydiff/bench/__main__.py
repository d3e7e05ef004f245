"""python -m tinydiff.bench: see tinydiff/bench/table.py."""
import sys

from tinydiff.bench.table import main
from tinydiff.io.cli import run_main

if __name__ == "__main__":
    sys.exit(run_main(main, interrupted="nothing was written (the --report's finished trainings are kept)"))
