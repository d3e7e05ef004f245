"""Spec: generate.py under careless and hostile input. Every number it takes is checked where it
enters (finite, in range, an integer where it must be; 0 is a stated meaning or an error, never
"the default"), every checkpoint before a model is built from it, and each refusal is one line
`error: ...`, a non-zero status, no traceback, nothing written. A closed stdout ends quietly."""
import json
import resource
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hostile import CAP, NON_FINITE, ROOT, exit_status, refused, run_capped, tampered_checkpoints

import generate
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig, Transformer

# flag -> bad values beside the non-finite ones (each was once accepted, or is its neighbour)
NUMBERS = {
    "--temperature": ["-1", "1e-30", "1e9", "hot"],
    "--top-k": ["-1", "1.5", "1e99"],
    "--top-p": ["0", "-0.5", "1.5"],
    "--max-new-tokens": ["0", "-3", "2.5", "10000000000", "many"],
    "--k": ["0", "-1"],
    "--budget": ["0", "-2"],
    "--steps": ["0", "-1", "1e9"],
    "--block-length": ["0", "-4"],
    "--threshold": ["0", "1.5", "-0.1"],
    "--entropy-bound": ["-1"],
    "--seed": ["-1", str(2**64), "1.5"],
}
CASES = [(flag, value) for flag, values in NUMBERS.items() for value in [*values, *NON_FINITE]]


@pytest.fixture
def ar_ckpt(tmp_path, tiny_model, tiny_config):
    save_checkpoint(tmp_path / "ar.pt", kind="ar", config=tiny_config, model=tiny_model)
    return tmp_path / "ar.pt"


def test_an_in_process_case_that_allocates_without_bound_fails_its_test():
    """Every in-process case (hostile.refused, hostile.exit_status) runs under an address-space cap: past what
    the process maps plus 4 GiB an allocation is a MemoryError that fails the test, where without the cap it
    would be granted (calloc maps zero pages lazily) and a real one would fill the machine. The cap is lifted
    after."""
    before = resource.getrlimit(resource.RLIMIT_AS)

    def greedy(argv):
        bytearray(CAP + 2**30)
    with pytest.raises(MemoryError):
        exit_status(greedy, [])
    assert resource.getrlimit(resource.RLIMIT_AS) == before


@pytest.mark.parametrize("flag, value", CASES)
def test_every_bad_number_is_refused_at_the_command_line(ar_ckpt, tmp_path, capsys, flag, value):
    line = refused(generate.main, ["--ckpt", ar_ckpt, "--prompt", "hi", flag, value], capsys, tmp_path)
    assert f"argument {flag}:" in line


@pytest.mark.parametrize("args, message", [
    (["--steps", "9"], "--steps does not apply to --method ar"),  # once ignored without a word
    (["--method", "spec", "--draft", "x.pt", "--budget", "4", "--steps", "8"],
     "--budget, --steps do not apply to --method spec"),
    (["--speculative-config", "{"], "not valid JSON"),
    (["--speculative-config", "[]"], "needs {"),
    (["--speculative-config", '{"method": "draft_model", "model": 5}'], "needs {"),
    (["--speculative-config", '{"method": "draft_model", "model": "x.pt", "num_speculative_tokens": 0}'],
     "num_speculative_tokens must be an integer >= 1"),  # 0 once meant "the default k"
    (["--speculative-config", '{"method": "dflash", "model": "x.pt", "num_speculative_tokens": "4"}'],
     "num_speculative_tokens must be an integer"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--prompt", "   "], "the prompt is empty"),
])
def test_bad_settings_are_one_line(ar_ckpt, tmp_path, capsys, args, message):
    argv = ["--ckpt", ar_ckpt, "--prompt", "hi", *args]
    assert message in refused(generate.main, argv, capsys, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU, so --device cuda is right here")
def test_diffusion_steps_past_the_canvas_are_refused(tmp_path, capsys, tiny_config):
    mdlm = Transformer(replace(tiny_config, causal=False))
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=mdlm.config, model=mdlm)
    argv = ["--ckpt", tmp_path / "mdlm.pt", "--prompt", "hi", "--max-new-tokens", "8", "--block-length", "8"]
    assert "at most the gen length 8" in refused(generate.main, [*argv, "--steps", "9"], capsys, tmp_path)  # once 10^9
    assert "--top-k does not apply to --method diffusion" in refused(generate.main, [*argv, "--top-k", "5"],
                                                                      capsys, tmp_path)


def test_cuda_without_a_gpu_is_one_line(ar_ckpt, tmp_path, capsys):
    assert "no CUDA GPU" in refused(generate.main, ["--ckpt", ar_ckpt, "--prompt", "hi", "--device", "cuda"],
                                    capsys, tmp_path)


@pytest.fixture
def tampered(tmp_path, tiny_model, tiny_config):
    return tampered_checkpoints(tmp_path / "bad", tiny_model, tiny_config)


EXPECTED = {  # what each damaged checkpoint is told
    "huge n_layer": "n_layer must be an integer >= 1 and <= 1,024", "n_head 0": "n_head must be an integer >= 1",
    "string size": "d_model must be an integer", "float size": "d_ff must be an integer",
    "norm_eps -1": "norm_eps must be a finite number > 0", "other vocabulary": "vocabulary of 1,000 ids",
    "wrong shape": "embed.weight is (7, 7), its config needs (50304, 32)", "missing weights": "has no weights",
    "missing config": "has no model config", "unknown kind": "kind 'gpt5'", "no kind": "kind None",
    "negative step": "the step count must be an integer >= 0", "NaN weights": "weight norm.weight holds NaN",
    "config a list": "has no model config", "weights not tensors": "has no weights",
    "code inside": "holds Python objects that are not tensors (posix.system)", "truncated": "not a readable checkpoint",
    "plain pickle": "not a readable checkpoint",
    "empty": "not a readable checkpoint", "a folder": "is a folder",
}


@pytest.mark.parametrize("damage", EXPECTED)
def test_a_damaged_checkpoint_is_named_before_anything_is_built(tampered, tmp_path, capsys, monkeypatch, damage):
    monkeypatch.chdir(tmp_path)
    built, init = [], Transformer.__init__

    def counting_init(self, *args, **kwargs):  # counts the models that allocate weights (not "meta" shells)
        built.extend([1] if torch.empty(0).device.type != "meta" else [])
        init(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "__init__", counting_init)
    line = refused(generate.main, ["--ckpt", tampered[damage], "--prompt", "hi"], capsys, tmp_path)
    assert EXPECTED[damage] in line and not built  # refused before a weight was allocated
    assert not (tmp_path / "pwned.txt").exists()  # the pickled code never ran


@pytest.mark.parametrize("drafter_flag", [["--method", "spec", "--draft"], ["--method", "dflash", "--draft"]])
def test_a_damaged_draft_is_refused_too(ar_ckpt, tampered, tmp_path, capsys, drafter_flag):
    for damage in ("NaN weights", "code inside", "truncated"):
        line = refused(generate.main, ["--ckpt", ar_ckpt, "--prompt", "hi", *drafter_flag, tampered[damage]],
                       capsys, tmp_path)
        assert EXPECTED[damage] in line


def test_a_closed_stdout_ends_quietly(ar_ckpt):
    # `generate.py --json | head -c 10` once ended in a BrokenPipeError traceback. `true` closes the pipe
    # before generate.py has loaded torch, so its one write always meets a closed pipe.
    cmd = f"{sys.executable} generate.py --ckpt {ar_ckpt} --prompt hi --max-new-tokens 20 --json | true"
    res = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.stderr == ""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 4-layer AR target, itself as its draft, a DFlash drafter and an EAGLE-3 head for it, and a diffusion LM."""
    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    from tinydiff.eagle3 import EagleConfig, EagleHead
    folder = tmp_path_factory.mktemp("counts")
    ar = ModelConfig(context=64, n_layer=4, n_head=2, d_model=16, d_ff=32, causal=True)
    target = Transformer(ar)
    save_checkpoint(folder / "ar.pt", kind="ar", config=ar, model=target)
    drafter = DFlashConfig.for_target(ar, block_size=4)
    save_checkpoint(folder / "dflash.pt", kind="dflash", config=drafter, model=DFlashDrafter(drafter, target))
    head = EagleConfig.for_target(ar)
    save_checkpoint(folder / "eagle.pt", kind="eagle3", config=head, model=EagleHead(head, target))
    mdlm = replace(ar, n_layer=1, causal=False)
    save_checkpoint(folder / "mdlm.pt", kind="mdlm", config=mdlm, model=Transformer(mdlm))
    return folder


# method, its models' flags, the count flag; each at 10^6 and 10^9 (the huge counts a careless or hostile
# user types), under a 4 GiB address-space cap: a bounded run that clamps with one notice, or one line
COUNTS = [("spec", ["--draft", "ar.pt"], "--k"), ("ssd", ["--draft", "ar.pt"], "--k"),
          ("eagle3", ["--draft", "eagle.pt"], "--k"), ("eagle3", ["--draft", "eagle.pt"], "--budget"),
          ("ddtree", ["--draft", "dflash.pt"], "--budget"), ("ar", [], "--top-k"),
          ("ar", [], "--max-new-tokens"), ("diffusion", [], "--steps")]


@pytest.mark.parametrize("value", [10**6, 10**9])
@pytest.mark.parametrize("method, models, flag", COUNTS, ids=[f"{m} {f}" for m, _, f in COUNTS])
def test_a_huge_count_is_clamped_or_refused_in_bounded_memory(checkpoints, method, models, flag, value):
    """A draft count past the story's tokens drafts no more than them: clamped, with one notice (10^9 drafts
    once sized a histogram of 10^9 slots: MemoryError); a tree budget or top-k past the vocabulary the same
    tokens; a token or step count past the room, one line."""
    ckpt = checkpoints / ("mdlm.pt" if method == "diffusion" else "ar.pt")
    argv = ["generate.py", "--ckpt", ckpt, "--method", method, *[checkpoints / m if m.endswith(".pt") else m
            for m in models], "--prompt", "Once upon a time", "--temperature", "1", "--json"]
    argv += [flag, value] if flag == "--max-new-tokens" else ["--max-new-tokens", 8, flag, value]
    res = run_capped(argv)
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    if flag in ("--max-new-tokens", "--steps"):
        assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:"), res.stderr
        return
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(json.loads(res.stdout)["ids"]) == 8
    notices = [line for line in lines if line.startswith("notice:")]
    assert notices == ([f"notice: --k {value} is more than the 7 drafts a round of a 8-token story can use; "
                        "drafting at most 7 a round"] if flag == "--k" else [])
