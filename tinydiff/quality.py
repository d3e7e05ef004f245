"""`python -m tinydiff.quality`: the quality tool's documented command. The tool lives with the other
measuring tools, in tinydiff/bench/quality.py (its --curve in tinydiff/bench/curve.py)."""
import sys

from tinydiff.bench.quality import main
from tinydiff.cli import run_main

if __name__ == "__main__":
    sys.exit(run_main(main))
