"""Spec: compiled decoding (tinydiff/fast/compiled.py) decodes exactly as the eager loops do.

Every method of the library run on models whose steps are compiled (compiled.compiled; and
fused_round.py's graph of a whole speculative round, fused_steps.py's of one or several AR steps,
fused_dflash.py's of a DFlash round), each hot step compiled by inductor with fullgraph=True (a graph
break is an error), gives the eager loop's tokens at temperature 0 and its samples with the same seed at temperature 1;
after every round the static caches hold the eager caches' rows; the hot steps really ran compiled;
misuse is a one-line error. One test a method checks all of it, so that one worker compiles that method's
graphs. The models are float64, so the padded attention (all rows read, the rest masked) can move a logit
only by float64 rounding, far below any argmax or sampling boundary. Compiling is the slow part
(seconds per shape), so the compiled models are built once for the module and every test shares them.
"""
import pytest
import torch
from eagle_models import random_head
from stats_helpers import EXACT, assert_same, float64, perturbed, random_drafter, random_model

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash import dflash_generate
from tinydiff.eagle3 import eagle_generate
from tinydiff.extras.dflash_reject import dflash_reject_generate
from tinydiff.fast import compiled as fast
from tinydiff.fast.compiled import compile_all, compile_step, compiled, inductor_settings
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, every_id, subset_draft_round
from tinydiff.fast.fused_dflash import FusedDFlash, fused_dflash_generate
from tinydiff.fast.fused_round import PREFILL_CHUNK, FusedSpeculation, fused_speculative_generate
from tinydiff.fast.fused_steps import FusedSteps, multi_step_generate
from tinydiff.model import KVCache, ModelConfig
from tinydiff.sampler import generate_cached
from tinydiff.speculative import speculative_generate

pytestmark = pytest.mark.compile
PROMPT, NEW = [3, 1, 4, 1, 5], 16
# Spec drafts, DFlash block, DDTree nodes, EAGLE drafts, diffusion block: K + 1 = BLOCK = EAGLE_K + 1
# makes one verify shape for three methods (one compile). STEPS: AR tokens per graph (fused_steps.py),
# not a divisor of NEW, so a story's last call keeps fewer than it draws.
K, BLOCK, BUDGET, EAGLE_K, CANVAS, STEPS = 3, 4, 6, 3, 8, 3


@pytest.fixture(scope="module")
def eager():
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    draft = random_model(ModelConfig(vocab_size=64, context=40, n_layer=1, n_head=2, d_model=16, d_ff=32), seed=1)
    drafter = random_drafter(target, seed=2, n_layer=1, block_size=BLOCK, n_features=1)
    head = random_head(target, seed=3)
    mdlm = random_model(ModelConfig(context=40, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False), seed=4)
    target, drafter, head = float64(target, drafter, head)
    (draft,), (mdlm,) = float64(draft), float64(mdlm)
    # FR-Spec: the target's ids outside the subset come by the residual. A draft close to the target, so
    # that some rounds accept every draft and the next reads two tokens.
    draft_fr = FrequentVocabDraft(perturbed(target, seed=5, noise=0.01), [i for i in range(64) if i % 9])
    return {"target": target, "draft": draft, "draft_fr": draft_fr, "drafter": drafter, "head": head, "mdlm": mdlm}


@pytest.fixture(scope="module")
def static(eager):
    models = {"target": compiled(eager["target"], hot=(1, K + 1, BLOCK, BUDGET + 1, EAGLE_K + 1, PREFILL_CHUNK)),
              "draft": compiled(eager["draft"], hot=(1,)),
              "draft_fr": FrequentVocabDraft(compiled(eager["draft_fr"].draft, hot=(1,)), eager["draft_fr"].ids),
              "drafter": compiled(eager["drafter"], (BLOCK,)),
              "head": eager["head"],  # the head's few tiny forwards stay eager
              "mdlm": compiled(eager["mdlm"], hot=(CANVAS,))}
    # The fused graphs read the prompt and run a story's short last rounds on the compiled models above.
    return {**models, "ar_fused": FusedSteps(eager["target"], 1), "ar_steps": FusedSteps(eager["target"], STEPS),
            "spec_fused": FusedSpeculation(models["target"], eager["target"], eager["draft_fr"], K),
            "spec_plain_fused": FusedSpeculation(models["target"], eager["target"], every_id(eager["draft"]), K),
            "dflash_fused": FusedDFlash(eager["target"], eager["drafter"])}


def decode(method, models, temperature, on_round=None):
    """One method's tokens after PROMPT, seeded; methods with rounds pass on_round."""
    g = torch.Generator().manual_seed(7)
    t, common = models["target"], {"temperature": temperature, "generator": g, "stop_token": None}
    if method == "ar":
        return ar_generate(t, PROMPT, NEW, **common)[0]
    if method == "ar-fused":  # eagerly: plain ar_generate
        return multi_step_generate(models["ar_fused"], PROMPT, NEW, **common)[0] if "ar_fused" in models \
            else ar_generate(t, PROMPT, NEW, **common)[0]
    if method == "ar-steps":  # eagerly: plain ar_generate
        return multi_step_generate(models["ar_steps"], PROMPT, NEW, **common)[0] if "ar_steps" in models \
            else ar_generate(t, PROMPT, NEW, **common)[0]
    if method == "spec-fr-fused" and "spec_fused" in models:
        return fused_speculative_generate(models["spec_fused"], PROMPT, NEW, on_round=on_round, **common)[0]
    if method == "spec-fr-fused":  # eagerly: the plain pruned draft and its eager round
        method = "spec-fr"
    if method == "spec-fused" and "spec_plain_fused" in models:  # the plain draft as the subset of every id
        return fused_speculative_generate(models["spec_plain_fused"], PROMPT, NEW, on_round=on_round, **common)[0]
    if method == "spec-fused":  # eagerly: the plain draft and draft_round
        method = "spec"
    if method == "spec":
        return speculative_generate(t, models["draft"], PROMPT, NEW, K, on_round=on_round, **common)[0]
    if method == "spec-fr":
        return speculative_generate(t, models["draft_fr"], PROMPT, NEW, K, on_round=on_round,
                                    propose=subset_draft_round, **common)[0]
    if method.startswith("dflash-fused") and "dflash_fused" in models:
        rule = "reject" if method.endswith("reject") else "match"
        return fused_dflash_generate(models["dflash_fused"], PROMPT, NEW, on_round=on_round, rule=rule, **common)[0]
    if method == "dflash-fused-reject":  # eagerly: the rejection rule (extras/dflash_reject.py)
        return dflash_reject_generate(t, models["drafter"], PROMPT, NEW, on_round=on_round, rule="reject",
                                      **common)[0]
    if method in ("dflash", "dflash-fused"):
        return dflash_generate(t, models["drafter"], PROMPT, NEW, on_round=on_round, **common)[0]
    if method == "ddtree":
        return ddtree_generate(t, models["drafter"], PROMPT, NEW, budget=BUDGET, on_round=on_round, **common)[0]
    if method == "eagle3":
        return eagle_generate(t, models["head"], PROMPT, NEW, k=EAGLE_K, on_round=on_round, **common)[0]
    assert method == "diffusion-cached"
    return generate_cached(models["mdlm"], PROMPT, 2 * CANVAS, 2 * CANVAS, CANVAS, temperature, generator=g)[0]


METHODS = ["ar", "ar-fused", "ar-steps", "spec", "spec-fused", "spec-fr", "spec-fr-fused", "dflash",
           "dflash-fused", "dflash-fused-reject", "ddtree", "eagle3", "diffusion-cached"]


ROUNDS = ["spec", "spec-fused", "spec-fr", "spec-fr-fused", "dflash", "dflash-fused", "ddtree", "eagle3"]


def shapes(model) -> set:
    """The token counts a compiled model's step compiled (its keys start with idx.shape)."""
    return {key[0][1] for key in model.compiled_step.seen}


# What each method's decoding must have run compiled: its hot steps, or its one-graph round or steps.
RAN_COMPILED = {
    "ar": lambda s: 1 in shapes(s["target"]),
    # fused_steps.py's graph of one step and of STEPS steps; ar-fused's model read the prompt, chunked
    "ar-fused": lambda s: (0.0, None, None) in s["ar_fused"].call.seen and PREFILL_CHUNK in shapes(s["ar_fused"].model),
    "ar-steps": lambda s: (0.0, None, None) in s["ar_steps"].call.seen,
    "spec": lambda s: K + 1 in shapes(s["target"]) and shapes(s["draft"]) == {1},
    # the whole round as one graph, of one shape: the draft reads its newest two tokens every round
    "spec-fused": lambda s: {key[0] for key in s["spec_plain_fused"].round.seen} == {2},
    "spec-fr": lambda s: K + 1 in shapes(s["target"]) and shapes(s["draft_fr"].draft) == {1},
    "spec-fr-fused": lambda s: {key[0] for key in s["spec_fused"].round.seen} == {2},
    "dflash": lambda s: BLOCK in shapes(s["target"]) and s["drafter"].compiled_step.seen == {BLOCK},
    "dflash-fused": lambda s: (BLOCK, "match") in {key[:2] for key in s["dflash_fused"].round.seen},
    "dflash-fused-reject": lambda s: (BLOCK, "reject") in {key[:2] for key in s["dflash_fused"].round.seen},
    "ddtree": lambda s: BUDGET + 1 in shapes(s["target"]) and s["drafter"].compiled_step.seen == {BLOCK},
    "eagle3": lambda s: EAGLE_K + 1 in shapes(s["target"]),
    "diffusion-cached": lambda s: CANVAS in shapes(s["mdlm"]),
}


@pytest.mark.parametrize("method", METHODS)
def test_compiled_decoding_gives_the_eager_tokens_and_cache_rows_and_ran_its_hot_steps_compiled(eager, static,
                                                                                               method):
    """One test a method, so that one worker compiles the method's graphs (compiling is this file's time)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    for temperature in (0.0, 1.0):  # at 1, the same seed gives the same samples
        assert decode(method, static, temperature) == decode(method, eager, temperature), temperature

    if method in ROUNDS:  # after every round the static caches hold the eager caches' rows
        def record(into):
            def on_round(info):
                caches = [info[name] for name in ("target_cache", "draft_cache") if name in info]
                into.append([(c.length, [t[:, :, :c.length].clone() for t in c.k + c.v]) for c in caches])
            return on_round

        ours, theirs = [], []
        decode(method, static, 1.0, record(ours))
        decode(method, eager, 1.0, record(theirs))
        assert len(ours) == len(theirs) > 1
        for round_ours, round_theirs in zip(ours, theirs):
            for (n, rows), (m, reference) in zip(round_ours, round_theirs):
                assert n == m
                for a, b in zip(rows, reference):
                    assert_same(a, b, EXACT)

    # The hot steps ran compiled, a step that compiled booked its seconds (one that did not, none), and each
    # step keeps its graphs apart. Dynamo keeps graphs per code object: shared by every compiled model, a
    # model's first step would be a recompile judged by the other models' guards (torch 2.13 raised IndexError
    # on a model with fewer layers), and every step would test them all. Each step holds its own shapes, no more.
    assert RAN_COMPILED[method](static), method
    fused = [static["ar_fused"].call, static["ar_steps"].call] + \
        [static[name].round for name in ("spec_fused", "spec_plain_fused", "dflash_fused")]
    steps = [m.compiled_step for m in static.values() if hasattr(m, "compiled_step")] + \
        [static[name].draft.draft.compiled_step for name in ("spec_fused", "spec_plain_fused")] + \
        [static["draft_fr"].draft.compiled_step] + fused
    for step in steps:
        assert (step.compile_seconds > 0) == bool(step.seen)
        assert len(_debug_get_cache_entry_list(step.compiled._torchdynamo_orig_callable.__code__)) == len(step.seen)


def test_a_hot_step_compiles_once_whatever_the_prompt(eager, static):
    from torch._dynamo.utils import counters  # here, not at import: see conftest.pytest_collection_modifyitems
    # Each prompt length gives the canvas other strides and the cache other lengths: none may be a
    # new graph (one was, once: a slice of the canvas passed its strides to the step).
    for prompt in (PROMPT, PROMPT[:2], PROMPT * 3):
        generate_cached(static["mdlm"], prompt, 2 * CANVAS, 2 * CANVAS, CANVAS, 0.0)
        speculative_generate(static["target"], static["draft"], prompt, NEW, K, 0.0)
        if prompt is PROMPT:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_misuse_is_a_one_line_error(eager, static, monkeypatch):
    cache = static["target"].new_cache(1)
    assert isinstance(cache, KVCache)  # model.py's own: static from the start
    cache.advance(cache.capacity)
    with pytest.raises(UserError, match="exceeds the model's context"):
        static["target"](torch.tensor([[1]]), cache=cache)
    monkeypatch.setattr(fast, "replays_cuda_graphs", lambda step, weight: True)  # one set of buffers
    with pytest.raises(UserError, match="batch_size 1"):
        compiled(eager["target"], (1,), compile=False).new_cache(2)


@pytest.mark.parametrize("method", ["ar", "spec"])
def test_max_autotune_decodes_the_eager_tokens(eager, method):
    # The weights are frozen into the graph and every product autotuned; float64 keeps the BLAS's
    # products (inductor's template is float32), so the tokens must be the eager ones exactly.
    models = compile_all({"target": eager["target"], "draft": eager["draft"]}, {"target": (1, K + 1), "draft": (1,)},
                         "max-autotune")
    for temperature in (0.0, 1.0):
        assert decode(method, models, temperature) == decode(method, eager, temperature)
    assert (1 if method == "ar" else K + 1) in {key[0][1] for key in models["target"].compiled_step.seen}  # compiled


@pytest.mark.parametrize("rows", [1, 3])
def test_inductors_own_matmul_stays_within_float32_rounding(rows):
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code
    # max-autotune may pick inductor's C++ GEMM template for the head; force it here and hold it to
    # the bound every float32 dot product of length D meets in any summation order: the float64
    # product within gamma_D * (|x| @ |W|^T), gamma_D = D u / (1 - D u), u = 2^-24.
    g = torch.Generator().manual_seed(0)
    V, D = 1024, 128
    W = torch.randn(V, D, generator=g)
    x = torch.randn(rows, D, generator=g)
    head = torch.nn.Linear(D, V, bias=False).requires_grad_(False)
    head.weight.copy_(W)
    step = compile_step(lambda x: head(x), "cpu", "max-autotune")
    settings = {**inductor_settings("max-autotune", "cpu")[1], "max_autotune_gemm_backends": "CPP"}
    with torch.no_grad(), inductor_config.patch(settings):
        out, code = run_and_get_code(step, x)
    assert "micro_gemm" in "".join(code)  # the template ran, not the BLAS
    u = 2.0 ** -24
    gamma = D * u / (1 - D * u)
    exact = x.double() @ W.double().T
    assert ((out.double() - exact).abs() <= gamma * (x.double().abs() @ W.double().abs().T)).all()


def test_an_unknown_compile_mode_is_a_one_line_error():
    with pytest.raises(UserError, match="compile mode must be one of default, max-autotune"):
        inductor_settings("fast", "cpu")
    assert inductor_settings("default", "cpu") == ({}, {})
    assert inductor_settings("max-autotune", "cpu")[1]["freezing"]  # the CPU's template needs constant weights


def test_read_back_times_the_call_and_copy_but_not_the_compiling():
    """Compiled.read_back: the call's tensor as a list; read_seconds sums the calls' time without the seconds
    a first call spent compiling (here a call that takes 0.2 s and books them as compiling)."""
    import time

    from tinydiff.fast.compiled import Compiled

    class CompilesOnFirstCall(Compiled):
        def __call__(self, tokens, key, *args):
            if key not in self.seen:
                time.sleep(0.2)
                self.compile_seconds += 0.2
                self.seen.add(key)
            return super().__call__(tokens, key, *args)

    step = CompilesOnFirstCall(lambda x: x + 1, "cpu", (), compile=False)
    assert step.read_back(2, 2, torch.tensor([1, 2])) == [2, 3]
    first = step.read_seconds
    assert 0 <= first < 0.2 and step.compile_seconds == 0.2  # without the subtraction, at least 0.2
    assert step.read_back(2, 2, torch.tensor([5, 6])) == [6, 7] and step.read_seconds > first
