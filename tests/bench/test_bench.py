"""Spec: the bench (python -m tinydiff.bench) as a user runs it: its rows, --json, --openings, --compile
(fused rounds for `ar` and the -fr rows), the timing of rounds and late compiles, --interleave, and
one-line errors before any work."""
import json

import pytest
import torch

from tinydiff.bench import table as bench
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.speculative import expected_tokens_per_round
from tinydiff.tokenizer import EOT


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
    one_graph = bench.STEPS_ROWS | {m for m in bench.METHODS if m.endswith("-fused")}  # they pay only with --compile
    assert list(rows) == [m for m in bench.METHODS if m not in one_graph]
    assert rows["ar"]["tau"] == 1 and rows["ar"]["target_forwards_per_token"] == 1 and rows["ar"]["speedup_vs_ar"] == 1
    for name, k in (("spec-k2", 2), ("spec-k4", 4), ("spec-k8", 8), ("spec-k2-fr", 2), ("spec-k3-fr", 3),
                    ("spec-k4-fr", 4)):
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
        m = min(k, 8)  # no round drafts past its 8-token block: ar_drafted_generate clamps the count to it
        assert 1 <= row["tau"] <= m + 1 and len(row["accepted_hist"]) == m + 1 and 0 <= row["alpha"] <= 1
        assert 1 <= row["canvases_per_token"] <= m + 1 and row["heldout_nll"] == rows["diffusion"]["heldout_nll"]
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
        # --compile runs the very loops, on compiled steps: the same forwards
        assert static["target_forwards_per_token"] == plain["target_forwards_per_token"]
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


def test_bench_takes_a_late_compile_out_of_the_phase_it_fell_in(tiny_model):
    """A shape the warm-up never met compiles inside a timed prompt: its seconds leave the decoding
    time and the phase that paid them (the target's the verify, a draft's the drafting)."""
    from types import SimpleNamespace

    from tinydiff.bench.measure import measure
    from tinydiff.fast.compiled import compiled
    models = {"target": compiled(tiny_model, (), compile=False), "draft": compiled(tiny_model, (), compile=False)}
    calls = []

    def method(models, prompt, args, generator):  # one round of 2 drafts per prompt; the 3rd call compiles
        calls.append(prompt)
        late = len(calls) == 3
        if late:
            models["target"].compiled_step.compile_seconds += 0.5
            models["draft"].compiled_step.compile_seconds += 0.25
        return {"new_tokens": 3, "target_forwards": 1, "proposed": 2, "accepted": [0, 0, 1],
                "slot_judged": [1, 1], "slot_kept": [1, 1], "seconds": 1.0 + 0.75 * late,
                "draft_seconds": 0.25 + 0.25 * late, "verify_seconds": 0.5 + 0.5 * late}

    row = measure(method, models, [[1], [2], [3], [4]], SimpleNamespace(device="cpu", seed=0))
    assert len(calls) == 5  # one warm-up prompt (it compiled nothing), then the four timed
    assert row["tokens_per_s"] == 12 / 4.0
    assert row["us_per_round"] == {"draft": 0.25e6, "verify": 0.5e6, "host": 0.25e6}


@pytest.mark.parametrize("method", ["ar", "spec-k2", "spec-k2-fr", "spec-k4-fused", "dflash-b8", "dflash-b16-reject",
                                    "dflash-b16-fused", "ddtree-n8"])
def test_bench_compile_runs_every_row_on_its_own_loop_or_a_fused_round(tiny_model, method):
    """With --compile (here with the graphs run eagerly: compile mode False) each row runs its own loop on
    compiled steps (fast/compiled.py), and a -fused row (or FR-Spec's -fr rows) each round as one graph
    (fused_round.py, fused_dflash.py): the same rounds as the eager rows; a fused spec round reads the prompt
    in one more target forward (a compiled chunk), and times its graphs."""
    from types import SimpleNamespace

    from tinydiff.bench.methods import METHODS, compiled_models
    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    from tinydiff.fast.frequent_vocab import FrequentVocabDraft
    torch.manual_seed(3)
    models = {"target": tiny_model, "draft": tiny_model,
              "draft_fr": FrequentVocabDraft(tiny_model, torch.arange(0, 50000, 50)),
              "drafter": DFlashDrafter(DFlashConfig.for_target(tiny_model.config, block_size=16), tiny_model)}
    args = SimpleNamespace(compile=False, new_tokens=12, temperature=1.0)
    fast = compiled_models(method, models, args)
    fused = method.endswith(("-fused", "-fr"))
    assert ("fused" in fast) == fused
    prompt = [EOT, 3, 4]
    plain = METHODS[method](models, prompt, args, torch.Generator().manual_seed(0))
    ours = METHODS[method](fast, prompt, args, torch.Generator().manual_seed(0))
    assert ours["new_tokens"] == plain["new_tokens"] == 12 and ours.get("accepted") == plain.get("accepted")
    assert ours["target_forwards"] == plain["target_forwards"] + (fused and method.startswith("spec"))
    assert not fused or 0 < ours["graph_seconds"] < ours["seconds"]  # each round one graph, timed


def test_bench_ar_steps_rows_decode_their_steps_a_call(tiny_model):
    """An ar-steps<S> row decodes S tokens a graph call (fused_steps.py), compiled or not: every call runs
    all S forwards, the prompt's are read apart. Compiled, its wrapper is made once for the bench."""
    from types import SimpleNamespace

    from tinydiff.bench.methods import METHODS, compiled_models
    args = SimpleNamespace(compile=False, new_tokens=12, temperature=1.0)
    prompt = [EOT, 3, 4]
    ar = METHODS["ar"]({"target": tiny_model}, prompt, args, torch.Generator().manual_seed(0))
    for models in ({"target": tiny_model}, compiled_models("ar-steps8", {"target": tiny_model}, args)):
        row = METHODS["ar-steps8"](models, prompt, args, torch.Generator().manual_seed(0))
        assert row["new_tokens"] == ar["new_tokens"] == 12
        assert row["target_forwards"] == 1 + 16 and ar["target_forwards"] == 12  # a prompt chunk; two calls of 8
    assert compiled_models("ar-steps4", {"target": tiny_model}, args)["fused"].steps == 4


def test_bench_splits_a_round_run_as_one_graph_into_the_graph_and_the_host():
    """A fused round (fused_round.py) is not split into drafting and verifying: its row gives per round the
    time from the graph's call to its read-back and the host's rest, and no loop costs. A loop that
    clocks nothing gives the whole round."""
    from types import SimpleNamespace

    from tinydiff.bench.measure import measure

    def method(models, prompt, args, generator):  # two rounds a prompt, 0.5 s each, 0.375 s in the graph
        return {"new_tokens": 5, "target_forwards": 2, "proposed": 4, "accepted": [0, 1, 1], "rejected": 1,
                "slot_judged": [2, 1], "slot_kept": [2, 1], "seconds": 1.0, **clocked}

    clocked = {"graph_seconds": 0.75}
    row = measure(method, {}, [[1], [2]], SimpleNamespace(device="cpu", seed=0))
    assert row["us_per_round"] == {"graph": 0.375e6, "host": 0.125e6} and "seconds_per_draft" not in row
    clocked = {}
    row = measure(method, {}, [[1], [2]], SimpleNamespace(device="cpu", seed=0))
    assert row["us_per_round"] == {"in all": 0.5e6}


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
