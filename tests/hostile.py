"""What the hostile-input tests share: run an entry point's main(argv) in-process the way its
`__main__` does (tinydiff.io.cli.run_main), and the checks every refused case must pass: a non-zero
exit status, exactly one line on stderr that starts with `error:`, no traceback, and nothing
written or changed under the watched folders. Also the tampered checkpoints every loader meets.
A case that allocates without bound must fail its test, not take the machine: an in-process case runs with
this process's address space capped at what it maps already plus 4 GiB (`capped`), and `run_capped` runs a
command in a child process capped at 4 GiB (the huge-count tables: a child starts clean, for ~2 s each)."""
import math
import os
import pickle
import resource
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.io.cli import run_main

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # generate.py sits at the root, beside train.py
    sys.path.insert(0, str(ROOT))

# The neighbours of every bad number: tried on each numeric flag.
NON_FINITE = ("nan", "inf", "-inf")


def snapshot(*folders) -> dict:
    """Every file under the folders: its size and modification time."""
    files = {}
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file():
                stat = path.stat()
                files[path] = (stat.st_size, stat.st_mtime_ns)
    return files


CAP = 4 * 2**30  # bytes a case may map beyond what the process has: a tiny model's run maps under 1 GiB


@contextmanager
def capped(extra: int = CAP):
    """This process's address space capped (RLIMIT_AS's soft limit) at what it maps now plus `extra`, and
    lifted again after: an allocation past it raises MemoryError here instead of growing until the kernel
    kills something. Linux only (it reads /proc/self/status); elsewhere it caps nothing."""
    status = Path("/proc/self/status")
    if not status.exists():
        yield
        return
    mapped = next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines() if line.startswith("VmSize"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra if hard == resource.RLIM_INFINITY else min(hard, mapped + extra)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def exit_status(main, argv, **run_options) -> int:
    """main(argv) run as its __main__ runs it, under `capped`; argparse's own exit (usage errors) included."""
    try:
        with capped():
            return run_main(main, [str(a) for a in argv], **run_options)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


def refused(main, argv, capsys, *watched) -> str:
    """Assert that main refuses argv with one `error:` line and writes nothing; return the line."""
    before = snapshot(*watched)
    capsys.readouterr()
    status = exit_status(main, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status != 0, f"exit status 0 for {argv}"
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line for {argv}: {err!r}"
    assert snapshot(*watched) == before, f"{argv} wrote or changed files"
    return lines[0]


class Code:
    """An object whose unpickling runs code (os.system): a weights-only load must refuse it."""

    def __reduce__(self):
        return os.system, ("echo pwned > pwned.txt",)


def tampered_checkpoints(folder: Path, model, config, kind: str = "ar") -> dict:
    """name -> path of a checkpoint damaged one way, each from a good one of `model`."""
    folder.mkdir(parents=True, exist_ok=True)
    good = folder / "good.pt"
    save_checkpoint(good, kind=kind, config=config, model=model, step=3)
    variants = {
        "huge n_layer": lambda c: c["config"].update(n_layer=10**6),
        "n_head 0": lambda c: c["config"].update(n_head=0),
        "string size": lambda c: c["config"].update(d_model="32"),
        "float size": lambda c: c["config"].update(d_ff=64.0),
        "norm_eps -1": lambda c: c["config"].update(norm_eps=-1.0),
        "other vocabulary": lambda c: (c["config"].update(vocab_size=1000),
                                       c["model"].update({"embed.weight": torch.zeros(1000, config.d_model)})),
        "wrong shape": lambda c: c["model"].update({"embed.weight": torch.zeros(7, 7)}),
        "missing weights": lambda c: c.pop("model"),
        "missing config": lambda c: c.pop("config"),
        "unknown kind": lambda c: c.update(kind="gpt5"),
        "no kind": lambda c: c.pop("kind"),
        "negative step": lambda c: c.update(step=-5),
        "NaN weights": lambda c: c["model"]["norm.weight"].fill_(math.nan),
        "config a list": lambda c: c.update(config=[1, 2]),
        "weights not tensors": lambda c: c["model"].update({"norm.weight": [1.0, 2.0]}),
    }
    paths = {}
    for name, damage in variants.items():
        ckpt = torch.load(good, weights_only=True)
        damage(ckpt)
        paths[name] = folder / f"{name.replace(' ', '-')}.pt"
        torch.save(ckpt, paths[name])
    paths["code inside"] = folder / "code.pt"
    torch.save({"format": "tinydiff-checkpoint", "payload": Code()}, paths["code inside"])
    paths["plain pickle"] = folder / "plain.pt"
    with open(paths["plain pickle"], "wb") as f:
        pickle.dump({"format": "tinydiff-checkpoint", "payload": Code()}, f)
    paths["truncated"] = folder / "truncated.pt"
    paths["truncated"].write_bytes(good.read_bytes()[:200])
    paths["empty"] = folder / "empty.pt"
    paths["empty"].write_bytes(b"")
    paths["a folder"] = folder / "run"
    paths["a folder"].mkdir(exist_ok=True)
    return paths


def run_capped(args, cap_gib: float = 4, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python ARGS` at the repository's root with its address space capped at cap_gib GiB (RLIMIT_AS): an
    allocation past the cap raises in the child, which then exits with a traceback or an out-of-memory line,
    and the test sees it fail."""
    limit = int(cap_gib * 2**30)

    def cap():  # in the child, before it runs python
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap)
