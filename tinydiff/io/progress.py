"""Progress bars, with one switch for all of them: the library's long loops (training, a target
regenerating stories, a teacher writing trajectories) draw tqdm bars through `bar`, and a tool that
runs several of them in one process (the report) routes every bar into its own with `routed_to`."""
from contextlib import contextmanager

from tqdm import tqdm

_bar_class = tqdm


def bar(*args, **kwargs):
    """A tqdm bar, or whatever tqdm-like class a `routed_to` block installed."""
    return _bar_class(*args, **kwargs)


@contextmanager
def routed_to(bar_class):
    """Inside the block, `bar(...)` builds `bar_class(...)` instead of a tqdm bar."""
    global _bar_class
    previous, _bar_class = _bar_class, bar_class
    try:
        yield
    finally:
        _bar_class = previous
