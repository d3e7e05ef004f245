"""Spec: every graph that `--compile` runs, for every method, meets the conditions under which inductor
captures it as a CUDA graph on a GPU (tests/cuda_graph_rules.py: what they are and how each is found on
a CPU). Each graph writes only inputs with a static address (the caches, marked where steps replay CUDA
graphs), takes only tensors, holds no op CUDA graphs refuse, makes no tensor off its inputs' device,
copies in at each replay nothing as large as a weight or a cache layer, and finds its static inputs at
the same addresses story after story (else it is recorded again). A graph that broke one of them would
still give the right tokens on a GPU, only slower (without its graph, or recording it again); so this
is the test that can see it here.

The wrappers are told they replay CUDA graphs (so the caches are marked static, as on CUDA), and
torch.compile runs dynamo and AOTAutograd up to the graph inductor would receive (no code generation).
Each method decodes two stories greedily and two sampled (a graph each), from a prompt longer than one
prefill chunk, so that the fused loops' chunked prefill graphs are checked too.
"""
import pytest
import torch
from cuda_graph_rules import Recorder, off_device_ops
from eagle_models import random_head
from stats_helpers import perturbed, random_drafter, random_model

from tinydiff import compiled
from tinydiff.ar import ar_generate
from tinydiff.compiled import StaticDrafter, StaticModel, Wrapped, own_frame
from tinydiff.compiled_round import StaticSubsetDraft
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash_decode import dflash_generate
from tinydiff.eagle_decode import eagle_generate
from tinydiff.frequent_vocab import FrequentVocabDraft
from tinydiff.fused_ddtree import FusedDDTree, fused_ddtree_generate
from tinydiff.fused_dflash import FusedDFlash, fused_dflash_generate, static_pair
from tinydiff.fused_round import PREFILL_CHUNK, fused_speculation, fused_speculative_generate
from tinydiff.fused_steps import FusedSteps, multi_step_generate
from tinydiff.model import ModelConfig
from tinydiff.sampler import generate_cached
from tinydiff.speculative import speculative_generate

pytestmark = pytest.mark.compile
PROMPT, NEW = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 12  # longer than one prefill chunk
K, BLOCK, BUDGET, STEPS, CANVAS = 3, 4, 6, 3, 8
CONTEXT, SMALLEST_WIDTH = 40, 16
assert len(PROMPT) > PREFILL_CHUNK + 1


def models():
    target = random_model(ModelConfig(vocab_size=64, context=CONTEXT, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    draft = random_model(ModelConfig(vocab_size=64, context=CONTEXT, n_layer=1, n_head=2, d_model=SMALLEST_WIDTH,
                                     d_ff=32), seed=1)
    mdlm = random_model(ModelConfig(context=CONTEXT, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False), seed=4)
    return {"target": target, "draft": draft, "drafter": random_drafter(target, seed=2, n_layer=1, block_size=BLOCK),
            "head": random_head(target, seed=3), "mdlm": mdlm,
            "draft_fr": FrequentVocabDraft(perturbed(target, seed=5, noise=0.01), [i for i in range(64) if i % 9])}


def decoders(m):
    """Each method's --compile loop as the bench builds it, its wrappers built once (so that every story
    meets the same graphs and cache buffers): name -> decode(temperature, generator)."""
    t, common = m["target"], lambda temperature, g: {"temperature": temperature, "generator": g, "stop_token": None}
    ar, steps = (FusedSteps(StaticModel(t, (PREFILL_CHUNK,)), n) for n in (1, STEPS))
    spec, spec_fused = (StaticModel(t, (K + 1,)), StaticModel(m["draft"], (1, 2))), fused_speculation(t, m["draft"], K)
    fr = StaticModel(t, (K + 1,)), StaticSubsetDraft(m["draft_fr"], K)
    fr_fused = fused_speculation(t, m["draft_fr"], K)
    dflash, ddtree = [(StaticModel(t, (n,)), StaticDrafter(m["drafter"])) for n in (BLOCK, BUDGET + 1)]
    dflash_fused = [FusedDFlash(*static_pair(t, m["drafter"])) for _ in ("match", "reject")]
    ddtree_fused = FusedDDTree(*static_pair(t, m["drafter"]), BUDGET)
    ar_static, eagle, eagle_tree = (StaticModel(t, (n,)) for n in (1, K + 1, BUDGET + 1))
    mdlm = StaticModel(m["mdlm"], (CANVAS, 2 * CANVAS))
    return {
        "ar": lambda T, g: multi_step_generate(ar, PROMPT, NEW, **common(T, g)),
        "ar-steps": lambda T, g: multi_step_generate(steps, PROMPT, NEW, **common(T, g)),
        "ar-static": lambda T, g: ar_generate(ar_static, PROMPT, NEW, **common(T, g)),
        "spec": lambda T, g: speculative_generate(*spec, PROMPT, NEW, K, **common(T, g)),
        "spec-fused": lambda T, g: fused_speculative_generate(spec_fused, PROMPT, NEW, **common(T, g)),
        "spec-fr-round": lambda T, g: speculative_generate(*fr, PROMPT, NEW, K, propose=fr[1].propose, **common(T, g)),
        "spec-fr-fused": lambda T, g: fused_speculative_generate(fr_fused, PROMPT, NEW, **common(T, g)),
        "dflash": lambda T, g: dflash_generate(*dflash, PROMPT, NEW, **common(T, g)),
        "dflash-fused": lambda T, g: fused_dflash_generate(dflash_fused[0], PROMPT, NEW, **common(T, g)),
        "dflash-fused-reject": lambda T, g: fused_dflash_generate(dflash_fused[1], PROMPT, NEW, rule="reject",
                                                                  **common(T, g)),
        "ddtree": lambda T, g: ddtree_generate(*ddtree, PROMPT, NEW, budget=BUDGET, **common(T, g)),
        "ddtree-fused": lambda T, g: fused_ddtree_generate(ddtree_fused, PROMPT, NEW, **common(T, g)),
        "eagle3": lambda T, g: eagle_generate(eagle, m["head"], PROMPT, NEW, k=K, **common(T, g)),
        "eagle3-tree": lambda T, g: eagle_generate(eagle_tree, m["head"], PROMPT, NEW, budget=BUDGET, **common(T, g)),
        "diffusion-cached": lambda T, g: generate_cached(mdlm, PROMPT, 2 * CANVAS, 2 * CANVAS, CANVAS, T, generator=g),
    }


METHODS = ["ar", "ar-steps", "ar-static", "spec", "spec-fused", "spec-fr-round", "spec-fr-fused", "dflash",
           "dflash-fused", "dflash-fused-reject", "ddtree", "ddtree-fused", "eagle3", "eagle3-tree", "diffusion-cached"]


@pytest.fixture(scope="module")
def traced():
    """For each method: the GraphFacts of every graph it compiled, and the first call of each graph."""
    recorder, found = Recorder(), {}

    def compile_step(fn, device, mode="default"):  # compiled.compile_step, tracing instead of compiling
        graph = torch.compile(own_frame(fn), fullgraph=True, dynamic=False, backend=recorder.backend)

        def step(*args):
            before = len(recorder.graphs)
            out = graph(*args)
            if len(recorder.graphs) > before:  # this call traced a new graph
                calls.append((fn, args))
            return out
        return step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "compile_step", compile_step)
        patch.setattr(Wrapped, "replays_cuda_graphs", lambda self, weight: True)
        patch.setattr(torch._dynamo.config, "recompile_limit", max(torch._dynamo.config.recompile_limit, 64))
        methods = decoders(models())
        assert list(methods) == METHODS
        for name, decode in methods.items():
            start, calls = len(recorder.graphs), []
            for temperature in (0.0, 1.0):
                for story in (1, 2):
                    recorder.story = story
                    decode(temperature, torch.Generator().manual_seed(story))
            found[name] = (recorder.graphs[start:], calls)
    return found


@pytest.mark.parametrize("method", METHODS)
def test_every_graph_would_be_captured(traced, method):
    graphs, calls = traced[method]
    assert graphs and len(graphs) == len(calls), "every method compiles graphs, each traced once"
    for facts in graphs:
        assert facts.refusals() == [], method


@pytest.mark.parametrize("method", METHODS)
def test_static_inputs_stay_where_they_were_story_after_story(traced, method):
    """A graph tree records a graph again whenever a static input moves, and keeps every recording: caches
    made anew for each story would record every graph once a story. Every call of every graph finds its
    static inputs (weights, cache buffers) where its first call found them, and some graph of each method
    serves both stories."""
    graphs = traced[method][0]
    assert any({story for story, _ in facts.calls} == {1, 2} for facts in graphs), method
    for facts in graphs:
        assert len({addresses for _, addresses in facts.calls}) == 1, method


@pytest.mark.parametrize("method", METHODS)
def test_a_replay_copies_in_no_weight_or_cache(traced, method):
    """Each input a replay copies (tokens, positions, a mask over the cache, uniforms) is smaller than the
    keys of one layer of the smallest cache (context x width float32s), hence than any cache buffer, and
    than any weight matrix here but the smallest."""
    for facts in traced[method][0]:
        assert max(facts.copied_bytes, default=0) < CONTEXT * SMALLEST_WIDTH * 4, method


@pytest.mark.parametrize("method", METHODS)
def test_no_graph_makes_a_tensor_off_its_inputs_device(traced, method):
    for fn, args in traced[method][1]:
        off, ops = off_device_ops(fn, args)
        assert ops > 10 and off == [], method  # ops: the step really ran on meta


def test_the_rules_see_what_they_look_for():
    """Each check fails on the mistake it is there for, and passes the same step written right."""
    recorder, weight = Recorder(), torch.randn(32, 32)
    marked, plain = torch.zeros(4, 8), torch.zeros(4, 8)
    torch._dynamo.mark_static_address(marked)

    def write(buffer, x):  # a cache write at a device-tensor row
        return buffer.index_copy_(0, torch.tensor([1], device=x.device), x)

    def masked(x):  # a boolean-mask assignment: an index_put whose indices come from data
        x = x.clone()
        x[x > 0] = 0
        return x

    for fn, args in [(write, (marked, torch.ones(1, 8))), (write, (plain, torch.ones(1, 8))), (masked, (plain,)),
                     (lambda x: x @ weight, (torch.ones(2, 32),))]:
        torch.compile(own_frame(fn), fullgraph=True, dynamic=False, backend=recorder.backend)(*args)
    right, mutated, incompatible, closure = recorder.graphs
    assert right.refusals() == [] and mutated.mutated_not_static and incompatible.incompatible
    moved = torch.zeros(4, 8)  # a cache made anew: the same graph, a static input at a new address
    torch._dynamo.mark_static_address(moved)
    graph = torch.compile(own_frame(write), fullgraph=True, dynamic=False, backend=recorder.backend)
    for buffer in (marked, moved):
        graph(buffer, torch.ones(1, 8))
    assert len({addresses for _, addresses in recorder.graphs[-1].calls}) == 2
    assert max(closure.copied_bytes) == weight.numel() * 4  # a weight held in a closure is copied in
    made_on_cpu = lambda x: x + torch.ones(8)  # noqa: E731  (no device=: the CPU's)
    assert off_device_ops(made_on_cpu, (torch.zeros(8),))[0] and not off_device_ops(write, (plain, plain[:1]))[0]
