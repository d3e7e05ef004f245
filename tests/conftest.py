"""Shared test set-up: the offline tokenizer cache, and tiny models and story files built here."""
import os
from pathlib import Path

import pytest
import torch

from tinydiff.io.cpu_memory import keep_freed_memory

SHARED = Path(__file__).resolve().parents[2] / "shared"

# Our machines reach no tokenizer hub; where the workspace carries tiktoken's cache, use it.
if not os.environ.get("TIKTOKEN_CACHE_DIR") and (SHARED / "tiktoken-cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken-cache")

keep_freed_memory()  # as every entry point does (tinydiff/io/cpu_memory.py): freed logits stay in the process

# pytest.ini runs the suite on pytest-xdist's workers, one per core: each takes its share of the
# cores for torch's threads, and the subprocesses its tests start (lessons, CLIs) inherit that share.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    SHARE = max(1, (os.cpu_count() or 1) // WORKERS)
    torch.set_num_threads(SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", str(SHARE))

STORIES = [
    "Once upon a time, there was a little girl named Lily. She loved to play in the park with her red ball.",
    "Tom had a small dog called Max. Every morning they ran to the river and watched the ducks swim.",
    'The sun was hot. "Can I have some water?" asked Ben. His mom smiled and gave him a big cup.',
    "A little bird could not fly. It was sad. A kind cat helped the bird find its nest in the tree.",
    "Sue found a shiny rock. She showed it to her friend Tim, and they put it in a box of treasures.",
    "One day, a bear wanted honey. He climbed a tall tree, but the bees were angry, so he ran away!",
]


def write_stories(path: Path, n: int) -> Path:
    """A TinyStories-format file of n stories, made by cycling and numbering the ones above."""
    stories = [f"{STORIES[i % len(STORIES)]} This is story number {i}." for i in range(n)]
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories), encoding="utf-8")
    return path


@pytest.fixture
def story_file(tmp_path):
    return write_stories(tmp_path / "stories.txt", 40)


@pytest.fixture
def tiny_config():
    from tinydiff.model import ModelConfig
    return ModelConfig(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64)


@pytest.fixture
def tiny_model(tiny_config):
    from tinydiff.model import Transformer
    torch.manual_seed(0)
    return Transformer(tiny_config).eval()


def pytest_collection_modifyitems(config, items):
    """The `compile` tests run last (a stable sort keeps every other order). Once inductor has compiled
    in a process, Triton's interpreter there fails ("Cannot call @triton.jit'd outside of the scope of
    a kernel"), and the kernel tests run their kernels in it. Importing torch._dynamo does the same, so
    a test module imports it inside its compile tests, never at the top."""
    items.sort(key=lambda item: item.get_closest_marker("compile") is not None)


# Checkpoints of untrained tiny models, as the entry points' tests (generate.py, the bench) load them.
@pytest.fixture
def ckpt(tmp_path, tiny_model, tiny_config):
    from tinydiff.io.checkpoint import save_checkpoint
    save_checkpoint(tmp_path / "ckpt.pt", kind="ar", config=tiny_config, model=tiny_model)
    return tmp_path / "ckpt.pt"


@pytest.fixture
def mdlm_ckpt(tmp_path, tiny_config):
    from tinydiff.io.checkpoint import save_checkpoint
    from tinydiff.model import Transformer
    config = type(tiny_config)(**{**tiny_config.__dict__, "causal": False})
    torch.manual_seed(1)
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=config, model=Transformer(config))
    return tmp_path / "mdlm.pt"

