"""Spec, on a CUDA GPU only (skipped elsewhere; scripts/gpu_check.sh runs it first): the compiled loops
the bench times replay CUDA graphs. For each, on the same wrappers, three greedy stories commit the eager
loop's tokens; inductor runs no graph without its CUDA graph (counters["inductor"]["cudagraph_skips"]);
and the third story records no graph again: the first call of a graph warms it up, the second records
it, and every later one replays it, unless a static input moved (a cache made anew) or inductor found
another reason (the graph trees' node count grows). On a CPU, tests/test_cuda_graph_rules.py checks
the conditions these rest on without a GPU.

The loops and models are tests/compiled_loops.py's, in float64 (as tests/test_compiled.py: the padded
attention moves a logit only by float64 rounding). One sampled story of the fused `ar` loop runs too:
its draws are made before the graph and rewound after it on CUDA's generator.
"""
import pytest
import torch
from compiled_loops import compiled_loops, eager_loops, models

pytestmark = [pytest.mark.compile, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# the loops the bench times with --compile, the goals' first (gpu_check.sh's time limit may cut the last)
TIMED = ["ar", "dflash-fused", "ddtree-fused", "spec-fused", "ar-steps", "dflash", "ddtree"]


def recordings() -> int:
    """CUDA graphs recorded so far on this device: the nodes of inductor's graph trees."""
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    nodes = [] if manager is None else [node for roots in manager.roots.values() for node in roots]
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes += [child for children in node.children.values() for child in children]
    return count


@pytest.fixture(scope="module")
def loops():
    m = models("cuda", torch.float64)
    return compiled_loops(m), eager_loops(m)


@pytest.mark.parametrize("method", TIMED)
def test_compiled_loops_replay_cuda_graphs(loops, method):
    from torch._dynamo.utils import counters
    compiled, eager = loops
    skips = counters["inductor"]["cudagraph_skips"]
    expected = eager[method](0.0, None)[0]
    seen = []
    for _ in range(3):
        assert compiled[method].decode(0.0, None)[0] == expected, method
        seen.append(recordings())
    assert counters["inductor"]["cudagraph_skips"] == skips, "a graph ran without its CUDA graph (TORCH_LOGS=cudagraphs)"
    assert seen[0] > 0 and seen[2] == seen[1], f"CUDA graphs recorded after each story: {seen}"


def test_a_sampled_story_replays_too(loops):
    """At T = 1 the fused ar loop draws before each graph and rewinds CUDA's generator after a stop."""
    compiled, _ = loops
    before, counts = recordings(), []
    for seed in range(3):
        tokens = compiled["ar"].decode(1.0, torch.Generator("cuda").manual_seed(seed))[0]
        assert len(tokens) > 0 and all(0 <= t < 64 for t in tokens)
        counts.append(recordings())
    assert counts[2] == counts[1] >= before, f"CUDA graphs recorded after each story: {counts}"
