"""The decoding methods `python -m tinydiff.bench` compares, each as one runner function.

A runner decodes one prompt and returns counts that the bench sums over prompts:
new_tokens, seconds, target_forwards, and for speculative methods the accepted-count histogram
(`accepted`), the drafts `proposed`, for chains the rounds that `rejected` a draft, and per draft
slot the rounds that judged it and kept it (`slot_judged`, `slot_kept`). `models`
holds "target" (the AR model), "draft" (the small AR draft), "draft_fr" (the draft with FR-Spec's
pruned head, for the -fr rows), "drafter" (the DFlash drafter),
"eagle" (the EAGLE-3 head), "mdlm" (the diffusion LM), "distilled" (a diffusion LM distilled for
parallel decoding) and "moe" (the mixture-of-experts diffusion LM). No
runner stops at EOT: every method does the same work. Keys in MEANS are per-prompt means.
Every runner whose loop reports its steps or rounds hands it `recorded(args)` as its callback or on_round:
None, except for the one run the bench's --html records (a Recorder, tools/replay.py, that only reads).
"""
import re
import time
from functools import partial

import torch

from tinydiff.ar import ar_generate
from tinydiff.bench.moe_stats import moe_stats, reset_stats
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash import dflash_generate
from tinydiff.dmoe import MoETransformer, set_routing
from tinydiff.eagle3 import eagle_generate
from tinydiff.extras.ddtree_sampled import ddtree_sampled_generate
from tinydiff.extras.dflash_reject import dflash_reject_generate
from tinydiff.extras.drafted_diffusion import ar_drafted_generate
from tinydiff.extras.markov_head import markov_ddtree_generate, markov_drafts
from tinydiff.extras.self_speculative import self_speculative_generate
from tinydiff.fast.compiled import compile_all, hot_steps
from tinydiff.fast.frequent_vocab import subset_draft_round
from tinydiff.fast.fused_dflash import FusedDFlash, fused_dflash_generate
from tinydiff.fast.fused_round import fused_speculation, fused_speculative_generate
from tinydiff.fast.fused_steps import FusedSteps, multi_step_generate
from tinydiff.sampler import generate, generate_cached
from tinydiff.speculative import draft_round, speculative_generate
from tinydiff.ssd import geometric_fan_out, ssd_generate


def recorded(args):
    """The callback a decode reports its steps or rounds to: the Recorder of the one run the bench's --html
    records (table.py sets args.record for it), else None (the loops skip it)."""
    return getattr(args, "record", None)


def as_steps(args, prompt, block_length: int):
    """recorded(args) fed a block sampler's rounds (self-speculative, AR-drafted) as the diffusion steps they
    are: the canvas after each, its block counted from the prompt's end."""
    record = recorded(args)
    if record is None:
        return None
    return lambda info: record({**info, "block": (info["block_start"] - len(prompt)) // block_length})


def run_ar(models, prompt, args, generator):
    """Plain KV-cached decoding with the target: one forward per token (ar-steps<S>: S steps and their draws
    one graph, fused_steps.py)."""
    decode, model = (multi_step_generate, models["fused"]) if "fused" in models else (ar_generate, models["target"])
    ids, result = decode(model, prompt, args.new_tokens, args.temperature, generator=generator, stop_token=None)
    return {"new_tokens": len(ids), "seconds": result.seconds, "target_forwards": result.forwards}


def run_ar_steps(models, prompt, args, generator, steps):
    """ar with `steps` tokens per graph call, read back once (fused_steps.py): the same tokens. It pays
    only with --compile; without, the same calls run eagerly."""
    fused = models.get("fused") or FusedSteps(models["target"], steps, False)
    return run_ar({**models, "fused": fused}, prompt, args, generator)


def run_diffusion(models, prompt, args, generator, sampler=generate, **options):
    """The diffusion LM fills a canvas of new_tokens MASKs in blocks of 32."""
    n = args.new_tokens
    ids, result = sampler(models["mdlm"], prompt, n, n, min(32, n), args.temperature,
                          generator=generator, callback=recorded(args), **options)
    return {"new_tokens": len(ids), "seconds": result.seconds, "target_forwards": result.forwards}


def run_distilled(models, prompt, args, generator, **rule):
    """The distilled diffusion LM (train.py --distill) on the cached block sampler it was distilled for."""
    return run_diffusion({"mdlm": models["distilled"]}, prompt, args, generator, sampler=generate_cached, **rule)


def run_self_spec(models, prompt, args, generator, k):
    """The distilled diffusion LM one token per step left to right, k positions a round drafted from its own
    distributions and verified by one batched forward (self_speculative.py): lossless."""
    n = args.new_tokens
    ids, result = self_speculative_generate(models["distilled"], prompt, n, min(32, n), args.temperature,
                                            "left_to_right", k, generator=generator,
                                            on_round=as_steps(args, prompt, min(32, n)))
    return {**chain_counts(ids, result), "canvases": result.canvases}


def run_ar_drafted(models, prompt, args, generator, k):
    """The same sampler, k positions a round drafted left to right by an AR draft trained on the distilled
    model's stories (--distilled-draft; drafted_diffusion.py): lossless."""
    n = args.new_tokens
    ids, result = ar_drafted_generate(models["distilled"], models["distilled_draft"], prompt, n, min(32, n),
                                      args.temperature, k, generator=generator,
                                      on_round=as_steps(args, prompt, min(32, n)))
    return {**chain_counts(ids, result), "canvases": result.canvases}


def run_spec(models, prompt, args, generator, k, draft="draft", propose=draft_round):
    """The draft proposes k tokens, the target verifies them in one forward (a -fused or -fr row with
    --compile: each round, drafts, verify and verdict, one compiled graph: fused_round.py)."""
    if "fused" in models:
        ids, result = fused_speculative_generate(models["fused"], prompt, args.new_tokens, args.temperature,
                                                 generator=generator, stop_token=None, on_round=recorded(args))
    else:
        ids, result = speculative_generate(models["target"], models[draft], prompt, args.new_tokens, k,
                                           args.temperature, generator=generator, stop_token=None, propose=propose,
                                           on_round=recorded(args))
    return chain_counts(ids, result)


def run_spec_fr(models, prompt, args, generator, k):
    """spec with FR-Spec's draft: its head scores only the --draft-vocab ids most frequent in --data,
    and it samples among them."""
    return run_spec(models, prompt, args, generator, k, draft="draft_fr", propose=subset_draft_round)


def chain_counts(ids, result):
    """What the bench sums for a chain-drafting method."""
    return {"new_tokens": len(ids), "seconds": result.seconds, "target_forwards": result.forwards,
            "accepted": result.accepted, "proposed": result.proposed, "rejected": result.rejected,
            "slot_judged": result.slot_judged, "slot_kept": result.slot_kept, **stage_seconds(result)}


def stage_seconds(result):
    """The seconds a loop that clocks its rounds (tally.Tally.clock) spent drafting and verifying, or a fused
    loop's from its graphs' calls to their read-backs."""
    if result.graph_seconds is not None:
        return {"graph_seconds": result.graph_seconds}
    if result.draft_seconds is None:
        return {}
    return {"draft_seconds": result.draft_seconds, "verify_seconds": result.verify_seconds}


def tree_counts(ids, result):
    """What the bench sums for a tree-drafting method: nodes verified instead of drafts judged."""
    return {"new_tokens": len(ids), "nodes": result.proposed, "seconds": result.seconds,
            "target_forwards": result.forwards, "accepted": result.accepted, "rounds": result.rounds,
            "slot_judged": result.slot_judged, "slot_kept": result.slot_kept, **stage_seconds(result)}


def run_ssd(models, prompt, args, generator, fan_out, k=4):
    """spec-k4 with the draft running ahead in a second thread, pre-drafting likely next rounds."""
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the draft's thread and the target's each get a core, as in generate.py
    rounds, record = [], recorded(args)
    on_round = rounds.append if record is None else lambda info: (rounds.append(info), record(info))
    try:
        ids, result = ssd_generate(models["target"], models["draft"], prompt, args.new_tokens, k, fan_out,
                                   args.temperature, generator=generator, stop_token=None, threaded=True,
                                   on_round=on_round)
    finally:
        torch.set_num_threads(threads)
    sd, ssd = modelled_seconds(result, rounds, *args.forward_costs)
    return {**chain_counts(ids, result), "hits": result.hits, "lookups": result.lookups,
            "modelled_seconds_sd": sd, "modelled_seconds_ssd": ssd}


@torch.no_grad()
def forward_seconds(model, seq, reps: int = 5) -> float:
    """Median seconds of one single-token KV-cached forward after seq: decoding's unit cost."""
    device = model.embed.weight.device
    cache = model.new_cache(1)
    model(torch.tensor([seq], device=device), cache=cache, causal=True)
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        model(torch.tensor([seq[-1:]], device=device), cache=cache, causal=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
        cache.crop(len(seq))
    return sorted(times)[reps // 2]


def modelled_seconds(result, rounds: list, draft_s: float, target_s: float) -> tuple[float, float]:
    """SSD priced as if its draft had its own device, where a batched forward over a few rows costs one: plain
    speculative decoding's time at these forward costs (a target forward per round, a draft forward per
    draft), and SSD's, sum over rounds of jit * draft_s + max(target_s, ahead * draft_s) (jit: draft
    forwards run just in time before the round; ahead: run-ahead forwards during its verification)."""
    sd = result.rounds * target_s + result.proposed * draft_s
    ssd = sum(r["jit_forwards"] * draft_s + max(target_s, r["ahead_forwards"] * draft_s) for r in rounds)
    return sd, ssd


def run_dflash(models, prompt, args, generator, block_size, rule="match", min_confidence=None):
    """The DFlash drafter fills a block of block_size - 1 MASKs in one forward; the target verifies
    (extras/dflash_reject.py: "match" drafts the drafter's argmax, "reject" samples it and applies the
    rejection rule), all of them or (min_confidence) those before the first the drafter is unsure of
    (a -fused row with --compile: each round one compiled graph, fused_dflash.py)."""
    drafter = models["drafter"]
    if "fused" in models:
        ids, result = fused_dflash_generate(models["fused"], prompt, args.new_tokens, args.temperature,
                                            generator=generator, stop_token=None, rule=rule, on_round=recorded(args))
    elif rule == "match" and min_confidence is None and getattr(drafter, "markov", None) is None:
        ids, result = dflash_generate(models["target"], drafter, prompt, args.new_tokens, block_size,
                                      args.temperature, generator=generator, stop_token=None, on_round=recorded(args))
    else:
        propose = partial(markov_drafts, sampled=rule == "reject") if getattr(drafter, "markov", None) else None
        ids, result = dflash_reject_generate(models["target"], drafter, prompt, args.new_tokens, block_size,
                                             args.temperature, generator=generator, stop_token=None, rule=rule,
                                             min_confidence=min_confidence, propose=propose, on_round=recorded(args))
    return chain_counts(ids, result)


def run_ddtree(models, prompt, args, generator, budget):
    """One DFlash drafter pass grown into a tree of `budget` nodes, verified in one target forward (a drafter
    with DSpark's Markov head: trees whose children read it)."""
    decode = markov_ddtree_generate if getattr(models["drafter"], "markov", None) is not None else ddtree_generate
    ids, result = decode(models["target"], models["drafter"], prompt, args.new_tokens, None, budget,
                         args.temperature, generator=generator, stop_token=None, on_round=recorded(args))
    return tree_counts(ids, result)


def run_ddtree_reject(models, prompt, args, generator, budget):
    """The same drafter pass grown into a tree of sampled children (ddtree_sampled.py), judged by
    recursive rejection sampling: lossless at every temperature, built for T > 0 (ddtree-n<N> at T = 0)."""
    ids, result = ddtree_sampled_generate(models["target"], models["drafter"], prompt, args.new_tokens, None, budget,
                                          args.temperature, generator=generator, stop_token=None,
                                          on_round=recorded(args))
    return tree_counts(ids, result)


def run_eagle(models, prompt, args, generator, k, budget=None):
    """The EAGLE-3 head drafts a chain of k tokens, or a tree of `budget` nodes k deep, 4 wide."""
    ids, result = eagle_generate(models["target"], models["eagle"], prompt, args.new_tokens, k, budget, 4,
                                 args.temperature, generator=generator, stop_token=None, on_round=recorded(args))
    return chain_counts(ids, result) if budget is None else tree_counts(ids, result)


def run_dmoe(models, prompt, args, generator, routing):
    """The MoE diffusion LM under token or block expert routing: what each forward reads. Decoded
    block by block with the finished prefix cached, so a forward computes one block (dMoE's "block
    forward"), not the whole canvas with its finished and all-MASK blocks."""
    model = models["moe"]
    set_routing(model, routing)
    reset_stats(model, sync_timing=args.device.startswith("cuda"))
    counts = run_diffusion({"mdlm": model}, prompt, args, generator, sampler=generate_cached)
    stats = moe_stats(model)
    return {**counts, **{key: stats[key] for key in MEANS}}


MEANS = ("unique_experts_per_block", "expert_bytes_per_forward", "moe_seconds_per_forward")

METHODS = {
    "ar": run_ar,
    **{f"ar-steps{s}": (lambda *a, s=s: run_ar_steps(*a, steps=s)) for s in (4, 8, 16)},
    "spec-k2": lambda *a: run_spec(*a, k=2),
    "spec-k4": lambda *a: run_spec(*a, k=4),
    "spec-k8": lambda *a: run_spec(*a, k=8),
    "spec-k4-fused": lambda *a: run_spec(*a, k=4),
    **{f"spec-k{k}-fr": (lambda *a, k=k: run_spec_fr(*a, k=k)) for k in (2, 3, 4, 5, 6)},
    "ssd-f1": lambda *a: run_ssd(*a, fan_out=1),
    "ssd-f3": lambda *a: run_ssd(*a, fan_out=3),
    "ssd-f8": lambda *a: run_ssd(*a, fan_out=8),
    # 1 or 2 branches where the paper's geometric allocation puts them at alpha ~ 0.9: after a full acceptance
    "ssd-g1": lambda *a: run_ssd(*a, fan_out=geometric_fan_out(1, 4, 0.9)),
    "ssd-g2": lambda *a: run_ssd(*a, fan_out=geometric_fan_out(2, 4, 0.9)),
    "dflash-b8": lambda *a: run_dflash(*a, block_size=8),
    "dflash-b16": lambda *a: run_dflash(*a, block_size=16),
    "dflash-b16-fused": lambda *a: run_dflash(*a, block_size=16),
    "dflash-b16-reject": lambda *a: run_dflash(*a, block_size=16, rule="reject"),
    # DSpark's confidence-scheduled verify length, --min-confidence
    "dflash-b16-sched": lambda *a: run_dflash(*a, block_size=16, min_confidence=a[2].min_confidence),
    "dflash-b16-reject-sched": lambda *a: run_dflash(*a, block_size=16, rule="reject", min_confidence=a[2].min_confidence),
    **{f"ddtree-n{n}": (lambda *a, n=n: run_ddtree(*a, budget=n)) for n in (8, 16, 32, 64, 128)},
    **{f"ddtree-n{n}-reject": (lambda *a, n=n: run_ddtree_reject(*a, budget=n)) for n in (16, 32, 64)},
    "eagle3-chain": lambda *a: run_eagle(*a, k=4),
    "eagle3-tree": lambda *a: run_eagle(*a, k=6, budget=32),
    "diffusion": run_diffusion,
    "diffusion-threshold": lambda *a: run_diffusion(*a, threshold=0.9),
    "diffusion-cached": lambda *a: run_diffusion(*a, sampler=generate_cached),
    "diffusion-entropy": lambda *a: run_diffusion(*a, sampler=generate_cached, entropy_bound=a[2].entropy_bound),
    **{f"diffusion-distilled-t{t:g}": (lambda *a, t=t: run_distilled(*a, threshold=t)) for t in (0.9, 0.7, 0.5)},
    "diffusion-distilled-entropy": lambda *a: run_distilled(*a, entropy_bound=a[2].entropy_bound),
    "diffusion-distilled-low-entropy": lambda *a: run_distilled(*a, entropy_bound=a[2].entropy_bound,
                                                                remasking="low_entropy"),
    **{f"diffusion-distilled-self-spec-k{k}": (lambda *a, k=k: run_self_spec(*a, k=k)) for k in (1, 2, 4)},
    **{f"diffusion-distilled-ar-drafted-k{k}": (lambda *a, k=k: run_ar_drafted(*a, k=k)) for k in (4, 8, 16)},
    "dmoe-token": lambda *a: run_dmoe(*a, routing="token"),
    "dmoe-block": lambda *a: run_dmoe(*a, routing="block"),
}


FR_ROWS = {name for name in METHODS if name.endswith("-fr")}  # the rows that decode with models["draft_fr"]
STEPS_ROWS = {name for name in METHODS if name.startswith("ar-steps")}  # ar, several tokens a graph call


def block_of(method: str) -> int | None:
    """The block size a dflash-b<B>[-rule] row drafts (None for other methods)."""
    found = re.match(r"dflash-b(\d+)", method)
    return int(found.group(1)) if found else None


def draft_count(method: str) -> int:
    """k, the drafts per round of a spec-k<k>[-fr] row."""
    return int(re.match(r"spec-k(\d+)", method).group(1))


# method -> the model whose held-out NLL stands beside it (default: the diffusion LM)
USES = {**{name: "target" for name in METHODS if not name.startswith(("diffusion", "dmoe"))},
        **{name: "distilled" for name in METHODS if name.startswith("diffusion-distilled")},
        "dmoe-token": "moe-token", "dmoe-block": "moe-block"}


def compiled_models(method: str, models: dict, args) -> dict | None:
    """`models` as `method` reads them with --compile, or None for the methods it does not cover: SSD (threads,
    batched branches), the uncached diffusion samplers (no cache), the self-speculative and ar-drafted ones
    (batched canvases) and dMoE (routing has no fixed shapes), an ar-moe target included. Each row runs its
    own loop on compiled steps (fast/compiled.py); a -fused row, or ar-steps<S>, runs a whole round (or S
    steps) as one graph (fused_round.py, fused_dflash.py, fused_steps.py)."""
    if USES.get(method) == "target" and isinstance(models["target"], MoETransformer):
        return None
    mode, fused = args.compile, method.endswith("-fused")
    if method in STEPS_ROWS:  # S steps with their draws: one graph; the prompt in compiled chunks
        return {**models, "fused": FusedSteps(models["target"], int(method.removeprefix("ar-steps")), mode)}
    if method == "ar":
        return compile_all(models, {"target": (1,)}, mode)
    if method.startswith("spec-k"):
        draft = models["draft_fr"] if method in FR_ROWS else models["draft"]
        if fused or method in FR_ROWS:  # the whole round, a story's last ones too: one graph. A plain draft
            # runs as the subset of every id: the same tokens (frequent_vocab.every_id)
            return {**models, "fused": fused_speculation(models["target"], draft, draft_count(method), mode)}
        return compile_all(models, hot_steps("spec", k=draft_count(method)), mode)
    if block_of(method):
        if fused:  # the whole round: one graph
            return {**models, "fused": FusedDFlash(models["target"], models["drafter"], block_of(method), mode)}
        return compile_all(models, hot_steps("dflash", block_size=block_of(method)), mode)
    if method.startswith("ddtree-n"):
        block = models["drafter"].config.block_size
        budget = int(re.match(r"ddtree-n(\d+)", method).group(1))
        return compile_all(models, hot_steps("ddtree", block_size=block, budget=budget), mode)
    if method.startswith("eagle3-"):
        hot = hot_steps("eagle3", k=4) if method == "eagle3-chain" else hot_steps("eagle3", k=6, budget=32)
        return compile_all(models, hot, mode)
    if "-self-spec-" in method or "-ar-drafted-" in method:  # batched verify canvases: no static batch-1 cache
        return None
    role = "distilled" if method.startswith("diffusion-distilled") else "mdlm"
    if method in ("diffusion-cached", "diffusion-entropy") or role == "distilled":
        block = min(32, args.new_tokens)  # run_diffusion's blocks
        hot = hot_steps("diffusion-cached", block_length=block, shift=int(models[role].config.shift))
        return compile_all(models, {role: hot["target"]}, mode)
    return None
