"""Spec: generate.py and the bench as a user runs them: JSON output, and one-line errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate
from tinydiff.bench import table as bench
from tinydiff.checkpoint import save_checkpoint
from tinydiff.errors import UserError
from tinydiff.model import Transformer
from tinydiff.speculative import expected_tokens_per_round
from tinydiff.tokenizer import EOT, MASK, Tokenizer
from entry_points import run_in_process

ROOT = Path(__file__).resolve().parents[1]


def run_process(*args):
    """generate.py exactly as a user runs it: a fresh interpreter."""
    return subprocess.run([sys.executable, "generate.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def run(*args):
    """generate.py's entry point in this process (tests/entry_points.py)."""
    return run_in_process(generate.main, *args)


@pytest.fixture
def ckpt(tmp_path, tiny_model, tiny_config):
    save_checkpoint(tmp_path / "ckpt.pt", kind="ar", config=tiny_config, model=tiny_model)
    return tmp_path / "ckpt.pt"


def test_json_output(ckpt):
    res = run_process("--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 6, "--temperature", 0, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    tok = Tokenizer()
    assert out["prompt_ids"] == [EOT] + tok.encode("Once upon a time")
    assert 1 <= len(out["ids"]) <= 6 and out["stats"]["new_tokens"] == len(out["ids"])
    assert out["text"] == "Once upon a time" + tok.decode([i for i in out["ids"] if i != EOT])
    assert out["stats"]["forwards"] == len(out["ids"]) and out["stats"]["tokens_per_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "word " * 40], "context is 32"),
    (["--prompt", "hi", "--max-new-tokens", 0], "--max-new-tokens: must be an integer >= 1"),
    (["--prompt", "hi", "--temperature", -1], "temperature"),
    (["--prompt", "hi", "--temperature", "nan"], "--temperature: must be 0 or a finite number"),  # it once wrote MASK ids
    (["--prompt", "hi", "--temperature", "inf"], "--temperature: must be 0 or a finite number"),
])
def test_bad_input_is_one_line(ckpt, args, message):
    res = run("--ckpt", ckpt, *args)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert message in res.stderr.strip().splitlines()[-1]


def test_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"\x00" * 10)
    res = run("--ckpt", tmp_path / "bad.pt", "--prompt", "hi")
    assert res.returncode != 0 and res.stderr.strip().startswith("error:") and "Traceback" not in res.stderr


@pytest.fixture
def mdlm_ckpt(tmp_path, tiny_config):
    config = type(tiny_config)(**{**tiny_config.__dict__, "causal": False})
    torch.manual_seed(1)
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=config, model=Transformer(config))
    return tmp_path / "mdlm.pt"


def test_diffusion_json_output(mdlm_ckpt, ckpt):
    res = run("--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4,
              "--steps", 4, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["ids"]) == 8 and MASK not in out["ids"]
    assert out["stats"]["forwards"] == 4 and out["stats"]["tokens_per_forward"] == 2
    res = run("--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4, "--cached",
              "--entropy-bound", "1e9", "--json")  # a bound nothing reaches: each block in one forward
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stats"]["forwards"] == 2
    common = ["--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4, "--json"]
    one_per_step = json.loads(run(*common, "--cached", "--remasking", "left_to_right").stdout)
    res = run(*common, "--self-speculate", 3)  # left to right by default; greedy: the same tokens
    assert res.returncode == 0, res.stderr
    drafted = json.loads(res.stdout)
    assert drafted["ids"] == one_per_step["ids"] and drafted["stats"]["forwards"] <= 8
    assert len(drafted["stats"]["accepted"]) == 4 and drafted["stats"]["canvases"] > drafted["stats"]["forwards"]
    res = run(*common, "--self-speculate", 3, "--draft", ckpt)  # an AR draft proposes them: the same tokens again
    assert res.returncode == 0, res.stderr
    ar_drafted = json.loads(res.stdout)
    assert ar_drafted["ids"] == one_per_step["ids"] and ar_drafted["stats"]["forwards"] == ar_drafted["stats"]["rounds"]
    assert ar_drafted["stats"]["draft_forwards"] > 0 and len(ar_drafted["stats"]["accepted"]) == 4


def test_spec_equals_ar_at_temperature_zero(ckpt, tmp_path, tiny_config):
    draft_config = type(tiny_config)(**{**tiny_config.__dict__, "n_layer": 1})
    torch.manual_seed(2)
    save_checkpoint(tmp_path / "draft.pt", kind="ar", config=draft_config, model=Transformer(draft_config))
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    spec = json.loads(run(*common, "--method", "spec", "--draft", tmp_path / "draft.pt", "--k", 3).stdout)
    vllm = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "draft.pt")
    via_config = json.loads(run(*common, "--speculative-config", vllm).stdout)
    ssd = json.loads(run(*common, "--method", "ssd", "--draft", tmp_path / "draft.pt", "--k", 3,
                         "--fan-out", "0,0,0,1").stdout)  # one branch: after all 3 drafts pass
    assert spec["ids"] == ar["ids"] == via_config["ids"] == ssd["ids"]
    assert spec["stats"]["forwards"] == spec["stats"]["rounds"] and len(spec["stats"]["accepted"]) == 4
    assert ssd["stats"]["accepted"] == spec["stats"]["accepted"] and ssd["stats"]["hits"][:3] == [0, 0, 0]
    res = run(*common, "--method", "ssd", "--draft", tmp_path / "draft.pt", "--k", 3, "--fan-out", "0,1")
    assert res.returncode != 0 and "a list of k+1 = 4 integers" in res.stderr.strip().splitlines()[-1]
    assert len(via_config["stats"]["accepted"]) == 3
    for bad, message in (("{", "not valid JSON"), ('{"method": "eagle"}', "draft_model")):
        res = run("--ckpt", ckpt, "--prompt", "hi", "--speculative-config", bad)
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "spec")
    assert "needs --draft" in res.stderr


def test_dflash_equals_ar_at_temperature_zero(ckpt, tmp_path, tiny_model):
    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    config = DFlashConfig.for_target(tiny_model.config, block_size=4)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "drafter.pt", kind="dflash", config=config, model=DFlashDrafter(config, tiny_model))
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    dflash = json.loads(run(*common, "--method", "dflash", "--drafter", tmp_path / "drafter.pt").stdout)
    vllm = '{"method": "dflash", "model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "drafter.pt")
    via_config = json.loads(run(*common, "--speculative-config", vllm).stdout)
    scheduled = json.loads(run(*common, "--method", "dflash", "--drafter", tmp_path / "drafter.pt", "--rule", "reject",
                               "--min-confidence", 0.5).stdout)  # an untrained drafter: one draft verified a round
    assert dflash["ids"] == ar["ids"] == via_config["ids"] == scheduled["ids"]
    assert len(dflash["stats"]["accepted"]) == 4 and len(via_config["stats"]["accepted"]) == 3
    assert scheduled["stats"]["slot_judged"][0] > 0 and not any(scheduled["stats"]["slot_judged"][1:])
    sampled_tree = json.loads(run(*common[:-3], "--temperature", 1, "--seed", 3, "--json", "--method", "ddtree",
                                  "--drafter", tmp_path / "drafter.pt", "--rule", "reject", "--budget", 4).stdout)
    assert len(sampled_tree["ids"]) == 12 and sampled_tree["stats"]["nodes_per_round"] <= 4
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "ddtree", "--drafter", tmp_path / "drafter.pt",
              "--min-confidence", 0.5)
    assert "--min-confidence" in res.stderr.strip().splitlines()[-1] and res.returncode != 0
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "dflash", "--drafter", ckpt)
    assert "not a dflash drafter" in res.stderr.strip().splitlines()[-1]


def test_eagle3_chain_and_tree_equal_ar_at_temperature_zero(ckpt, tmp_path, tiny_model):
    from tinydiff.eagle import EagleConfig, EagleHead
    torch.manual_seed(4)
    head = EagleHead(EagleConfig.for_target(tiny_model.config), tiny_model)
    save_checkpoint(tmp_path / "head.pt", kind="eagle3", config=head.config, model=head)
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    chain = json.loads(run(*common, "--method", "eagle3", "--drafter", tmp_path / "head.pt", "--k", 3).stdout)
    tree = json.loads(run(*common, "--method", "eagle3", "--drafter", tmp_path / "head.pt", "--budget", 8).stdout)
    assert chain["ids"] == tree["ids"] == ar["ids"]
    assert len(chain["stats"]["accepted"]) == 4 and tree["stats"]["nodes_per_round"] <= 8
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "eagle3", "--drafter", ckpt)
    assert "not a eagle3 drafter" in res.stderr.strip().splitlines()[-1]


@pytest.mark.compile
def test_compile_writes_the_same_tokens_and_reports_its_time_apart(ckpt, mdlm_ckpt):
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--temperature", 0, "--json"]
    eager, compiled = json.loads(run(*common).stdout), json.loads(run(*common, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["compile_seconds"] > 0
    assert "compile_seconds" not in eager["stats"]
    for args, message in ((["--ckpt", ckpt, "--method", "ssd", "--draft", ckpt], "--compile does not apply"),
                          (["--ckpt", mdlm_ckpt], "add --cached")):
        res = run(*args, "--prompt", "hi", "--compile")
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--gen-length", 10, "--block-length", 4], "multiple of the block length"),
    (["--cached", "--revise", 1], "--revise works with the uncached sampler"),
    (["--method", "ar"], "needs a ar or ar-moe checkpoint"),
    (["--gen-length", 8, "--block-length", 4, "--entropy-bound", -1], "--entropy-bound: must be a finite number >= 0"),
    (["--gen-length", 8, "--block-length", 4, "--entropy-bound", 0.5, "--threshold", 0.9], "not both"),
    (["--self-speculate", 2, "--threshold", 0.9], "one token per step exactly (cached, eager); drop --threshold"),
    (["--self-speculate", 2, "--remasking", "low_confidence"], "pass --remasking left_to_right or low_entropy"),
    (["--draft", "draft.pt"], "--draft proposes the positions of --self-speculate K for a diffusion model: add it"),
    (["--self-speculate", 2, "--draft", "draft.pt", "--remasking", "low_entropy"], "left to right, as an AR model reads"),
])
def test_diffusion_bad_input_is_one_line(mdlm_ckpt, args, message):
    res = run("--ckpt", mdlm_ckpt, "--prompt", "hi", *args)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert message in res.stderr.strip().splitlines()[-1]


def test_routing_flags_on_a_moe_checkpoint(ckpt, tmp_path):
    from tinydiff.dmoe import MoETransformer, moe_config
    torch.manual_seed(4)
    moe = MoETransformer(moe_config("draft", context=32, n_experts=8, moe_top_k=2, route_block=4))
    save_checkpoint(tmp_path / "moe.pt", kind="mdlm-moe", config=moe.config, model=moe)
    common = ["--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4, "--json"]
    saved = json.loads(run("--ckpt", tmp_path / "moe.pt", *common).stdout)["stats"]
    block = json.loads(run("--ckpt", tmp_path / "moe.pt", *common, "--routing", "block", "--route-guard", 2).stdout)
    assert saved["routing"] == "token" and block["stats"]["routing"] == "block"
    assert block["stats"]["unique_experts_per_block"] <= saved["unique_experts_per_block"]
    for path, flags, message in ((tmp_path / "moe.pt", ["--route-guard", 3], "--route-guard tunes block routing; add"),
                                 (tmp_path / "moe.pt", ["--route-mask-vote", 4], "--route-mask-vote tunes block"),
                                 (tmp_path / "moe.pt", ["--cached", "--compile"], "not cover mixture-of-experts"),
                                 (ckpt, ["--routing", "block"], "--routing do not apply to --method ar")):
        res = run("--ckpt", path, *common, *flags)
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]


def test_bench_refuses_a_json_path_it_cannot_write_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "load_models", lambda args: pytest.fail("loaded models before checking --json"))
    with pytest.raises(UserError, match="--json .*x.json: its folder .* does not exist"):
        bench.main(["--methods", "ar", "--json", str(tmp_path / "missing" / "x.json")])


def test_bench_fr_rows_need_data_before_any_work(monkeypatch):
    monkeypatch.setattr(bench, "load_models", lambda args: pytest.fail("loaded models before checking --data"))
    with pytest.raises(UserError, match="-fr rows count the draft's vocabulary on --data"):
        bench.main(["--methods", "ar,spec-k4-fr"])
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit):
            bench.main(["--methods", "spec-k4-fr", "--draft-vocab", bad])


def test_bench_rows(ckpt, mdlm_ckpt, story_file, tmp_path):
    from tinydiff.dmoe import MoETransformer, moe_config
    moe = MoETransformer(moe_config("draft", context=32, n_experts=8))
    save_checkpoint(tmp_path / "moe.pt", kind="mdlm-moe", config=moe.config, model=moe)
    report = bench.main(["--ckpt", str(ckpt), "--mdlm", str(mdlm_ckpt), "--moe", str(tmp_path / "moe.pt"),
                         "--distilled", str(mdlm_ckpt), "--distilled-draft", str(ckpt), "--entropy-bound", "1e9",
                         "--new-tokens", "8", "--prompts", "2",
                         "--data", str(story_file), "--json", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text()) == report and report["device"]
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == list(bench.METHODS)
    assert rows["ar"]["tau"] == 1 and rows["ar"]["target_forwards_per_token"] == 1 and rows["ar"]["speedup_vs_ar"] == 1
    for name, k in (("spec-k2", 2), ("spec-k4", 4), ("spec-k8", 8), ("spec-k2-fr", 2), ("spec-k4-fr", 4)):
        spec = rows[name]
        assert 1 <= spec["tau"] <= k + 1 and 0 <= spec["alpha"] <= 1 and spec["predicted_speedup"] > 0
        assert spec["loop_c"] > 0 and spec["loop_v"] > 0 and spec["predicted_at_loop_costs"] == pytest.approx(
            expected_tokens_per_round(spec["alpha"], k) / (k * spec["loop_c"] + spec["loop_v"]))
        assert len(spec["accepted_hist"]) == k + 1 and len(spec["acceptance_by_slot"]) == k
        assert spec["alpha"] == pytest.approx(sum(spec["slot_kept"]) / sum(spec["slot_judged"]))  # kept / judged
        assert spec["tau"] == pytest.approx(1 / spec["target_forwards_per_token"])
        assert set(spec["us_per_round"]) == {"draft", "verify", "host"} and min(spec["us_per_round"].values()) > 0
    for name in ("dflash-b16", "ddtree-n32"):  # the block and tree loops clock their rounds' stages too
        assert set(rows[name]["us_per_round"]) == {"draft", "verify", "host"}
        assert rows[name]["us_per_round"]["draft"] > 0 and rows[name]["us_per_round"]["verify"] > 0
    assert report["draft_target_cost_c"] > 0
    for name in ("dflash-b16-sched", "dflash-b16-reject-sched"):  # an untrained drafter is never 0.3 sure of a
        assert rows[name]["slot_judged"][0] > 0 and not any(rows[name]["slot_judged"][1:])  # token: one draft a round
    for name in ("ssd-f1", "ssd-f3", "ssd-f8", "ssd-g1", "ssd-g2"):  # greedy: the rounds of spec-k4, cached or not
        assert rows[name]["accepted_hist"] == rows["spec-k4"]["accepted_hist"] and 0 <= rows[name]["hit_rate"] <= 1
    for n in (8, 16, 32, 64, 128):
        tree = rows[f"ddtree-n{n}"]
        assert 0 < tree["tau"] <= 16 and 0 < tree["nodes_per_round"] <= n  # tau counts the prefill forward too
    for n in (16, 32, 64):  # greedy: a sampled tree is the plain tree, round for round
        assert rows[f"ddtree-n{n}-reject"]["accepted_hist"] == rows[f"ddtree-n{n}"]["accepted_hist"]
        rounds = sum(tree["accepted_hist"])  # every round judges slot 1 but a last one without room for drafts
        assert len(tree["acceptance_by_slot"]) == 15 and rounds - 2 <= tree["slot_judged"][0] <= rounds
        assert tree["speedup_vs_dflash"] == pytest.approx(tree["tokens_per_s"] / rows["dflash-b16"]["tokens_per_s"])
    assert 0 < rows["eagle3-chain"]["tau"] <= 5 and 0 <= rows["eagle3-chain"]["alpha"] <= 1  # a prefill forward too
    assert rows["eagle3-tree"]["alpha"] is None and 0 < rows["eagle3-tree"]["nodes_per_round"] <= 32
    for name in ("diffusion", "diffusion-cached"):  # one token per denoising step
        assert rows[name]["target_forwards_per_token"] == 1
    assert rows["diffusion-threshold"]["target_forwards_per_token"] <= 1
    for name in ("diffusion-entropy", "diffusion-distilled-entropy", "diffusion-distilled-low-entropy"):  # a bound
        # nothing reaches: one forward a block
        assert rows[name]["target_forwards_per_token"] == 1 / 8
    for k in (1, 2, 4):  # lossless left to right: never more than one forward a token, nor more than k tokens
        row = rows[f"diffusion-distilled-self-spec-k{k}"]
        assert 1 <= row["tau"] <= k and len(row["accepted_hist"]) == k + 1 and len(row["acceptance_by_slot"]) == k
        assert row["heldout_nll"] == rows["diffusion"]["heldout_nll"]
    assert rows["diffusion-distilled-self-spec-k1"]["tau"] == 1  # one draft a round: the target's own step
    assert rows["diffusion-distilled-self-spec-k1"]["canvases_per_token"] == 1
    assert rows["diffusion-distilled-self-spec-k4"]["canvases_per_token"] >= 1
    for k in (4, 8, 16):  # an AR draft's positions: up to k + 1 tokens a forward (the bonus), each forward k + 1 canvases
        row = rows[f"diffusion-distilled-ar-drafted-k{k}"]
        assert 1 <= row["tau"] <= k + 1 and len(row["accepted_hist"]) == k + 1 and 0 <= row["alpha"] <= 1
        assert 1 <= row["canvases_per_token"] <= k + 1 and row["heldout_nll"] == rows["diffusion"]["heldout_nll"]
    for t in (0.9, 0.7, 0.5):
        assert rows[f"diffusion-distilled-t{t:g}"]["target_forwards_per_token"] <= 1
        assert rows[f"diffusion-distilled-t{t:g}"]["heldout_nll"] == rows["diffusion"]["heldout_nll"]  # --distilled is it
    assert all(r["tokens_per_s"] > 0 and r["heldout_nll"] > 0 and r["heldout_bpb"] > 0 for r in rows.values())
    assert rows["diffusion"]["heldout_nll"] == rows["diffusion-cached"]["heldout_nll"]  # one model, one number
    assert rows["dmoe-block"]["unique_experts_per_block"] <= rows["dmoe-token"]["unique_experts_per_block"]
    assert rows["dmoe-block"]["expert_bytes_per_forward"] <= rows["dmoe-token"]["expert_bytes_per_forward"]
    with pytest.raises(UserError, match="unknown method"):
        bench.main(["--methods", "nope"])


@pytest.mark.compile
def test_bench_compile_counts_as_eager_and_times_compiling_apart(ckpt, mdlm_ckpt, capsys):
    args = ["--ckpt", str(ckpt), "--draft", str(ckpt), "--mdlm", str(mdlm_ckpt), "--methods", "ar,spec-k2,diffusion",
            "--new-tokens", "6", "--prompts", "2"]
    eager, compiled = bench.main(args), bench.main(args + ["--compile"])
    out = capsys.readouterr().out
    for plain, static in zip(eager["rows"], compiled["rows"]):
        assert plain.get("accepted_hist") == static.get("accepted_hist")  # greedy: the same rounds, compiled or not
        # Fused `ar` (fused_round.py) reads the prompt in forwards of its own (chunks of 8 tokens): whole
        # forwards more a prompt of 6 new tokens, at least one.
        extra = 6 * (static["target_forwards_per_token"] - plain["target_forwards_per_token"])
        assert extra == 0 if plain["method"] != "ar" else extra == pytest.approx(round(extra)) and round(extra) >= 1
    rows = {r["method"]: r for r in compiled["rows"]}
    assert rows["ar"]["compiled"] and rows["spec-k2"]["compiled"] and rows["spec-k2"]["compile_seconds"] > 0
    assert rows["diffusion"]["compiled"] is False and "diffusion: eager (--compile does not cover it)" in out
    assert "ar: compiled, " in out and not any(r["compiled"] for r in eager["rows"])


def test_bench_decodes_held_out_openings_with_openings(ckpt, story_file, tmp_path, capsys):
    report = bench.main(["--ckpt", str(ckpt), "--methods", "ar,spec-k2", "--new-tokens", "4", "--prompts", "6",
                         "--openings", "--data", str(story_file)])
    assert "| 6 held-out openings x 4 new tokens" in capsys.readouterr().out
    assert [r["method"] for r in report["rows"]] == ["ar", "spec-k2"]
    with pytest.raises(UserError, match="--openings draws story openings from --data"):
        bench.main(["--methods", "ar", "--openings"])
    with pytest.raises(UserError, match=r"--prompts must lie in \[1, 4\]"):
        bench.main(["--methods", "ar", "--prompts", "6"])


def test_canvas_view_redraws_in_place(capsys):
    import generate
    tok = Tokenizer()
    view = generate.CanvasView(tok, "Once", prompt_len=2)
    canvas = torch.tensor([EOT, 7454, MASK, MASK])
    view({"canvas": canvas})
    canvas[2] = 2402
    view({"canvas": canvas})
    view.clear()
    out = capsys.readouterr().out
    frames = out.split("\x1b[1F\x1b[J")  # each later frame first moves up over the one-line frame before it
    assert len(frames) == 3 and frames[-1] == ""
    assert frames[0] == "Once" + tok.decode([MASK, MASK]) + "\n" and frames[1] == "Once" + tok.decode([2402, MASK]) + "\n"


def test_bench_takes_a_late_compile_out_of_the_phase_it_fell_in(tiny_model):
    """A shape the warm-up never met compiles inside a timed prompt: its seconds leave the decoding
    time and the phase that paid them (the target's the verify, a draft's the drafting)."""
    from types import SimpleNamespace

    from tinydiff.bench.measure import measure
    from tinydiff.compiled import StaticModel
    models = {"target": StaticModel(tiny_model, compile=False), "draft": StaticModel(tiny_model, compile=False)}
    calls = []

    def method(models, prompt, args, generator):  # one round of 2 drafts per prompt; the 3rd call compiles
        calls.append(prompt)
        late = len(calls) == 3
        if late:
            models["target"].step.compile_seconds += 0.5
            models["draft"].step.compile_seconds += 0.25
        return {"new_tokens": 3, "target_forwards": 1, "proposed": 2, "accepted": [0, 0, 1],
                "slot_judged": [1, 1], "slot_kept": [1, 1], "seconds": 1.0 + 0.75 * late,
                "draft_seconds": 0.25 + 0.25 * late, "verify_seconds": 0.5 + 0.5 * late}

    row = measure(method, models, [[1], [2], [3], [4]], SimpleNamespace(device="cpu", seed=0))
    assert len(calls) == 5  # one warm-up prompt (it compiled nothing), then the four timed
    assert row["tokens_per_s"] == 12 / 4.0
    assert row["us_per_round"] == {"draft": 0.25e6, "verify": 0.5e6, "host": 0.25e6}


@pytest.mark.parametrize("method", ["ar", "spec-k2-fr"])
def test_bench_compile_runs_ar_and_fr_rows_on_fused_rounds(tiny_model, method):
    """With --compile, `ar` and the -fr rows decode through fused_round.py (here with the graphs run
    eagerly: compile mode False): the same rounds as the eager rows, and one more target forward (the
    prompt read apart)."""
    from types import SimpleNamespace

    from tinydiff.bench.methods import METHODS, compiled_models
    from tinydiff.frequent_vocab import FrequentVocabDraft
    models = {"target": tiny_model, "draft_fr": FrequentVocabDraft(tiny_model, torch.arange(0, 50000, 50))}
    args = SimpleNamespace(compile=False, new_tokens=12, temperature=1.0)
    fused = compiled_models(method, models, args)
    assert "fused" in fused
    prompt = [EOT, 3, 4]
    plain = METHODS[method](models, prompt, args, torch.Generator().manual_seed(0))
    ours = METHODS[method](fused, prompt, args, torch.Generator().manual_seed(0))
    assert ours["new_tokens"] == plain["new_tokens"] == 12 and ours.get("accepted") == plain.get("accepted")
    assert ours["target_forwards"] == plain["target_forwards"] + 1


def test_bench_times_a_round_run_as_one_graph_in_all():
    """A fused round (fused_round.py) is not split into drafting and verifying: its row gives the whole
    round's microseconds, and no loop costs."""
    from types import SimpleNamespace

    from tinydiff.bench.measure import measure

    def method(models, prompt, args, generator):  # two rounds a prompt, 0.5 s each
        return {"new_tokens": 5, "target_forwards": 2, "proposed": 4, "accepted": [0, 1, 1], "rejected": 1,
                "slot_judged": [2, 1], "slot_kept": [2, 1], "seconds": 1.0}

    row = measure(method, {}, [[1], [2]], SimpleNamespace(device="cpu", seed=0))
    assert row["us_per_round"] == {"in all": 0.5e6} and "seconds_per_draft" not in row


def test_bench_interleave_times_every_method_on_a_prompt_before_the_next():
    """--interleave: each method warms up, then prompt by prompt every method decodes it; each row is
    the one that method alone would give."""
    from types import SimpleNamespace

    from tinydiff.bench.measure import measure, measure_interleaved
    calls = []

    def method_of(name, tokens):
        def method(models, prompt, args, generator):
            calls.append((name, prompt[0]))
            return {"new_tokens": tokens, "target_forwards": 1, "seconds": 0.5 * tokens}
        return method

    one, two = method_of("one", 2), method_of("two", 3)
    args, prompts = SimpleNamespace(device="cpu", seed=0), [[1], [2], [3]]
    rows = measure_interleaved([(one, {}), (two, {})], prompts, args)
    assert calls == [("one", 1), ("two", 1)] + [(name, p) for p in (1, 2, 3) for name in ("one", "two")]
    assert rows == [measure(one, {}, prompts, args), measure(two, {}, prompts, args)]
    assert rows[1]["tau"] == 3 and rows[1]["tokens_per_s"] == 2


def test_bench_interleave_writes_the_same_counts(ckpt, capsys):
    args = ["--ckpt", str(ckpt), "--draft", str(ckpt), "--methods", "ar,spec-k2", "--new-tokens", "6",
            "--prompts", "2", "--temperature", "1"]
    apart, together = bench.main(args), bench.main(args + ["--interleave"])
    for plain, mixed in zip(apart["rows"], together["rows"]):  # the same seeds: the same tokens and rounds
        assert plain["method"] == mixed["method"]
        for key in ("target_forwards_per_token", "accepted_hist", "alpha", "slot_kept"):
            assert plain.get(key) == mixed.get(key)
