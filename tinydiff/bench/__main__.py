"""python -m tinydiff.bench: see tinydiff/bench/table.py."""
import sys

from tinydiff.bench.table import main
from tinydiff.errors import UserError

if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
