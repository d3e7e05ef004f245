"""Spec: `python -m tinydiff.tools.export` writes models transformers loads and computes the same way, and
every exported folder loads back into tinydiff with the same tensors.

The transformers tests need requirements-hf.txt (CI installs it); without transformers they skip,
and the round trips, which need only safetensors, still run.
"""
import json
from dataclasses import asdict

import pytest
import torch
from entry_points import last_line, run_in_process
from stats_helpers import perturbed, random_model

from tinydiff.ar import ar_generate
from tinydiff.io import hf_format
from tinydiff.io.checkpoint import load_checkpoint, load_model, save_checkpoint
from tinydiff.model import ModelConfig, Transformer
from tinydiff.speculative import speculative_generate
from tinydiff.tokenizer import EOT, MASK, Tokenizer
from tinydiff.tools import export

TARGET = ModelConfig(context=96, n_layer=2, n_head=2, d_model=32, d_ff=64)
DRAFT = ModelConfig(context=96, n_layer=1, n_head=2, d_model=16, d_ff=32)


def run(*args):
    """The export's entry point as its __main__ runs it: (status, last line of stderr)."""
    res = run_in_process(export.main, *args)
    return res.returncode, last_line(res.stderr)


def exported(tmp_path, name, config=TARGET, seed=0, kind="ar", model=None, **extra):
    """Save a model as train.py would, export it, return (model, folder)."""
    torch.manual_seed(seed)
    model = model if model is not None else Transformer(config).eval()
    save_checkpoint(tmp_path / f"{name}.pt", kind=kind, config=model.config, model=model, **extra)
    code, message = run("--ckpt", tmp_path / f"{name}.pt", "--out", tmp_path / name)
    assert code == 0, message
    return model, tmp_path / name


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_export_loads_back_with_the_same_tensors_for_every_kind(tmp_path, tiny_model):
    from safetensors import safe_open

    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    from tinydiff.dmoe import MoETransformer, moe_config
    from tinydiff.eagle3 import EagleConfig, EagleHead
    from tinydiff.extras.ar_moe import ar_moe_config
    from tinydiff.io.checkpoint import drafter_from, head_from
    target = Transformer(TARGET).eval()
    moe = MoETransformer(moe_config("draft", context=32, n_experts=4, moe_top_k=2, route_block=4))
    ar_moe = MoETransformer(ar_moe_config("draft", context=32, n_experts=4, moe_top_k=2))
    diffusion = Transformer(ModelConfig(**{**asdict(TARGET), "causal": False, "shift": True}))
    models = {"ar": target, "mdlm": diffusion, "mdlm-moe": moe, "ar-moe": ar_moe,
              "dflash": DFlashDrafter(DFlashConfig.for_target(TARGET, block_size=4), target),
              "eagle3": EagleHead(EagleConfig.for_target(TARGET), target)}
    for kind, model in models.items():
        _, folder = exported(tmp_path, kind, kind=kind, model=model, step=7, args={"model": kind})
        ckpt, saved = load_checkpoint(folder), load_checkpoint(tmp_path / f"{kind}.pt")
        assert ckpt["kind"] == kind and json.loads(json.dumps(saved["config"])) == ckpt["config"]
        assert ckpt["model"].keys() == saved["model"].keys()
        assert all(torch.equal(ckpt["model"][n], saved["model"][n]) for n in saved["model"])
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == ("llama" if kind == "ar" else f"tinydiff-{kind}")
        with safe_open(folder / "model.safetensors", "pt") as f:  # the true vocabulary: the padding stays behind
            rows = [f.get_slice(n).get_shape()[0] for n in f.keys() if n.endswith(("embed.weight", "tokens.weight"))]
        assert rows == ([] if kind in ("dflash", "eagle3") else [model.config.vocab_size])
    assert isinstance(drafter_from(load_checkpoint(tmp_path / "dflash"), target), DFlashDrafter)
    assert isinstance(head_from(load_checkpoint(tmp_path / "eagle3"), target), EagleHead)
    for kind in ("mdlm-moe", "ar-moe"):
        rebuilt, _ = load_model(tmp_path / kind)  # the kind's own class, from the folder
        assert isinstance(rebuilt, MoETransformer) and rebuilt.config.causal == (kind == "ar-moe")


def test_bad_folders_and_exports_are_one_line(tmp_path):
    _, folder = exported(tmp_path, "ar")
    diffusion = Transformer(ModelConfig(**{**asdict(TARGET), "causal": False}))
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=diffusion.config, model=diffusion)
    code, message = run("--ckpt", tmp_path / "mdlm.pt", "--out", tmp_path / "m", "--layout", "llama")
    assert code == 1 and "not a Llama" in message and not (tmp_path / "m").exists()
    code, message = run("--ckpt", tmp_path / "mdlm.pt", "--out", folder)
    assert code == 1 and "not an empty folder" in message
    cases = {"no weights": lambda d: (d / "model.safetensors").unlink(),
             "broken JSON": lambda d: (d / "config.json").write_text("{"),
             "a foreign model": lambda d: (d / "config.json").write_text('{"model_type": "gpt2"}'),
             "grouped-query attention": lambda d: edit(d, num_key_value_heads=1),
             "another vocabulary": lambda d: edit(d, vocab_size=32000),
             "more layers than weights": lambda d: edit(d, num_hidden_layers=3),
             "garbage weights": lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64),
             "an unknown kind": lambda d: ours(d, kind="gpt"), "no layers": lambda d: ours(d, n_layer=0),
             # the Llama fields (what transformers reads) against our section: they loaded as if unsaid
             "a million layers": lambda d: llama(d, num_hidden_layers=10 ** 6),
             "another layer count": lambda d: llama(d, num_hidden_layers=3),
             "a vocabulary of 1,000": lambda d: llama(d, vocab_size=1000),
             "7 heads": lambda d: llama(d, num_attention_heads=7, num_key_value_heads=7), "no epsilon": lambda d: llama(d, rms_norm_eps=None),
             "rms_norm_eps NaN": lambda d: llama(d, rms_norm_eps=float("nan"))}
    messages = {"no weights": "has no model.safetensors", "broken JSON": "not valid JSON",
                "a foreign model": "neither a Llama nor a tinydiff export", "grouped-query attention": "grouped-query",
                "another vocabulary": "vocabulary of 32,000", "more layers than weights": "missing model.layers.2",
                "garbage weights": "not a readable safetensors file", "an unknown kind": "names no model kind",
                "no layers": "not a model config this code reads", "a million layers": "n_layer must be",
                "another layer count": "disagree on n_layer",
                "a vocabulary of 1,000": "disagree on vocab_size", "7 heads": "head_dim * heads != hidden_size",
                "no epsilon": "norm_eps", "rms_norm_eps NaN": "norm_eps"}
    for case, damage in cases.items():
        broken = tmp_path / case.replace(" ", "-")
        broken.mkdir()
        for f in folder.iterdir():
            (broken / f.name).write_bytes(f.read_bytes())
        damage(broken)
        with pytest.raises(Exception) as caught:
            load_model(broken)
        assert type(caught.value).__name__ == "UserError" and messages[case] in str(caught.value), case


def test_an_export_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """The folder appears at once, renamed from a new one beside it: an export stopped at its last file
    (Ctrl-C) leaves no --out and nothing else; one that finds --out filled meanwhile (another export) is
    refused in one line and leaves those files as they were."""
    torch.manual_seed(0)
    model = Transformer(TARGET).eval()
    save_checkpoint(tmp_path / "ar.pt", kind="ar", config=model.config, model=model)
    real = hf_format.write_atomic

    def interrupted(path, write):
        if path.name == "README.md":
            raise KeyboardInterrupt
        real(path, write)
    monkeypatch.setattr(hf_format, "write_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export.main(["--ckpt", str(tmp_path / "ar.pt"), "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar.pt"]

    def raced(path, write):  # another export fills --out while this one writes
        if path.name == "README.md" and not (tmp_path / "out").exists():
            (tmp_path / "out").mkdir()
            (tmp_path / "out" / "config.json").write_text("theirs")
        real(path, write)
    monkeypatch.setattr(hf_format, "write_atomic", raced)
    code, message = run("--ckpt", tmp_path / "ar.pt", "--out", tmp_path / "out")
    assert code == 1 and "was filled while this export ran" in message
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["config.json"]
    assert (tmp_path / "out" / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar.pt", "out"]


def edit(folder, **fields):
    """A Llama config.json from elsewhere (no tinydiff section), with `fields` changed."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("tinydiff")
    (folder / "config.json").write_text(json.dumps(config | fields))


def llama(folder, **fields):
    """config.json's Llama fields changed, its tinydiff section kept."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))


def ours(folder, kind=None, **fields):
    """config.json's tinydiff section with its kind or config `fields` changed."""
    config = json.loads((folder / "config.json").read_text())
    section = config["tinydiff"]
    section["kind"] = kind or section["kind"]
    section["config"] |= fields
    (folder / "config.json").write_text(json.dumps(config))


def test_logits_equal_ours_for_the_target_and_the_draft(tmp_path, transformers):
    x = torch.randint(0, MASK, (3, 40), generator=torch.Generator().manual_seed(1))
    for name, config in (("target", TARGET), ("draft", DRAFT)):
        ours, folder = exported(tmp_path, name, config)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(hf).__name__ == "LlamaForCausalLM"
        with torch.no_grad():  # in float32: transformers' RMSNorm and rotary run in float32 even in a float64 model
            logits, theirs = ours(x), hf(x).logits
        assert (logits - theirs).abs().max() < 1e-5 < logits.std() / 100, name  # a wrong row order moves them by ~std


def test_a_llama_saved_by_transformers_loads_as_our_model(tmp_path, transformers):
    """Part 2 from the other side: a folder transformers wrote, with no tinydiff section."""
    hf_config = transformers.LlamaConfig(vocab_size=50258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                                         tie_word_embeddings=True)
    torch.manual_seed(2)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours, ckpt = load_model(tmp_path / "hf")
    assert ckpt["kind"] == "ar" and ours.config.n_layer == 2 and ours.config.norm_eps == 1e-5
    x = torch.randint(0, MASK, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() < 1e-5


def test_cached_greedy_and_assisted_generation_give_our_tokens(tmp_path, transformers):
    target, target_dir = exported(tmp_path, "target", model=random_model(TARGET, 0))  # a story, not one token
    draft, draft_dir = exported(tmp_path, "draft", model=perturbed(target, 1, 0.1))  # right some of the time
    hf_target, hf_draft = (transformers.AutoModelForCausalLM.from_pretrained(d).eval() for d in (target_dir, draft_dir))
    prompt = [EOT] + Tokenizer().encode("Once upon a time")
    # all 64 tokens (no eos); the mask given, else transformers takes the opening EOT for padding
    greedy = {"do_sample": False, "max_new_tokens": 64, "eos_token_id": None, "pad_token_id": EOT,
              "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
    with torch.no_grad():
        ours, _ = ar_generate(target, prompt, 64, temperature=0, stop_token=None)
        theirs = hf_target.generate(torch.tensor([prompt]), **greedy)[0, len(prompt):].tolist()
        assert theirs == ours  # 64 steps through transformers' own KV cache
        for k in (4, 8):
            spec, stats = speculative_generate(target, draft, prompt, 64, k, temperature=0, stop_token=None)
            hf_draft.generation_config.num_assistant_tokens = k
            hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
            hf_draft.generation_config.assistant_confidence_threshold = 0.0
            assisted = hf_target.generate(torch.tensor([prompt]), assistant_model=hf_draft, **greedy)
            assert assisted[0, len(prompt):].tolist() == spec == ours and 0 < sum(stats.accepted[1:]) < 64


def test_the_tokenizer_files_encode_like_tiktoken(tmp_path, transformers, story_file):
    _, folder = exported(tmp_path, "target")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer()
    stories = [s for s in story_file.read_text().split("<|endoftext|>")] + ["Hi  there\n\n\tçé 日本 🙂 don't 123"]
    for story in stories:
        assert hf(story, add_special_tokens=False)["input_ids"] == ours.encode(story)
        assert hf.decode(ours.encode(story)) == story
    assert hf.eos_token_id == EOT and hf.convert_tokens_to_ids("<|mask|>") == MASK


def test_the_side_by_side_bench_writes_the_same_tokens(tmp_path, transformers):
    from tinydiff.bench import hf
    _, target = exported(tmp_path, "target", model=random_model(TARGET, 0))
    _, draft = exported(tmp_path, "draft", model=perturbed(random_model(TARGET, 0), 1, 0.1))
    res = run_in_process(hf.main, "--target", target, "--draft", tmp_path / "draft.pt", "--max-new-tokens", 16)
    assert res.returncode == 0, res.stderr
    rows = [line.split() for line in res.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["greedy", "sample", "spec-k4", "spec-k8"]
    assert all(r[-1] == "True" for r in rows if r[0] != "sample") and all(float(r[1]) > 0 for r in rows)
