"""Files that must survive a crash, and the run folder that holds them.

Every file this project writes for later (a checkpoint, a token cache, regenerated stories, a
teacher's trajectories) is written atomically: into `.NAME.tmpPID` beside it, flushed to disk, then
renamed over NAME. A crash leaves the old NAME intact, and a kill -9 leaves at most that temp file,
which `remove_stale_temps` deletes at the next start (the PID in its name says whether its writer
is still alive). A file the project reads back to learn from (regenerated stories, a teacher's trajectories) is
also stamped: `write_stamped` records what made it and its sha256 in NAME.stamp.json, and `stamp_holds` checks
both before use, so a file damaged in place (a disk error, another program) or left by another run is made again
instead of trained on. A run folder belongs to one run at a time: `claim_run_folder` holds an exclusive
lock (flock on OUT/.lock, released by the kernel when the process dies, however it dies), and
`StopOnSignal` lets a training loop finish its step and save on Ctrl-C / SIGTERM instead of dying.
Leaves out: locking on Windows (no fcntl there; the claim is skipped) and network filesystems
whose flock is advisory only between clients of one host.
"""
import hashlib
import json
import os
import re
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from tinydiff.checks import UserError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


TEMP = re.compile(r"^\..+\.tmp(\d+)$")  # .NAME.tmpPID


def temp_beside(path: Path) -> Path:
    """The temp file a write of `path` goes through (same folder: os.replace is atomic there)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(folder, owned: bool = False) -> list[Path]:
    """Delete the temp files killed writers left in `folder`: those whose PID is not alive, or all of
    them when this process owns the folder (it holds the run lock, so no one else writes there)."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        match = TEMP.match(path.name)
        if match and path.is_file() and (owned or (int(match[1]) != os.getpid() and not _alive(int(match[1])))):
            try:
                path.unlink(missing_ok=True)
                removed.append(path)
            except OSError:  # a read-only folder (a shared data set): not ours to clean
                pass
    return removed


def write_atomic(path, write):
    """write(f) into a temp file, flushed and fsynced, then renamed over `path`; an OSError (a full
    disk, a read-only folder) is a UserError that says the old file is intact."""
    path = Path(path)
    tmp = temp_beside(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        kept = "the previous one is intact" if path.exists() else "nothing was written"
        raise UserError(f"cannot write {path} ({e.strerror or e}); {kept}: free disk space "
                        "or pass a writable folder") from None
    finally:
        tmp.unlink(missing_ok=True)


def sha256_of(*paths) -> str:
    """The sha256 of the files' contents, one after another."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def stamp_of(path) -> Path:
    return Path(f"{path}.stamp.json")


def write_stamped(path, write, made_by: dict):
    """write_atomic, then the stamp beside it: what made the file (`made_by`, JSON) and its sha256. The old
    stamp goes first and the new one comes last, so a stamp never vouches for a file it was not written with."""
    stamp_of(path).unlink(missing_ok=True)
    write_atomic(path, write)
    stamp = json.dumps({"made_by": made_by, "sha256": sha256_of(path)})
    write_atomic(stamp_of(path), lambda f: f.write(stamp.encode()))


def stamp_holds(path, made_by: dict) -> bool:
    """Whether `path` exists, was made by `made_by` and still has the sha256 its stamp recorded. Where it exists
    but fails (damaged in place, cut short, left by a run with other settings that was killed before its first
    checkpoint, or without a stamp), one notice says it is made again."""
    if not Path(path).exists():
        return False
    try:
        stamp = json.loads(stamp_of(path).read_text())
        if stamp["made_by"] != json.loads(json.dumps(made_by)):  # as JSON reads it back: tuples are lists
            why = "was made by a run with other settings"
        elif stamp["sha256"] != sha256_of(path):
            why = "does not match the checksum it was written with"
        else:
            return True
    except (OSError, ValueError, KeyError, TypeError):
        why = "has no stamp to check it against"
    print(f"notice: {path} {why}; making it again", file=sys.stderr)
    return False


def check_output(path, what: str):
    """Before any work: a file that will be written at the end can be (its folder exists and is
    writable, and it is not a folder itself)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; pass a file path inside it")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise UserError(f"{what} {path}: its folder {folder} does not exist; create it or pass another path")
    if not os.access(folder, os.W_OK):
        raise UserError(f"{what} {path}: its folder {folder} is not writable; pass another path")


def check_run_folder(out: Path, flag: str = "--out"):
    """Before any work: `out` (given as `flag`) is (or can become) a writable folder."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a folder; pass a folder for the run")
    existing = next(p for p in [out, *out.resolve().parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {out}: {existing} is not a writable folder; pass another {flag}")


@contextmanager
def claim_run_folder(out: Path, flag: str = "--out"):
    """Create `out` and hold its lock while the run lives; a second run into it is refused."""
    check_run_folder(out, flag)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".lock", "a+")
    except OSError as e:
        raise UserError(f"{flag} {out}: cannot create the run folder ({e.strerror}); pass another {flag}") from None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                owner = lock.read().strip() or "unknown"
                raise UserError(f"another run (PID {owner}) is using {out}; wait for it to end, or pass "
                                f"another {flag}") from None
            lock.seek(0)
            lock.truncate()
            lock.write(str(os.getpid()))
            lock.flush()
        remove_stale_temps(out, owned=True)
        yield out
    finally:
        if created and [p.name for p in out.iterdir()] == [".lock"]:  # a run that wrote nothing leaves nothing
            (out / ".lock").unlink()
            out.rmdir()
        lock.close()  # closing the file releases the flock


class StopOnSignal:
    """While active, the first Ctrl-C / SIGTERM asks the loop to save and stop after this step;
    a second one interrupts at once. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.requested = True
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
