"""Spec: the AR mixture-of-experts LM (`--model ar-moe`, tinydiff/extras/ar_moe.py), a target for
speculative decoding with float or FP4 experts (MiMo's combination).

The model is causal (a later token never moves an earlier position's logits) and its KV-cached
decoding computes what full forwards compute; its loss is the next-token loss plus the balance
term; train.py trains it and a killed run resumes to the same weights; a DFlash drafter and an
EAGLE-3 head built around the float target decode, around it and around its FP4 version alike,
exactly the target's greedy text (DDTree, spec and SSD too), and DFlash at T > 0 the FP4 target's
exact joint (chi-square); the quantize CLI round-trips its checkpoint (the pinned evaluation
scores it as an AR model, the quality tool samples it); generate.py and the bench take it with
drafters trained on the float model; what does not apply is refused in one line.
"""
import json
from dataclasses import asdict

import pytest
import torch
from eagle_models import random_head
from entry_points import last_line, run_in_process
from stats_helpers import (
    DFLASH_DIST_CONFIG,
    NEW,
    PROMPT,
    assert_follows_the_joint,
    assert_same,
    exact_joint,
    float64,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    perturbed,
    random_drafter,
    random_model,
    recorded_run,
    sample_counts,
)
from table_models import Oracle, TableTarget
from test_train import argv, assert_same_weights, final_weights, interrupt_at

import generate
import train
from tinydiff.ar import ar_generate, ar_loss
from tinydiff.bench import quality
from tinydiff.bench import table as bench
from tinydiff.bench.methods import compiled_models
from tinydiff.checks import UserError
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash import dflash_generate
from tinydiff.dmoe import MoEConfig, MoETransformer, balance_loss, moe_layers, set_routing
from tinydiff.eagle3 import eagle_generate
from tinydiff.extras.ar_moe import ar_moe_config, ar_moe_loss
from tinydiff.fp4 import QuantizedMoETransformer, dequantized_copy, quantize_experts
from tinydiff.io.checkpoint import AR_KINDS, drafter_from, head_from, load_checkpoint, load_model, save_checkpoint
from tinydiff.model import ModelConfig
from tinydiff.sampling import next_token_probs
from tinydiff.speculative import speculative_generate
from tinydiff.ssd import ssd_generate
from tinydiff.tokenizer import EOT
from tinydiff.tools import eval as pinned
from tinydiff.tools import export, quantize

# Five layers (DFlash reads two of them, [1, 2]); experts 32 wide, so MXFP4's 32-value blocks fit.
SHAPE = dict(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64, n_experts=4, moe_top_k=2, expert_d_ff=32)


def random_ar_moe(seed, **overrides) -> MoETransformer:
    """A random causal MoE whose routers and experts matter (stats_helpers.random_model's draw)."""
    return random_model(MoEConfig(**{**SHAPE, **overrides, "causal": True}), seed, build=MoETransformer)


@pytest.fixture(scope="module")
def models():
    """{"float": (target, DFlash drafter, EAGLE-3 head, AR draft), "fp4": (its MXFP4 version, the same
    drafter and head rebuilt around it, a draft)}: drafter and head are built for the float target,
    as train.py builds them, and moved as generate.py moves them; each draft is its target (the FP4
    one dequantized) plus a little noise, an ar-moe too."""
    target = random_ar_moe(seed=0)
    drafter = random_drafter(target, seed=1, n_layer=2, block_size=8, n_features=2)
    head = random_head(target, seed=4)
    packed = quantize_experts(target).eval()
    moved = drafter_from({"config": asdict(drafter.config), "model": drafter.state_dict()}, packed)
    moved_head = head_from({"config": asdict(head.config), "model": head.state_dict()}, packed)
    draft, packed_draft = (perturbed(model, seed=2, noise=0.001) for model in (target, dequantized_copy(packed)))
    return {"float": (target, drafter, head, draft), "fp4": (packed, moved, moved_head, packed_draft)}


@pytest.fixture(scope="module")
def models64(models):  # tests that compare two code paths hold them to float64 rounding
    return {name: float64(*built[:3]) + float64(built[3]) for name, built in models.items()}


def greedy_by_full_forwards(model, prompt, n):
    """n greedy tokens, each from one uncached forward over everything before it."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]), causal=True)[0, -1]
        seq.append(int(next_token_probs(logits, 0, None, None).argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("which", ["float", "fp4"])
@torch.no_grad()
def test_a_later_token_never_changes_an_earlier_positions_logits(models64, which):
    target = models64[which][0]
    assert target.config.causal and isinstance(target, MoETransformer)
    x = torch.randint(0, 50257, (1, 20), generator=torch.Generator().manual_seed(0))
    before = target(x)  # the config's default attention: causal
    assert_same(target(x, causal=True), before)
    for j in (1, 8, 19):
        changed = x.clone()
        changed[0, j] = (changed[0, j] + 1) % 50257
        after = target(changed)
        assert_same(after[:, :j], before[:, :j])  # positions before j: untouched, to float64 rounding
        assert (after[:, j] - before[:, j]).abs().max() > 1e-3 * before[:, j].abs().max()  # j itself sees it


@pytest.mark.parametrize("which", ["float", "fp4"])
@torch.no_grad()
def test_kv_cached_decoding_equals_full_forwards(models64, which):
    """The cached forwards (a prefill, then one token at a time) give every position the logits one
    full forward gives it, so cached greedy decoding is uncached greedy decoding."""
    target = models64[which][0]
    prompt = [EOT, 11, 12, 13]
    out, stats = ar_generate(target, prompt, 16, temperature=0, stop_token=None)
    assert out == greedy_by_full_forwards(target, prompt, 16) and stats.forwards == 16
    seq = torch.tensor([prompt + out])
    full = target(seq, causal=True)
    cache = target.new_cache(1)
    steps = [target(seq[:, :len(prompt)], cache=cache, causal=True)]
    steps += [target(seq[:, t:t + 1], cache=cache, causal=True) for t in range(len(prompt), seq.shape[1])]
    assert_same(torch.cat(steps, 1), full)


def test_the_loss_is_the_next_token_loss_plus_the_balance_term():
    torch.manual_seed(0)
    model = MoETransformer(ar_moe_config("draft", context=16, n_experts=4, moe_top_k=2)).double()
    assert model.config.causal and model.config.routing == "token" and model.config.n_experts == 4
    windows = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(1))
    loss, stats = ar_moe_loss(model, windows)
    ce, _ = ar_loss(model, windows)  # the same forward again: the same numbers
    balance = balance_loss(model)
    assert loss.item() == (ce + model.config.balance_coef * balance).item() and float(stats["ce"]) == ce.item()
    assert stats["balance"].item() == balance.item() / len(moe_layers(model))
    loss.backward()
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in moe_layers(model))


def test_train_trains_an_ar_moe_and_a_killed_run_resumes_to_the_same_weights(story_file, tmp_path, monkeypatch):
    flags = ["--experts", "4", "--top-k", "2", "--max-steps", "4"]
    train.main(argv(story_file, tmp_path / "full", *flags, kind="ar-moe"))
    full = load_checkpoint(tmp_path / "full" / "ckpt.pt")
    assert full["kind"] == "ar-moe" and full["step"] == 4 and full["config"]["causal"]
    config = full["config"]
    assert config["n_experts"] == 4 and config["moe_top_k"] == 2 and config["routing"] == "token"
    assert isinstance(load_model(tmp_path / "full" / "ckpt.pt", kinds=AR_KINDS)[0], MoETransformer)

    def kill():  # dies mid-step 3 with no chance to save: the step-2 checkpoint is what is left
        raise SystemExit("killed")
    interrupt_at(monkeypatch, "ar-moe", 3, kill)
    with pytest.raises(SystemExit):
        train.main(argv(story_file, tmp_path / "cut", *flags, kind="ar-moe"))
    assert load_checkpoint(tmp_path / "cut" / "ckpt.pt")["step"] == 2
    monkeypatch.undo()
    train.main(["--out", str(tmp_path / "cut"), "--resume"])
    assert_same_weights(final_weights(tmp_path / "cut"), full["model"])
    # QAT applies to its experts as to mdlm-moe's: a new run from its weights records the format
    train.main(["--model", "ar-moe", "--init", str(tmp_path / "full" / "ckpt.pt"), "--qat", "mxfp4",
                "--data", str(story_file), "--out", str(tmp_path / "qat"), "--batch-size", "2", "--max-steps", "1",
                "--eval-every", "1", "--eval-batches", "1", "--device", "cpu"])
    qat = load_checkpoint(tmp_path / "qat" / "ckpt.pt")
    assert qat["kind"] == "ar-moe" and qat["args"]["qat"] == "mxfp4" and qat["config"]["expert_format"] == "float"


@pytest.mark.parametrize("which", ["float", "fp4"])
@torch.no_grad()
def test_every_speculative_method_decodes_the_targets_greedy_text(models64, which):
    """Around the float target and around its FP4 version (drafter and head built for the float
    one), DFlash, DDTree, EAGLE-3 (chain and tree), spec and SSD commit exactly the target's own
    greedy tokens, which differ between the two targets."""
    target, drafter, head, draft = models64[which]
    other = models64["fp4" if which == "float" else "float"][0]
    seen, differs = {"partial": 0, "full": 0, "spec partial": 0, "spec full": 0}, 0
    for seed in range(3):
        prompt = [EOT] + torch.randint(0, 50257, (2 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected, _ = ar_generate(target, prompt, 20, temperature=0, stop_token=None)
        differs += expected != ar_generate(other, prompt, 20, temperature=0, stop_token=None)[0]
        oracle = Oracle(random_drafter(target, seed=2, n_layer=2, block_size=8, n_features=2), target,
                        wrong=lambda position: position % 5 == seed)
        for block_drafter, orc in ((drafter, None), (oracle.drafter, oracle)):
            out, stats, rounds = recorded_run(dflash_generate, target, block_drafter, prompt, 20, orc, block_size=8,
                                              temperature=0, stop_token=None)
            assert out == expected, (seed, orc is None)
            seen["partial"] += sum(0 < r["accepted"] < len(r["drafts"]) for r in rounds)
            seen["full"] += sum(0 < r["accepted"] == len(r["drafts"]) for r in rounds)
        greedy = dict(temperature=0, stop_token=None)
        assert ddtree_generate(target, drafter, prompt, 20, budget=8, **greedy)[0] == expected, seed
        assert eagle_generate(target, head, prompt, 20, k=4, **greedy)[0] == expected, seed
        assert eagle_generate(target, head, prompt, 20, k=4, budget=8, **greedy)[0] == expected, seed
        out, stats = speculative_generate(target, draft, prompt, 20, 4, **greedy)
        assert out == expected, seed
        seen["spec partial"] += sum(stats.accepted[1:-1])
        seen["spec full"] += stats.accepted[-1]
        assert ssd_generate(target, draft, prompt, 20, 4, 2, **greedy)[0] == expected, seed
    assert min(seen.values()) > 0 and differs > 0, (seen, differs)  # each kind of round; FP4 is another model


@torch.no_grad()
def test_dflash_samples_the_fp4_targets_exact_joint():
    """test_dflash_decode's distribution test (V = 6, 3 new tokens, chi-square at significance 1e-3 with its
    power asserted) on the FP4 version of a random ar-moe, drafted for by a drafter built around the
    float model: the committed tokens follow the FP4 target's joint, not the float one's."""
    shape = {**asdict(DFLASH_DIST_CONFIG), "d_model": 32, "d_ff": 64}
    target = random_model(MoEConfig(**{**shape, "n_experts": 4, "moe_top_k": 2, "expert_d_ff": 32}), seed=1,
                          embed_std=0.1, std=0.4, build=MoETransformer)  # a joint flat enough for the power
    drafter = random_drafter(target, seed=5, block_size=4)
    packed = quantize_experts(target).eval()
    drafter = drafter_from({"config": asdict(drafter.config), "model": drafter.state_dict()}, packed)
    probs = exact_joint(packed, 1.0, None, None)  # (V^NEW,)
    assert (probs - exact_joint(target, 1.0, None, None)).abs().max() > 1e-3  # FP4 moved the joint
    table = TableTarget(packed, drafter.config.taps)
    n = 5_500
    counts, hist = sample_counts(lambda generator: dflash_generate(
        table, drafter, PROMPT, NEW, None, 1.0, generator=generator, stop_token=None), n, None, seed=1234)
    assert hist[0] > 0 and hist[NEW - 1] > 0, hist  # rejections, and full acceptances of 2 drafts
    assert_follows_the_joint(probs, counts, n)


@pytest.fixture
def ar_moe_ckpt(tmp_path):
    """A random ar-moe checkpoint of context 32 (small enough for train.py's drafters in seconds)."""
    model = random_ar_moe(seed=3, context=32, n_layer=4)
    save_checkpoint(tmp_path / "moe.pt", kind="ar-moe", config=model.config, model=model, step=5)
    return tmp_path / "moe.pt"


def test_quantize_round_trips_an_ar_moe_checkpoint(ar_moe_ckpt, tmp_path, story_file):
    res = run_in_process(quantize.main, "--ckpt", ar_moe_ckpt, "--out", tmp_path / "fp4.pt")
    assert res.returncode == 0, res.stderr
    ckpt = load_checkpoint(tmp_path / "fp4.pt")
    assert ckpt["kind"] == "ar-moe" and ckpt["config"]["expert_format"] == "mxfp4" and ckpt["step"] == 5
    packed, _ = load_model(tmp_path / "fp4.pt", kinds=AR_KINDS)
    assert isinstance(packed, QuantizedMoETransformer) and packed.config.causal
    want = quantize_experts(load_model(ar_moe_ckpt)[0]).eval()
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(packed(ids), want(ids))
    res = run_in_process(pinned.main, "--ckpt", tmp_path / "fp4.pt", "--data", story_file)  # scored as an AR model
    assert res.returncode == 0 and "NLL: " in res.stdout and "ELBO" not in res.stdout, res.stderr
    judge = random_model(ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32), seed=5)
    save_checkpoint(tmp_path / "judge.pt", kind="ar", config=judge.config, model=judge)
    rows = quality.main(["--judge", str(tmp_path / "judge.pt"), "--ar", str(tmp_path / "fp4.pt"), "--samplers", "ar",
                         "--samples", "2", "--gen-length", "8"])  # the quality tool's AR baseline
    assert [r["sampler"] for r in rows] == ["ar"] and rows[0]["gen_ppl"] > 0
    for name in ("moe.pt", "fp4.pt"):  # exported in tinydiff's layout, both load back to the same tensors
        res = run_in_process(export.main, "--ckpt", tmp_path / name, "--out", tmp_path / f"{name}-hf")
        assert res.returncode == 0, res.stderr
        saved, folder = load_checkpoint(tmp_path / name), load_checkpoint(tmp_path / f"{name}-hf")
        assert folder["kind"] == "ar-moe" and folder["model"].keys() == saved["model"].keys()
        assert all(torch.equal(folder["model"][k], saved["model"][k]) for k in saved["model"])
        assert json.loads((tmp_path / f"{name}-hf" / "config.json").read_text())["model_type"] == "tinydiff-ar-moe"


def test_drafters_trained_on_the_float_target_decode_its_fp4_version(ar_moe_ckpt, story_file, tmp_path):
    """train.py trains a DFlash drafter and an EAGLE-3 head against the float ar-moe; generate.py
    takes them beside the FP4 checkpoint, and every method decodes the FP4 target's greedy text."""
    assert run_in_process(quantize.main, "--ckpt", ar_moe_ckpt, "--out", tmp_path / "fp4.pt").returncode == 0
    common = ["--target", str(ar_moe_ckpt), "--data", str(story_file), "--batch-size", "2", "--max-steps", "2",
              "--eval-every", "2", "--eval-batches", "1", "--device", "cpu"]
    train.main(["--model", "dflash", "--block-size", "8", *common, "--out", str(tmp_path / "dflash")])
    train.main(["--model", "eagle3", "--steps-ahead", "2", *common, "--out", str(tmp_path / "eagle")])
    assert load_checkpoint(tmp_path / "dflash" / "ckpt.pt")["args"]["target"] == str(ar_moe_ckpt)  # the float one

    def ids(method, *flags):
        res = run_in_process(generate.main, "--ckpt", tmp_path / "fp4.pt", "--prompt", "Once upon a time",
                             "--method", method, "--temperature", 0, "--max-new-tokens", 12, "--json", *flags)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)["ids"]

    expected = ids("ar")
    assert ids("dflash", "--draft", tmp_path / "dflash" / "ckpt.pt") == expected
    assert ids("ddtree", "--draft", tmp_path / "dflash" / "ckpt.pt", "--budget", 8) == expected
    assert ids("eagle3", "--draft", tmp_path / "eagle" / "ckpt.pt") == expected
    report = bench.main(["--ckpt", str(tmp_path / "fp4.pt"), "--drafter", str(tmp_path / "dflash" / "ckpt.pt"),
                         "--methods", "ar,dflash-b8,ddtree-n8", "--new-tokens", "8", "--prompts", "1"])
    rows = {r["method"]: r for r in report["rows"]}
    packed = {"target": load_model(tmp_path / "fp4.pt")[0]}  # --compile leaves a MoE target's rows eager
    assert all(compiled_models(m, packed, None) is None for m in ("ar", "spec-k4", "dflash-b8", "ddtree-n8"))
    assert rows["ar"]["tau"] == 1 and all(0 < rows[m]["tau"] <= 8 for m in ("dflash-b8", "ddtree-n8"))  # prefill too


def test_what_does_not_apply_to_an_ar_moe_is_refused_in_one_line(ar_moe_ckpt, story_file, tmp_path):
    with pytest.raises(UserError, match="block routing is for diffusion LMs"):
        MoETransformer(MoEConfig(**SHAPE, causal=True, routing="block"))
    with pytest.raises(UserError, match="block routing is for diffusion LMs"):
        set_routing(random_ar_moe(seed=0, n_layer=1), "block")
    for flags, message in ((["--routing", "block"], r"--routing block is for diffusion LMs \(mdlm-moe\); --model ar"),
                           (["--noise-block", "8"], "--noise-block applies to --model mdlm and mdlm-moe only"),
                           (["--regenerate", "2"], "--regenerate trains a draft")):
        with pytest.raises(UserError, match=message):
            train.main(argv(story_file, tmp_path / "x", *flags, kind="ar-moe"))
    assert not (tmp_path / "x" / "ckpt.pt").exists()
    prompt = ["--ckpt", ar_moe_ckpt, "--prompt", "Once"]
    for main, args, message in (
            (generate.main, [*prompt, "--method", "diffusion"], "needs a mdlm or mdlm-moe checkpoint"),
            (generate.main, [*prompt, "--compile"], "--compile does not cover mixture-of-experts"),
            (generate.main, [*prompt, "--method", "dflash"], "needs --draft"),
            (export.main, ["--ckpt", ar_moe_ckpt, "--out", tmp_path / "llama", "--layout", "llama"], "not a Llama")):
        res = run_in_process(main, *args)
        assert res.returncode == 1 and message in last_line(res.stderr), res.stderr
    assert not (tmp_path / "llama").exists()
    for routing in ("token", "block"):  # a checkpoint decodes with its saved routing: generate.py has no --routing
        res = run_in_process(generate.main, *prompt, "--routing", routing)
        assert res.returncode == 2 and "unrecognized arguments: --routing" in last_line(res.stderr)
    res = run_in_process(generate.main, *prompt, "--threshold", 0.9)  # the diffusion method's flags are its alone
    assert res.returncode == 1 and "--threshold does not apply to --method ar" in last_line(res.stderr)
