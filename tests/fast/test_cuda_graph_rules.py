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
    """traced(method): the GraphFacts of every graph the method compiled, and the first call of each graph.
    Each method is traced when a test first asks for it, so a worker traces only its own methods."""
    import torch._dynamo  # its config exists once it is imported; here, not at the top (conftest.py says why)
    recorder, found, calls = Recorder(), {}, []

    def compile_step(fn, device, mode="default"):  # compiled.compile_step, tracing instead of compiling
        graph = recorder.compile(fn)

        def step(*args, **kwargs):
            before = len(recorder.graphs)
            out = graph(*args, **kwargs)
            if len(recorder.graphs) > before:  # this call traced a new graph
                calls.append((fn, args))
            return out
        return step

    def trace(method):
        if method not in found:
            decode, _ = loops[method]
            start, calls[:] = len(recorder.graphs), []
            for temperature in (0.0, 1.0):
                for story in (1, 2):
                    recorder.story = story
                    decode(temperature, torch.Generator().manual_seed(story))
            found[method] = (recorder.graphs[start:], list(calls))
        return found[method]

    # torch's own patch for its config: pytest >= 9.2's monkeypatch deletes a config entry on undo, and
    # every later compile in the process then fails ("recompile_limit does not exist")
    limit = torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 64))
    with pytest.MonkeyPatch.context() as patch, limit:
        patch.setattr(compiled, "compile_step", compile_step)
        patch.setattr(compiled, "replays_cuda_graphs", lambda step, weight: True)
        loops = compiled_loops(models())
        yield trace


@pytest.mark.parametrize("method", METHODS)
def test_every_graph_would_be_captured_and_replayed_where_it_was_recorded(traced, method):
    """One test a method, so that one worker traces it. Every graph the method compiles:"""
    graphs, calls = traced(method)
    assert graphs and len(graphs) == len(calls), "every method compiles graphs, each traced once"
    # 1. would be captured: no refusal
    for facts in graphs:
        assert facts.refusals() == [], method

    # 2. finds its static inputs where it found them. A graph tree records a graph again whenever a static
    # input moves, and keeps every recording: caches made anew for each story would record every graph once a
    # story. Every call of every graph finds its static inputs (weights, cache buffers) where its first call
    # found them, and some graph of each method serves both stories.
    assert any({story for story, _ in facts.calls} == {1, 2} for facts in graphs), method
    for facts in graphs:
        assert len({addresses for _, addresses in facts.calls}) == 1, method

    # 3. copies in no weight or cache at a replay: each input a replay copies (tokens, positions, a mask over
    # the cache, uniforms) is smaller than the keys of one layer of the smallest cache (context x width
    # float32s), hence than any cache buffer, and than any weight matrix here but the smallest.
    for facts in graphs:
        assert max(facts.copied_bytes, default=0) < CONTEXT * SMALLEST_WIDTH * 4, method

    # 4. makes no tensor off its inputs' device
    for fn, args in calls:
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
