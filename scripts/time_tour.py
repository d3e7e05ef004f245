"""Run the README's CPU tour exactly as written and time every command: python scripts/time_tour.py.

Reads the first ```bash block under the README heading "## A fifteen-minute CPU tour", joins its
backslash-continued lines, and runs the commands in order in ONE bash process from the
repository root (so `cd`, `export` and an activated venv carry over, as in a terminal), printing
each command's wall time, then the total. Stops at the first command that fails. Run it from a
fresh clone to check the tour's claim; tokenizer and data come from wherever the tour says.
"""
import re
import subprocess
import sys
import time
from pathlib import Path

HEADING = "## A fifteen-minute CPU tour"


def tour_commands(readme: str) -> list[str]:
    """The tour block's commands, continuation lines joined; comment-only lines dropped."""
    section = readme.split(HEADING, 1)
    if len(section) < 2:
        raise SystemExit(f"error: README.md has no '{HEADING}' section")
    block = re.search(r"```bash\n(.*?)```", section[1], re.S)
    if block is None:
        raise SystemExit(f"error: no ```bash block under '{HEADING}'")
    joined = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def main():
    root = Path(__file__).resolve().parent.parent
    commands = tour_commands((root / "README.md").read_text())
    shell = subprocess.Popen(["bash"], cwd=root, stdin=subprocess.PIPE, text=True)
    # Each command reports its status and end time on a marker file the driver polls: one shell,
    # so the environment carries over from command to command.
    marker = root / ".tour-status"
    total = time.perf_counter()
    try:
        for command in commands:
            marker.unlink(missing_ok=True)
            begin = time.perf_counter()
            shell.stdin.write(f"{command}\necho $? > {marker}\n")
            shell.stdin.flush()
            while not marker.exists() or not marker.read_text().endswith("\n"):
                time.sleep(0.2)
            status = int(marker.read_text())
            print(f"[tour] {time.perf_counter() - begin:7.1f} s  {command[:100]}", file=sys.stderr, flush=True)
            if status != 0:
                raise SystemExit(f"error: the tour failed (exit {status}) at: {command}")
    finally:
        marker.unlink(missing_ok=True)
        shell.stdin.close()
        shell.wait()
    print(f"[tour] total {(time.perf_counter() - total) / 60:.1f} min for {len(commands)} commands", file=sys.stderr)


if __name__ == "__main__":
    main()
