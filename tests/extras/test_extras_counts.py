"""Spec (issue 77): every count flag of the research variants' entry points at 10^6 and 10^9, each run in a child
process under a 4 GiB address-space cap (hostile.run_capped). A count past what the run can use is clamped to it,
with one `notice:` line, and the story is written as with the clamp; a count no run can use is one `error:` line
naming the largest useful value. Neither allocates in proportion to the count: a case that did fails under the cap.
sudoku_train's flags are each bounded by argparse; their product (--batch-size x the model's size) is refused before
any work where a training step's floor passes the memory (io/cli.check_fits, train.py's check)."""
import json

import pytest
import torch
from hostile import refused, run_capped

from tinydiff.dflash import DFlashConfig, DFlashDrafter
from tinydiff.extras.markov_head import MarkovConfig, MarkovDrafter
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig, Transformer

PROMPT = "Once upon a time"  # EOT and 4 tokens: 27 of the 32-token context left


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Untrained tiny models: an AR target, a diffusion LM, a DFlash drafter (blocks of 4) and one with a Markov
    head, all over the 32-token context."""
    folder = tmp_path_factory.mktemp("counts")
    torch.manual_seed(0)
    config = ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32)
    target = Transformer(config).eval()
    save_checkpoint(folder / "ar.pt", kind="ar", config=config, model=target)
    mdlm = ModelConfig(**{**config.__dict__, "causal": False})
    save_checkpoint(folder / "mdlm.pt", kind="mdlm", config=mdlm, model=Transformer(mdlm))
    drafter = DFlashConfig.for_target(config, block_size=4)
    save_checkpoint(folder / "dflash.pt", kind="dflash", config=drafter, model=DFlashDrafter(drafter, target))
    markov = MarkovConfig(**{**drafter.__dict__, "markov_rank": 2})
    save_checkpoint(folder / "markov.pt", kind="dflash", config=markov, model=MarkovDrafter(markov, target))
    return folder


TOO_MANY = "error: max new tokens must lie in [1, 27]"
DFLASH_K = "notice: --k {} is more than this drafter's 3 drafts a round"
BUDGET = "notice: --budget {} is more than the 27 tree nodes the context has room for"
# entry point -> (its arguments, the tokens it writes, {flag: what a huge count of it gives})
TABLE = {
    "ddtree_sampled": (["--ckpt", "ar.pt", "--draft", "dflash.pt", "--max-new-tokens", 6], 6,
                       {"--k": DFLASH_K, "--budget": BUDGET, "--max-new-tokens": TOO_MANY}),
    "dflash_reject": (["--ckpt", "ar.pt", "--draft", "dflash.pt", "--max-new-tokens", 6], 6,
                      {"--k": DFLASH_K, "--max-new-tokens": TOO_MANY}),
    "markov_head": (["--ckpt", "ar.pt", "--draft", "markov.pt", "--method", "ddtree", "--max-new-tokens", 6], 6,
                    {"--k": DFLASH_K, "--budget": BUDGET, "--max-new-tokens": TOO_MANY}),
    "drafted_diffusion": (["--ckpt", "mdlm.pt", "--draft", "ar.pt", "--max-new-tokens", 8], 8,
                          {"--k": "notice: --k {} is more than a block's 8 positions; drafting at most 7 a round",
                           "--block-length": "error: gen length 8 must be a multiple of the block length {}",
                           "--max-new-tokens": TOO_MANY}),
    "self_correction": (["--ckpt", "mdlm.pt", "--max-new-tokens", 8], 8,
                        {"--revise": "error: revise {} is more than a block's 8 positions; pass at most 8",
                         "--steps": "error: steps {} must be a multiple of the number of blocks (1) and at most the "
                                    "gen length 8",
                         "--block-length": "error: gen length 8 must be a multiple of the block length {}",
                         "--max-new-tokens": TOO_MANY}),
}
CASES = [(name, flag) for name, (_, _, flags) in TABLE.items() for flag in flags]


@pytest.mark.parametrize("name, flag", CASES, ids=[f"{name}{flag}" for name, flag in CASES])
def test_a_huge_count_is_clamped_or_refused_in_bounded_memory(ckpts, name, flag):
    """--FLAG at 10^6 and at 10^9 (one child process each, capped at 4 GiB): a clamp runs and writes its story with
    one notice; a refusal is one error line, with no traceback."""
    argv, new_tokens, flags = TABLE[name]
    for count in (10**6, 10**9):
        args = [ckpts / a if str(a).endswith(".pt") else a for a in argv]
        args = args[:args.index(flag)] + args[args.index(flag) + 2:] if flag in args else args
        res = run_capped(["-m", f"tinydiff.extras.{name}", *args, "--prompt", PROMPT, "--json", flag, count])
        expected = flags[flag].format(count)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert "Traceback" not in res.stderr and "MemoryError" not in res.stderr, res.stderr[-2000:]
        if expected.startswith("notice:"):
            assert res.returncode == 0, res.stderr[-2000:]
            assert len(lines) == 1 and lines[0].startswith(expected), res.stderr
            assert len(json.loads(res.stdout)["ids"]) == new_tokens
        else:
            assert res.returncode != 0 and res.stdout == ""
            assert len(lines) == 1 and lines[0].startswith(expected), res.stderr


def test_a_sudoku_batch_past_the_memory_is_refused_before_any_work(tmp_path):
    """--batch-size 4096 and --d-model 1024 each pass their bounds; together a step holds at least 72 GB. Before
    the check it trained until the allocator refused (a traceback under the cap). The cap is this process's
    memory, so the batch named is the largest whose step floor x 3 fits in 4 GiB."""
    res = run_capped(["-m", "tinydiff.extras.sudoku_train", "--out", tmp_path / "out", "--minutes", "0.05",
                      "--puzzles", "2", "--d-model", "1024", "--batch-size", "4096"], timeout=60)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: --batch-size 4096 cannot fit: "), res.stderr[-2000:]
    assert "this machine has 4.29 GB; pass --batch-size 31 or less" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_sudoku_model_past_the_memory_names_its_size(tmp_path, capsys, monkeypatch):
    """Where no batch fits, the flags that shrink the model are named: here the default model (215,104 parameters,
    3.4 MB of weights, gradients and Adam's moments) against 3 MB, which keeps the test cheap either way."""
    from tinydiff.extras import sudoku_train
    from tinydiff.io import cli
    monkeypatch.setattr(cli, "device_memory", lambda device: 3 * 10**6)
    argv = ["--out", tmp_path / "out", "--minutes", "0.01", "--puzzles", "2"]
    line = refused(sudoku_train.main, argv, capsys, tmp_path)
    assert line.endswith("pass a smaller --d-model or --n-layer") and not (tmp_path / "out").exists()
