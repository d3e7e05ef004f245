"""Spec: sample-quality metrics. Generative perplexity is the judge's exp(mean NLL); distinct-n
counts unique n-grams."""
import math

import pytest
import torch
import torch.nn.functional as F

from tinydiff import quality
from tinydiff.checkpoint import save_checkpoint
from tinydiff.errors import UserError
from tinydiff.model import Transformer
from tinydiff.tokenizer import EOT


def test_distinct_n_counts_unique_ngrams():
    assert quality.distinct_n([[1, 2, 1, 2, 1]], 2) == 2 / 4
    assert quality.distinct_n([[1, 2, 3], [1, 2, 4]], 2) == 3 / 4  # pooled across samples
    assert quality.distinct_n([[5, 5, 5, 5]], 1) == 1 / 4 and quality.distinct_n([[7]], 2) == 0.0


def test_story_ends_at_the_first_eot():
    assert quality.story([3, 4, EOT, 9, EOT]) == [3, 4, EOT] and quality.story([3, 4]) == [3, 4]


@torch.no_grad()
def test_sample_nlls_are_the_judges_summed_nll_per_sample(tiny_model):
    samples = [[5, 6, 7], [], [8, 9]]
    want = []
    for s in (samples[0], samples[2]):
        seq = torch.tensor([[EOT] + s])
        logp = F.log_softmax(tiny_model(seq, causal=True)[0, :-1], -1)
        want.append(-logp.gather(-1, seq[0, 1:, None]).sum().item())
    nlls, counts = quality.sample_nlls(tiny_model, samples)  # the empty sample is skipped
    assert nlls == pytest.approx(want, rel=1e-5) and counts == [3, 2]
    with pytest.raises(UserError, match="no sample"):
        quality.sample_nlls(tiny_model, [[], []])


def test_perplexity_interval_brackets_the_estimate_and_narrows_with_more_samples():
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(20, 65, (64,), generator=gen).tolist()
    nlls = [n * (3 + torch.randn(1, generator=gen).item()) for n in counts]  # per-sample mean NLL ~ N(3, 1)
    ppl = math.exp(sum(nlls) / sum(counts))
    lo, hi = quality.perplexity_interval(nlls, counts)
    assert lo < ppl < hi
    lo16, hi16 = quality.perplexity_interval(nlls * 16, counts * 16)  # 16x the samples: ~1/4 the width
    assert 0.15 < (math.log(hi16) - math.log(lo16)) / (math.log(hi) - math.log(lo)) < 0.35
    flat = quality.perplexity_interval([2.0 * n for n in counts], counts)  # every sample 2 nats/token
    assert flat == pytest.approx((math.exp(2.0), math.exp(2.0)))


def test_cli_on_tiny_models(tmp_path, tiny_model, tiny_config, capsys):
    save_checkpoint(tmp_path / "ar.pt", kind="ar", config=tiny_config, model=tiny_model)
    mdlm_config = type(tiny_config)(**{**tiny_config.__dict__, "causal": False})
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=mdlm_config, model=Transformer(mdlm_config))
    rows = quality.main(["--judge", str(tmp_path / "ar.pt"), "--mdlm", str(tmp_path / "mdlm.pt"),
                         "--ar", str(tmp_path / "ar.pt"), "--samples", "2", "--gen-length", "8",
                         "--block-length", "4", "--revise", "1"])
    assert [r["sampler"] for r in rows] == list(quality.SAMPLERS)
    by_name = {r["sampler"]: r for r in rows}
    assert by_name["diffusion"]["forwards_per_token"] == 1.0
    assert by_name["diffusion-revise"]["forwards_per_token"] == (8 + 2 * 1) / 8
    assert by_name["diffusion-threshold"]["forwards_per_token"] <= 1.0
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
