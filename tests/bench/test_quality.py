"""Spec: sample-quality metrics. Generative perplexity is the judge's exp(mean NLL); distinct-n
counts unique n-grams; d3LLM's AUP on its published test vectors; the curve's CLI."""
import math

import pytest
import torch
import torch.nn.functional as F

from tinydiff.bench import quality
from tinydiff.bench.curve import aup, curve_aups, quality_y
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_model, save_checkpoint
from tinydiff.model import Transformer
from tinydiff.sampler import generate_cached
from tinydiff.tokenizer import EOT
from tinydiff.tools import judge
from tinydiff.tools.judge import story


def test_distinct_n_counts_unique_ngrams():
    assert judge.distinct_n([[1, 2, 1, 2, 1]], 2) == 2 / 4
    assert judge.distinct_n([[1, 2, 3], [1, 2, 4]], 2) == 3 / 4  # pooled across samples
    assert judge.distinct_n([[5, 5, 5, 5]], 1) == 1 / 4 and judge.distinct_n([[7]], 2) == 0.0


def test_story_ends_at_the_first_eot():
    assert judge.story([3, 4, EOT, 9, EOT]) == [3, 4, EOT] and judge.story([3, 4]) == [3, 4]


@torch.no_grad()
def test_sample_nlls_are_the_judges_summed_nll_per_sample(tiny_model):
    tiny_model = tiny_model.double()  # float64: the two paths differ only in summation order
    samples = [[5, 6, 7], [], [8, 9]]
    want = []
    for s in (samples[0], samples[2]):
        seq = torch.tensor([[EOT] + s])
        logp = F.log_softmax(tiny_model(seq, causal=True)[0, :-1], -1)
        want.append(-logp.gather(-1, seq[0, 1:, None]).sum().item())
    nlls, counts = judge.sample_nlls(tiny_model, samples)  # the empty sample is skipped
    assert nlls == pytest.approx(want, rel=1e-12, abs=0) and counts == [3, 2]
    with pytest.raises(UserError, match="no sample"):
        judge.sample_nlls(tiny_model, [[], []])


def test_perplexity_interval_brackets_the_estimate_and_narrows_with_more_samples():
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(20, 65, (64,), generator=gen).tolist()
    nlls = [n * (3 + torch.randn(1, generator=gen).item()) for n in counts]  # per-sample mean NLL ~ N(3, 1)
    ppl = math.exp(sum(nlls) / sum(counts))
    lo, hi = judge.perplexity_interval(nlls, counts)
    assert lo < ppl < hi
    lo16, hi16 = judge.perplexity_interval(nlls * 16, counts * 16)  # 16x the samples: ~1/4 the width
    assert 0.15 < (math.log(hi16) - math.log(lo16)) / (math.log(hi) - math.log(lo)) < 0.35
    flat = judge.perplexity_interval([2.0 * n for n in counts], counts)  # every sample 2 nats/token
    assert flat == pytest.approx((math.exp(2.0), math.exp(2.0)))


def test_cli_on_tiny_models(tmp_path, tiny_model, tiny_config, capsys):
    save_checkpoint(tmp_path / "ar.pt", kind="ar", config=tiny_config, model=tiny_model)
    mdlm_config = type(tiny_config)(**{**tiny_config.__dict__, "causal": False})
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=mdlm_config, model=Transformer(mdlm_config))
    rows = quality.main(["--judge", str(tmp_path / "ar.pt"), "--mdlm", str(tmp_path / "mdlm.pt"),
                         "--student", str(tmp_path / "mdlm.pt"), "--ar", str(tmp_path / "ar.pt"), "--samples", "2",
                         "--gen-length", "8", "--block-length", "4", "--revise", "1", "--entropy-bound", "1e9",
                         "--student-draft", str(tmp_path / "ar.pt")])
    assert [r["sampler"] for r in rows] == list(quality.SAMPLERS)
    by_name = {r["sampler"]: r for r in rows}
    assert by_name["diffusion"]["forwards_per_token"] == 1.0 == by_name["distilled"]["forwards_per_token"]
    assert by_name["distilled"]["gen_ppl"] == by_name["diffusion-cached"]["gen_ppl"]  # the same model, sampler, seeds
    for name in ("diffusion-entropy", "distilled-entropy", "distilled-low-entropy"):  # a bound nothing reaches:
        assert by_name[name]["forwards_per_token"] == 1 / 4  # a block a forward
    assert by_name["diffusion-revise"]["forwards_per_token"] == (8 + 2 * 1) / 8
    assert by_name["diffusion-threshold"]["forwards_per_token"] <= 1.0
    assert by_name["distilled-ar-drafted"]["forwards_per_token"] <= 1.0
    assert all(r["gen_ppl"] > 1 and 0 <= r["distinct_2"] <= 1 for r in rows)
    assert all(r["gen_ppl_95"][0] <= r["gen_ppl"] <= r["gen_ppl_95"][1] for r in rows)
    with pytest.raises(UserError, match="nothing to sample"):
        quality.main(["--judge", str(tmp_path / "ar.pt")])
    only = quality.main(["--judge", str(tmp_path / "ar.pt"), "--mdlm", str(tmp_path / "mdlm.pt"), "--samples", "2",
                         "--gen-length", "8", "--block-length", "4", "--samplers", "diffusion-threshold"])
    assert [r["sampler"] for r in only] == ["diffusion-threshold"]
    assert only[0]["gen_ppl"] == by_name["diffusion-threshold"]["gen_ppl"]  # same seeds, same samples
    with pytest.raises(UserError, match="unknown sampler"):
        quality.main(["--judge", str(tmp_path / "ar.pt"), "--mdlm", str(tmp_path / "mdlm.pt"), "--samplers", "best"])


def test_cli_routes_a_moe_checkpoint_as_asked(tmp_path, tiny_model, tiny_config):
    from tinydiff.dmoe import MoEConfig, MoETransformer
    save_checkpoint(tmp_path / "ar.pt", kind="ar", config=tiny_config, model=tiny_model)
    torch.manual_seed(0)
    config = MoEConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False, n_experts=8,
                       moe_top_k=2, route_block=4, route_guard=2, route_threshold=0.5)
    model = MoETransformer(config)
    for layer in model.modules():  # weights large enough that a coreset changes the samples
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=1.0)
    for routing in ("token", "block"):
        save_checkpoint(tmp_path / f"{routing}.pt", kind="mdlm-moe",
                        config=MoEConfig(**{**config.__dict__, "routing": routing}), model=model)
    run = lambda ckpt, *flags: quality.main(["--judge", str(tmp_path / "ar.pt"), "--mdlm", str(tmp_path / ckpt),
                                             "--samples", "3", "--gen-length", "8", "--block-length", "4",
                                             "--samplers", "diffusion", "--temperature", "0", *flags])[0]["gen_ppl"]
    token, block = run("token.pt"), run("block.pt")
    assert token != block  # the saved routing is used ...
    assert run("block.pt", "--routing", "token") == token and run("token.pt", "--routing", "block") == block
    dense = type(tiny_config)(**{**tiny_config.__dict__, "causal": False})
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=dense, model=Transformer(dense))
    with pytest.raises(UserError, match="--routing needs a mixture-of-experts"):
        run("mdlm.pt", "--routing", "block")
    wide = run("block.pt", "--route-guard", "8")  # every coreset all 8 experts: token routing again
    assert wide == token and run("block.pt", "--route-threshold", "1.0") == token  # the union of the top-k sets
    with pytest.raises(UserError, match="--route-guard tunes block routing; add --routing block"):
        run("token.pt", "--route-guard", "3")
    assert run("block.pt", "--route-mask-vote", "50") != block  # MASK positions pick the coresets
    with pytest.raises(UserError, match="--route-mask-vote tunes block routing; add --routing block"):
        run("token.pt", "--route-mask-vote", "2")
    with pytest.raises(UserError, match="--route-threshold needs a mixture-of-experts"):
        run("mdlm.pt", "--route-threshold", "0.5")
    with pytest.raises(UserError, match="the guard must lie in"):
        run("block.pt", "--route-guard", "9")


def test_aup_matches_d3llms_test_vectors():
    assert aup([(1, 74.1)], 74.98) == pytest.approx(74.1)
    assert aup([(1, 74.0), (5.14, 72.63)], 74.98) == pytest.approx(358.1, abs=0.05)
    assert aup([(1, 74.02), (9.11, 73.09)], 74.98) == pytest.approx(637.7, abs=0.05)
    assert aup([(5.14, 72.63), (1, 74.0)], 74.98) == aup([(1, 74.0), (5.14, 72.63)], 74.98)  # any order in
    assert aup([(1, 74.0), (4, 60.0)], 74.98) == 74.0  # more than 5 points below the first: dropped


def test_quality_y_takes_the_worse_ratio_capped_at_100():
    ref = {"gen_ppl": 10.0, "distinct_2": 0.5}
    assert quality_y({"gen_ppl": 20.0, "distinct_2": 0.5}, ref) == 50.0
    assert quality_y({"gen_ppl": 5.0, "distinct_2": 0.25}, ref) == 50.0  # lower perplexity from repeating earns nothing
    assert quality_y({"gen_ppl": 5.0, "distinct_2": 0.9}, ref) == 100.0


def test_each_curve_starts_at_the_one_token_per_step_point_of_its_order():
    """The confidence-order families start at the model's one-token-per-step point; another order's at its own
    first point; the self-speculative points, which sample the left-to-right sampler exactly, at its bound 0."""
    def row(setting, rho, y):
        return {"model": "student", "setting": setting, "forwards_per_token": 1 / rho, "y": y}
    rows = [row("one token per step", 1, 100), row("threshold 0.5", 2, 60), row("left-to-right bound 0", 1, 90),
            row("left-to-right bound 1", 1.5, 80), row("low-entropy bound 1", 1.2, 70), row("self-speculative 2", 1.5, 90),
            row("ar-drafted 4", 2.5, 88)]
    got = curve_aups(rows, 100)
    assert got["student, threshold"] == aup([(1, 100), (2, 60)], 100)
    assert got["student, left-to-right bound"] == aup([(1, 90), (1.5, 80)], 100)
    assert got["student, self-speculative"] == aup([(1, 90), (1.5, 90)], 100)
    assert got["student, ar-drafted"] == aup([(1, 90), (2.5, 88)], 100)
    assert "student, low-entropy bound" not in got  # one point, no curve


def test_curve_cli(tmp_path, tiny_model, tiny_config, story_file):
    save_checkpoint(tmp_path / "ar.pt", kind="ar", config=tiny_config, model=tiny_model)
    mdlm_config = type(tiny_config)(**{**tiny_config.__dict__, "causal": False})
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=mdlm_config, model=Transformer(mdlm_config))
    args = ["--judge", str(tmp_path / "ar.pt"), "--mdlm", str(tmp_path / "mdlm.pt"), "--student", str(tmp_path / "mdlm.pt"),
            "--ar", str(tmp_path / "ar.pt"), "--draft", str(tmp_path / "ar.pt"), "--samples", "2", "--gen-length", "8",
            "--block-length", "4", "--curve", "--thresholds", "1e-9", "--entropy-bounds", "0,1e9", "--ltr-bounds", "0,1e9",
            "--low-entropy-bounds", "0,1e9", "--self-spec-drafts", "1,2", "--student-draft", str(tmp_path / "ar.pt"),
            "--ar-drafted-drafts", "3", "--data",
            str(story_file), "--json", str(tmp_path / "curve.json")]
    rows = quality.main(args)
    settings = [(r["model"], r["setting"]) for r in rows]
    assert settings == [(m, s) for m in ("teacher", "student") for s in
                        ("one token per step", "threshold 1e-09", "entropy bound 0", "entropy bound 1e+09",
                         "left-to-right bound 0", "left-to-right bound 1e+09", "low-entropy bound 0",
                         "low-entropy bound 1e+09", "self-speculative 1", "self-speculative 2")] + \
        [("student", "ar-drafted 3"), ("ar", "one token per forward"), ("ar + speculative", "draft k = 4")]
    by = {(r["model"], r["setting"]): r for r in rows}
    assert by["teacher", "one token per step"]["y"] == 100 and by["teacher", "one token per step"]["agreement_t0"] == 1
    assert by["teacher", "threshold 1e-09"]["forwards_per_token"] == 1 / 4  # every token clears it: a block a forward
    assert by["teacher", "entropy bound 0"]["gen_ppl"] == by["teacher", "one token per step"]["gen_ppl"]
    assert by["teacher", "left-to-right bound 0"]["forwards_per_token"] == 1  # AR order, one token a forward
    assert by["teacher", "left-to-right bound 1e+09"]["forwards_per_token"] == 1 / 4
    assert by["teacher", "low-entropy bound 1e+09"]["forwards_per_token"] == 1 / 4
    student, _ = load_model(tmp_path / "mdlm.pt")  # bound 0: one token a step, lowest entropy first
    assert by["student", "low-entropy bound 0"]["stories"] == [story(generate_cached(
        student, [EOT], 8, 8, 4, 1.0, "low_entropy", generator=torch.Generator().manual_seed(seed))[0]) for seed in (0, 1)]
    for name in ("teacher", "student"):  # exactly the left-to-right sampler: one draft a round is one forward a
        assert by[name, "self-speculative 1"]["forwards_per_token"] == 1  # token, and at T = 0 the same text
        assert by[name, "self-speculative 2"]["forwards_per_token"] <= 1
        for k in (1, 2):
            assert by[name, f"self-speculative {k}"]["agreement_t0"] == by[name, "left-to-right bound 0"]["agreement_t0"]
    assert by["student", "ar-drafted 3"]["agreement_t0"] == by["student", "left-to-right bound 0"]["agreement_t0"]
    assert by["student", "ar-drafted 3"]["forwards_per_token"] <= 1 and by["student", "ar-drafted 3"]["checkpoint"] == \
        f"{tmp_path / 'mdlm.pt'} + {tmp_path / 'ar.pt'}"
    assert by["ar + speculative", "draft k = 4"]["forwards_per_token"] < 1  # its own draft: every draft accepted
    assert (tmp_path / "curve.json").is_file()
    again = quality.main(args[:-2] + ["--reuse", str(tmp_path / "curve.json"), "--thresholds", "1e-9,0.5"])
    redone = {(r["model"], r["setting"]): r for r in again}
    assert redone["student", "threshold 0.5"]["forwards_per_token"] <= 1  # the new point, sampled
    for key, row in by.items():  # the old points, read back: the same numbers
        assert redone[key]["gen_ppl"] == row["gen_ppl"] and redone[key]["gen_ppl_95"] == list(row["gen_ppl_95"])
    with pytest.raises(UserError, match="other samples"):
        quality.main(args[:-2] + ["--reuse", str(tmp_path / "curve.json"), "--samples", "3"])
    with pytest.raises(UserError, match="--draft adds"):
        quality.main(["--judge", str(tmp_path / "ar.pt"), "--ar", str(tmp_path / "ar.pt"), "--draft", str(tmp_path / "ar.pt")])
    with pytest.raises(UserError, match="--student-draft drafts for --student"):
        quality.main(["--judge", str(tmp_path / "ar.pt"), "--mdlm", "m.pt", "--student-draft", str(tmp_path / "ar.pt")])
    with pytest.raises(UserError, match="--ar-drafted-drafts needs --student-draft"):
        quality.main(args[:6] + ["--curve", "--ar-drafted-drafts", "2"])


def test_curve_plot_without_matplotlib_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "find_spec", lambda name: None)  # matplotlib is optional (requirements-plots.txt)
    monkeypatch.setattr(quality, "load_model", lambda *a, **k: pytest.fail("loaded a model before checking --plot"))
    with pytest.raises(UserError, match="--plot needs matplotlib"):
        quality.main(["--judge", "j.pt", "--mdlm", "m.pt", "--curve", "--plot", str(tmp_path / "curve.png")])
