"""Every method's `--compile` loop as the bench and generate.py build it, and its eager twin, on small
random models: shared by tests/test_cuda_graph_rules.py (the CUDA-graph conditions, on a CPU) and
tests/test_cuda_graphs.py (the same loops replaying CUDA graphs, on a GPU). Not a test file.

The compiled loops' wrappers are built once per method (`compiled_loops`), so every story meets the same
graphs and, where steps replay CUDA graphs, the same cache buffers. The prompt is longer than one
prefill chunk, so the fused loops' chunked prefill graphs run too.
"""
import torch
from eagle_models import random_head
from stats_helpers import perturbed, random_drafter, random_model

from tinydiff.ar import ar_generate
from tinydiff.compiled import StaticDrafter, StaticModel
from tinydiff.compiled_round import StaticSubsetDraft
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash_decode import dflash_generate
from tinydiff.eagle_decode import eagle_generate
from tinydiff.frequent_vocab import FrequentVocabDraft, subset_draft_round
from tinydiff.fused_ddtree import FusedDDTree, fused_ddtree_generate
from tinydiff.fused_dflash import FusedDFlash, fused_dflash_generate, static_pair
from tinydiff.fused_round import PREFILL_CHUNK, fused_speculation, fused_speculative_generate
from tinydiff.fused_steps import FusedSteps, multi_step_generate
from tinydiff.model import ModelConfig
from tinydiff.sampler import generate_cached
from tinydiff.speculative import speculative_generate

PROMPT, NEW = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 12  # longer than one prefill chunk
K, BLOCK, BUDGET, STEPS, CANVAS = 3, 4, 6, 3, 8  # drafts a round, DFlash block, tree nodes, AR steps a graph
CONTEXT, SMALLEST_WIDTH = 40, 16
METHODS = ["ar", "ar-steps", "ar-static", "spec", "spec-fused", "spec-fr-round", "spec-fr-fused", "dflash",
           "dflash-fused", "dflash-fused-reject", "ddtree", "ddtree-fused", "eagle3", "eagle3-tree", "diffusion-cached"]
assert len(PROMPT) > PREFILL_CHUNK + 1


def models(device="cpu", dtype=torch.float32) -> dict:
    """The target, a plain draft, FR-Spec's pruned draft, a DFlash drafter, an EAGLE-3 head and an MDLM."""
    target = random_model(ModelConfig(vocab_size=64, context=CONTEXT, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    draft = random_model(ModelConfig(vocab_size=64, context=CONTEXT, n_layer=1, n_head=2, d_model=SMALLEST_WIDTH,
                                     d_ff=32), seed=1)
    mdlm = random_model(ModelConfig(context=CONTEXT, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False), seed=4)
    found = {"target": target, "draft": draft, "drafter": random_drafter(target, seed=2, n_layer=1, block_size=BLOCK),
             "head": random_head(target, seed=3), "mdlm": mdlm,
             "draft_fr": FrequentVocabDraft(perturbed(target, seed=5, noise=0.01), [i for i in range(64) if i % 9])}
    return {role: model.to(device, dtype) for role, model in found.items()}  # in place: borrowed targets follow


def common(temperature, generator) -> dict:
    return {"temperature": temperature, "generator": generator, "stop_token": None}


def compiled_loops(m) -> dict:
    """Each method's compiled loop: name -> decode(temperature, generator) -> (tokens, stats)."""
    t = m["target"]
    ar, steps = (FusedSteps(StaticModel(t, (PREFILL_CHUNK,)), n) for n in (1, STEPS))
    spec, spec_fused = (StaticModel(t, (K + 1,)), StaticModel(m["draft"], (1, 2))), fused_speculation(t, m["draft"], K)
    fr = StaticModel(t, (K + 1,)), StaticSubsetDraft(m["draft_fr"], K)
    fr_fused = fused_speculation(t, m["draft_fr"], K)
    dflash, ddtree = [(StaticModel(t, (n,)), StaticDrafter(m["drafter"])) for n in (BLOCK, BUDGET + 1)]
    dflash_fused = [FusedDFlash(*static_pair(t, m["drafter"])) for _ in ("match", "reject")]
    ddtree_fused = FusedDDTree(*static_pair(t, m["drafter"]), BUDGET)
    ar_static, eagle, eagle_tree = (StaticModel(t, (n,)) for n in (1, K + 1, BUDGET + 1))
    mdlm = StaticModel(m["mdlm"], (CANVAS, 2 * CANVAS))
    loops = {
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
    assert list(loops) == METHODS
    return loops


def eager_loops(m) -> dict:
    """Each method's eager twin, the loop its compiled one must match: name -> decode(temperature, generator)."""
    t, draft, drafter, head = m["target"], m["draft"], m["drafter"], m["head"]
    ar = lambda T, g: ar_generate(t, PROMPT, NEW, **common(T, g))  # noqa: E731
    spec = lambda T, g: speculative_generate(t, draft, PROMPT, NEW, K, **common(T, g))  # noqa: E731
    fr = lambda T, g: speculative_generate(t, m["draft_fr"], PROMPT, NEW, K, propose=subset_draft_round,  # noqa: E731
                                           **common(T, g))
    dflash = lambda T, g: dflash_generate(t, drafter, PROMPT, NEW, **common(T, g))  # noqa: E731
    ddtree = lambda T, g: ddtree_generate(t, drafter, PROMPT, NEW, budget=BUDGET, **common(T, g))  # noqa: E731
    loops = {"ar": ar, "ar-steps": ar, "ar-static": ar, "spec": spec, "spec-fused": spec, "spec-fr-round": fr,
             "spec-fr-fused": fr, "dflash": dflash, "dflash-fused": dflash,
             "dflash-fused-reject": lambda T, g: dflash_generate(t, drafter, PROMPT, NEW, rule="reject", **common(T, g)),
             "ddtree": ddtree, "ddtree-fused": ddtree,
             "eagle3": lambda T, g: eagle_generate(t, head, PROMPT, NEW, k=K, **common(T, g)),
             "eagle3-tree": lambda T, g: eagle_generate(t, head, PROMPT, NEW, budget=BUDGET, **common(T, g)),
             "diffusion-cached": lambda T, g: generate_cached(m["mdlm"], PROMPT, 2 * CANVAS, 2 * CANVAS, CANVAS, T,
                                                              generator=g)}
    assert list(loops) == METHODS
    return loops
