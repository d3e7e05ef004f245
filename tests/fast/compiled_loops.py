"""Every method's `--compile` loop as the bench and generate.py build it (the loop itself on compiled steps,
or a fused round), and its eager twin, on small random models: shared by test_cuda_graph_rules.py (the
CUDA-graph conditions, on a CPU), test_cuda_graphs.py (the same loops replaying CUDA graphs, on a GPU) and
test_cache_buffers.py (the loops uncompiled, on buffers a story left junk in). Not a test file.

The compiled models are built once per method (`compiled_loops`), so every story meets the same graphs and,
where steps replay CUDA graphs, the same cache buffers. The default prompt is longer than one prefill chunk,
so the fused loops' chunked prefill graphs run too.
"""
from typing import Callable, NamedTuple

import torch
from eagle_models import random_head
from stats_helpers import perturbed, random_drafter, random_model

from tinydiff.ar import ar_generate
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash import dflash_generate
from tinydiff.eagle3 import eagle_generate
from tinydiff.extras.dflash_reject import dflash_reject_generate
from tinydiff.fast.compiled import compiled
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, subset_draft_round
from tinydiff.fast.fused_dflash import FusedDFlash, fused_dflash_generate
from tinydiff.fast.fused_round import PREFILL_CHUNK, fused_speculation, fused_speculative_generate
from tinydiff.fast.fused_steps import FusedSteps, multi_step_generate
from tinydiff.model import ModelConfig
from tinydiff.sampler import generate_cached
from tinydiff.speculative import speculative_generate

PROMPT, NEW = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 12  # longer than one prefill chunk
K, BLOCK, BUDGET, STEPS, CANVAS = 3, 4, 6, 3, 8  # drafts a round, DFlash block, tree nodes, AR steps a graph
CONTEXT, SMALLEST_WIDTH = 40, 16
METHODS = ["ar", "ar-steps", "spec", "spec-fused", "spec-fr-fused", "dflash", "dflash-fused",
           "dflash-fused-reject", "ddtree", "eagle3", "eagle3-tree", "diffusion-cached"]
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


class Loop(NamedTuple):
    decode: Callable  # decode(temperature, generator, prompt=PROMPT, new=NEW) -> (tokens, stats)
    wrappers: list    # the compiled models (fast/compiled.compiled) that own its cache buffers


def story(run) -> Callable:
    """decode(temperature, generator, prompt, new) of run(prompt, new, the loops' keyword arguments)."""
    return lambda T, g, prompt=PROMPT, new=NEW: run(prompt, new, {"temperature": T, "generator": g, "stop_token": None})


def diffusion(mdlm) -> Callable:  # two blocks of CANVAS tokens, one a step, whatever `new` is
    return story(lambda p, n, c: generate_cached(mdlm, p, 2 * CANVAS, 2 * CANVAS, CANVAS, c["temperature"],
                                                 generator=c["generator"]))


def compiled_loops(m, compile=True) -> dict:
    """Each method's compiled loop, name -> Loop; with compile=False the same models on eager steps."""
    t = m["target"]
    steps = FusedSteps(t, STEPS, compile)
    ar = compiled(t, (1,), compile)
    spec = compiled(t, (K + 1,), compile), compiled(m["draft"], (1, 2), compile)
    spec_fused = fused_speculation(t, m["draft"], K, compile)
    fr_fused = fused_speculation(t, m["draft_fr"], K, compile)
    dflash, ddtree = [(compiled(t, (n,), compile), compiled(m["drafter"], (BLOCK,), compile))
                      for n in (BLOCK, BUDGET + 1)]
    dflash_fused = [FusedDFlash(t, m["drafter"], compile=compile) for _ in ("match", "reject")]
    eagle, eagle_tree = (compiled(t, (n,), compile) for n in (K + 1, BUDGET + 1))
    mdlm = compiled(m["mdlm"], (CANVAS, 2 * CANVAS), compile)
    loops = {
        "ar": Loop(story(lambda p, n, c: ar_generate(ar, p, n, **c)), [ar]),
        "ar-steps": Loop(story(lambda p, n, c: multi_step_generate(steps, p, n, **c)), [steps.model]),
        "spec": Loop(story(lambda p, n, c: speculative_generate(*spec, p, n, K, **c)), list(spec)),
        "spec-fused": Loop(story(lambda p, n, c: fused_speculative_generate(spec_fused, p, n, **c)),
                           [spec_fused.target, spec_fused.draft.draft]),
        "spec-fr-fused": Loop(story(lambda p, n, c: fused_speculative_generate(fr_fused, p, n, **c)),
                              [fr_fused.target, fr_fused.draft.draft]),
        "dflash": Loop(story(lambda p, n, c: dflash_generate(*dflash, p, n, **c)), list(dflash)),
        "dflash-fused": Loop(story(lambda p, n, c: fused_dflash_generate(dflash_fused[0], p, n, **c)),
                             [dflash_fused[0].target, dflash_fused[0].drafter]),
        "dflash-fused-reject": Loop(story(lambda p, n, c: fused_dflash_generate(dflash_fused[1], p, n, rule="reject",
                                                                                **c)),
                                    [dflash_fused[1].target, dflash_fused[1].drafter]),
        "ddtree": Loop(story(lambda p, n, c: ddtree_generate(*ddtree, p, n, budget=BUDGET, **c)), list(ddtree)),
        "eagle3": Loop(story(lambda p, n, c: eagle_generate(eagle, m["head"], p, n, k=K, **c)), [eagle]),
        "eagle3-tree": Loop(story(lambda p, n, c: eagle_generate(eagle_tree, m["head"], p, n, budget=BUDGET, **c)),
                            [eagle_tree]),
        "diffusion-cached": Loop(diffusion(mdlm), [mdlm]),
    }
    assert list(loops) == METHODS
    return loops


def eager_loops(m) -> dict:
    """Each method's eager twin, the loop its compiled one must match: name -> decode (as Loop.decode)."""
    t, draft, drafter, head = m["target"], m["draft"], m["drafter"], m["head"]
    ar = story(lambda p, n, c: ar_generate(t, p, n, **c))
    spec = story(lambda p, n, c: speculative_generate(t, draft, p, n, K, **c))
    fr = story(lambda p, n, c: speculative_generate(t, m["draft_fr"], p, n, K, propose=subset_draft_round, **c))
    dflash = story(lambda p, n, c: dflash_generate(t, drafter, p, n, **c))
    ddtree = story(lambda p, n, c: ddtree_generate(t, drafter, p, n, budget=BUDGET, **c))
    loops = {"ar": ar, "ar-steps": ar, "spec": spec, "spec-fused": spec, "spec-fr-fused": fr, "dflash": dflash,
             "dflash-fused": dflash,
             "dflash-fused-reject": story(lambda p, n, c: dflash_reject_generate(t, drafter, p, n, rule="reject",
                                                                                 **c)),
             "ddtree": ddtree,
             "eagle3": story(lambda p, n, c: eagle_generate(t, head, p, n, k=K, **c)),
             "eagle3-tree": story(lambda p, n, c: eagle_generate(t, head, p, n, budget=BUDGET, **c)),
             "diffusion-cached": diffusion(m["mdlm"])}
    assert list(loops) == METHODS
    return loops
