"""Spec: every graph that `--compile` runs, for every method, meets the conditions under which inductor
captures it as a CUDA graph on a GPU (tests/cuda_graph_rules.py: what they are and how each is found on
a CPU). Each graph writes only inputs with a static address (the caches, marked where steps replay CUDA
graphs), takes only tensors, holds no op CUDA graphs refuse, makes no tensor off its inputs' device,
copies in at each replay nothing as large as a weight or a cache layer, and finds its static inputs at
the same addresses story after story (else it is recorded again). A graph that broke one of them would
still give the right tokens on a GPU, only slower (without its graph, or recording it again); so this
is the test that can see it here.

The loops are tests/compiled_loops.py's. The wrappers are told they replay CUDA graphs (so the caches
are marked static, as on CUDA), and torch.compile runs dynamo and AOTAutograd up to the graph inductor
would receive (no code generation). Each method decodes two stories greedily and two sampled (a graph
each). tests/test_cuda_graphs.py runs the same loops on a GPU, where the graphs are CUDA's.
"""
import pytest
import torch
from compiled_loops import CONTEXT, METHODS, SMALLEST_WIDTH, compiled_loops, models
from cuda_graph_rules import Recorder, off_device_ops

from tinydiff.fast import compiled

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def traced():
    """For each method: the GraphFacts of every graph it compiled, and the first call of each graph."""
    import torch._dynamo  # its config exists once it is imported; here, not at the top (conftest.py says why)
    recorder, found = Recorder(), {}

    def compile_step(fn, device, mode="default"):  # compiled.compile_step, tracing instead of compiling
        graph = recorder.compile(fn)

        def step(*args, **kwargs):
            before = len(recorder.graphs)
            out = graph(*args, **kwargs)
            if len(recorder.graphs) > before:  # this call traced a new graph
                calls.append((fn, args))
            return out
        return step

    # torch's own patch for its config: pytest >= 9.2's monkeypatch deletes a config entry on undo, and
    # every later compile in the process then fails ("recompile_limit does not exist")
    limit = torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64))
    with pytest.MonkeyPatch.context() as patch, limit:
        patch.setattr(compiled, "compile_step", compile_step)
        patch.setattr(compiled, "replays_cuda_graphs", lambda step, weight: True)
        for name, (decode, _) in compiled_loops(models()).items():
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
        recorder.compile(fn)(*args)
    right, mutated, incompatible, closure = recorder.graphs
    assert right.refusals() == [] and mutated.mutated_not_static and incompatible.incompatible
    moved = torch.zeros(4, 8)  # a cache made anew: the same graph, a static input at a new address
    torch._dynamo.mark_static_address(moved)
    graph = recorder.compile(write)
    for buffer in (marked, moved):
        graph(buffer, torch.ones(1, 8))
    assert len({addresses for _, addresses in recorder.graphs[-1].calls}) == 2
    assert max(closure.copied_bytes) == weight.numel() * 4  # a weight held in a closure is copied in
    made_on_cpu = lambda x: x + torch.ones(8)  # noqa: E731  (no device=: the CPU's)
    assert off_device_ops(made_on_cpu, (torch.zeros(8),))[0] and not off_device_ops(write, (plain, plain[:1]))[0]
