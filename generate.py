"""Write a story with a trained checkpoint, by any of the core's decoding methods.

    python generate.py --ckpt out/mdlm-tiny/ckpt.pt --prompt "Once upon a time"
    python generate.py --ckpt out/mdlm-tiny/ckpt.pt --prompt "Tom had a dog" --threshold 0.9 --html replay.html
    python generate.py --ckpt out/ar-tiny/ckpt.pt --prompt "Tom had a dog" --temperature 0 --json
    python generate.py --ckpt out/ar-tiny/ckpt.pt --method spec --draft out/ar-draft/ckpt.pt --k 4 --prompt "Tom"
    python generate.py --ckpt out/ar-tiny/ckpt.pt --method ddtree --draft out/dflash-tiny/ckpt.pt --prompt "Tom"

The method follows the checkpoint (`diffusion` for a masked-diffusion LM: the canvas starts all-MASK and fills
in, drawn on a terminal as it does; `ar` for an AR model), or --method picks one: `spec` (a small AR draft
proposes k tokens per target forward), `ssd` (spec, the draft pre-drafting the next round in a second thread),
`dflash` (a block drafter drafts k tokens in one forward), `ddtree` (that forward grown into a tree of --budget
nodes), `eagle3` (an EAGLE-3 head: a chain of k, or with --budget a tree), `diffusion-cached` (blocks left to
right, the finished prefix in a KV cache). Every speculative method writes the target's distribution: at
temperature 0, exactly the tokens `ar` writes. --html: a page that replays the run (tinydiff/tools/replay.py).
vLLM's spelling: --speculative-config '{"method": "draft_model", "model": "out/ar-draft/ckpt.pt", ...}'.
Research variants have entry points of their own (docs/USAGE.md), e.g. python -m tinydiff.extras.self_speculative.
"""
import json
import sys

import torch

from tinydiff.checks import BLOCK, COUNT, COUNT_OR_NONE, MASS, NATS, UserError
from tinydiff.io.checkpoint import (
    AR_KINDS,
    DIFFUSION_KINDS,
    MOE_KINDS,
    drafter_from,
    head_from,
    load_checkpoint,
    load_model,
    model_from,
)
from tinydiff.io.cli import (
    add_compile,
    check_device,
    clamp_drafts,
    encode_prompt,
    given_flags,
    print_story,
    run_main,
    story_parser,
)

AR_FAMILY = ("ar", "spec", "ssd", "dflash", "ddtree", "eagle3")
METHODS = {**{method: AR_KINDS for method in AR_FAMILY}, "diffusion": DIFFUSION_KINDS,
           "diffusion-cached": DIFFUSION_KINDS}  # method -> the checkpoint kinds it decodes
DRAFT_KINDS = {"spec": "ar", "ssd": "ar", "dflash": "dflash", "ddtree": "dflash", "eagle3": "eagle3"}
DIFFUSION = ("diffusion", "diffusion-cached")
USED_BY = {"top_k": AR_FAMILY, "top_p": AR_FAMILY, "draft": tuple(DRAFT_KINDS), "k": tuple(DRAFT_KINDS),
           "budget": ("ddtree", "eagle3"), "html": (*DRAFT_KINDS, *DIFFUSION),  # every method but ar: a token a forward
           "compile": ("ar", "spec", "dflash", "ddtree", "eagle3", "diffusion-cached"),
           **{key: DIFFUSION for key in ("steps", "block_length", "threshold", "entropy_bound")}}


def parse_args(argv=None):
    p = story_parser("python generate.py", __doc__.split("\n")[0])
    p.add_argument("--method", choices=list(METHODS), help="default: the checkpoint's own (ar or diffusion)")
    add_compile(p, "; the same tokens, the compile time apart in the stats")
    p.add_argument("--top-k", type=COUNT_OR_NONE, default=50, help="AR family: sample among the k likeliest tokens "
                   "(0: all)")
    p.add_argument("--top-p", type=MASS, help="AR family: nucleus sampling mass")
    p.add_argument("--draft", help="the draft: an AR model (spec, ssd), a DFlash drafter (dflash, ddtree) or an "
                   "EAGLE-3 head (eagle3), trained for this --ckpt")
    p.add_argument("--k", type=COUNT, help="drafts per round (default 4; dflash, ddtree: the drafter's block - 1)")
    p.add_argument("--budget", type=COUNT, help="tree nodes verified per round (ddtree: default 32; eagle3: a tree "
                   "instead of a chain of k)")
    p.add_argument("--speculative-config", help="vLLM-style JSON: method (draft_model or dflash), model, "
                   "num_speculative_tokens")
    p.add_argument("--steps", type=COUNT, help="diffusion: forwards in all (default: one token per step)")
    p.add_argument("--block-length", type=COUNT, help="diffusion: blocks filled left to right (default 32, or the "
                   "largest size under it that divides --max-new-tokens)")
    p.add_argument("--threshold", type=MASS, help="diffusion: commit every position this confident (Fast-dLLM)")
    p.add_argument("--entropy-bound", type=NATS, help="diffusion: commit the most confident run whose entropies, "
                   "less the largest, sum to at most this many nats (EB-Sampler)")
    p.add_argument("--html", metavar="FILE", help="also write a page that replays the run step by step, any browser")
    args = p.parse_args(argv)
    args.given = given_flags(p, argv)
    return args


def speculative_config(args):
    """Fold vLLM's --speculative-config into --method, --draft and --k, the one place it is read."""
    try:
        config = json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise UserError(f"--speculative-config is not valid JSON ({e.msg}); e.g. '{{\"method\": \"draft_model\", "
                        '"model": "out/ar-draft/ckpt.pt", "num_speculative_tokens": 4}\'') from None
    if (not isinstance(config, dict) or config.get("method") not in ("draft_model", "dflash")
            or not isinstance(config.get("model"), str) or not config["model"]):
        raise UserError('--speculative-config needs {"method": "draft_model" or "dflash", "model": PATH, ...}')
    clash = [f"--{flag}" for flag in ("method", "draft", "k") if flag in args.given]
    if clash:
        raise UserError(f"--speculative-config names the method, the draft and its drafts per round: drop "
                        f"{', '.join(clash)}")
    n = config.get("num_speculative_tokens")
    args.method = "dflash" if config["method"] == "dflash" else "spec"
    args.draft = config["model"]
    args.k = None if n is None else COUNT.check("--speculative-config's num_speculative_tokens", n)
    args.given |= {"method", "draft", "k"}


def check_method(args, ckpt) -> str:
    """The method to run, checked against the checkpoint and the flags given, before any work."""
    method = args.method or ("diffusion" if ckpt["kind"] in DIFFUSION_KINDS else "ar")
    if ckpt["kind"] not in METHODS[method]:
        raise UserError(f"--method {method} needs a {' or '.join(METHODS[method])} checkpoint; {args.ckpt} holds a "
                        f"{ckpt['kind']} model")
    stray = ["--" + key.replace("_", "-") for key in sorted(args.given) if method not in USED_BY.get(key, (method,))]
    if stray:
        raise UserError(f"{', '.join(stray)} do{'es' if len(stray) == 1 else ''} not apply to --method {method}; "
                        f"drop {'it' if len(stray) == 1 else 'them'}")
    if args.compile and ckpt["kind"] in MOE_KINDS:
        raise UserError("--compile does not cover mixture-of-experts checkpoints (their routing has no fixed shapes)")
    return method


# Each method: its core loop, imported when it runs, called with what the flags say. They share the target
# `model`, the encoded `prompt`, the parsed `args` and the seeded `generator`, and return (new ids, result).

def run_ar(model, prompt, args, generator):
    from tinydiff.ar import ar_generate
    models = compiled(args, {"target": model}, "ar")
    return ar_generate(models["target"], prompt, args.max_new_tokens, *warping(args), generator)


def run_spec(model, prompt, args, generator):
    from tinydiff.speculative import speculative_generate
    draft = model_from(draft_checkpoint(args, "spec"), args.draft, args.device).eval()
    k = drafts_per_round(args, model, prompt)
    models = compiled(args, {"target": model, "draft": draft}, "spec", k=k)
    return speculative_generate(models["target"], models["draft"], prompt, args.max_new_tokens, k, *warping(args),
                                **loop(args, generator))


def run_ssd(model, prompt, args, generator):
    from tinydiff.ssd import ssd_generate
    draft = model_from(draft_checkpoint(args, "ssd"), args.draft, args.device).eval()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the draft's thread and the target's each get one core
    k = drafts_per_round(args, model, prompt)
    return ssd_generate(model, draft, prompt, args.max_new_tokens, k, 3, *warping(args), threaded=True,
                        **loop(args, generator))


def run_dflash(model, prompt, args, generator):
    from tinydiff.dflash import dflash_generate
    drafter = drafter_from(draft_checkpoint(args, "dflash"), model, args.draft)
    B = block_size(args, drafter)
    models = compiled(args, {"target": model, "drafter": drafter}, "dflash", block_size=B)
    return dflash_generate(models["target"], models["drafter"], prompt, args.max_new_tokens, B, *warping(args),
                           **loop(args, generator))


def run_ddtree(model, prompt, args, generator):
    from tinydiff.ddtree import ddtree_generate
    drafter = drafter_from(draft_checkpoint(args, "ddtree"), model, args.draft)
    B = block_size(args, drafter)
    budget = args.budget or 32
    models = compiled(args, {"target": model, "drafter": drafter}, "ddtree", block_size=B, budget=budget)
    return ddtree_generate(models["target"], models["drafter"], prompt, args.max_new_tokens, B, budget,
                           *warping(args), **loop(args, generator))


def run_eagle3(model, prompt, args, generator):
    from tinydiff.eagle3 import eagle_generate
    head = head_from(draft_checkpoint(args, "eagle3"), model, args.draft)
    k = drafts_per_round(args, model, prompt)
    model = compiled(args, {"target": model}, "eagle3", k=k, budget=args.budget)["target"]
    return eagle_generate(model, head, prompt, args.max_new_tokens, k, args.budget, 4, *warping(args),
                          **loop(args, generator))


def run_diffusion(model, prompt, args, generator):
    from tinydiff.sampler import diffusion_lengths, generate
    new, block = diffusion_lengths(model, prompt, args.max_new_tokens, args.block_length)
    return generate(model, prompt, new, args.steps or new, block, args.temperature, **rule(args, generator))


def run_diffusion_cached(model, prompt, args, generator):
    from tinydiff.sampler import diffusion_lengths, generate_cached
    new, block = diffusion_lengths(model, prompt, args.max_new_tokens, args.block_length)
    shape = {"block_length": block, "shift": int(model.config.shift)}
    model = compiled(args, {"target": model}, "diffusion-cached", **shape)["target"]
    return generate_cached(model, prompt, new, args.steps or new, block, args.temperature, **rule(args, generator))


RUN = {  # method -> the function that runs it
    "ar": run_ar,
    "spec": run_spec,
    "ssd": run_ssd,
    "dflash": run_dflash,
    "ddtree": run_ddtree,
    "eagle3": run_eagle3,
    "diffusion": run_diffusion,
    "diffusion-cached": run_diffusion_cached,
}


def warping(args) -> tuple:
    """(temperature, top_k, top_p), as every AR-family loop takes them; --top-k 0: all tokens."""
    return args.temperature, args.top_k or None, args.top_p


def loop(args, generator) -> dict:
    """The draft/verify loops' keywords: the random stream, and the view that sees each round."""
    return {"generator": generator, "on_round": args.view}


def rule(args, generator) -> dict:
    """The diffusion samplers' keywords: the commit rule, the random stream, the view that sees each step."""
    return {"threshold": args.threshold, "entropy_bound": args.entropy_bound, "generator": generator,
            "callback": args.view}


def draft_checkpoint(args, method: str) -> dict:
    """--draft read as the kind of draft `method` runs (a user mistake: one line, before decoding)."""
    if not args.draft:
        raise UserError(f"--method {method} needs --draft CKPT (a {DRAFT_KINDS[method]} model trained for --ckpt)")
    return load_checkpoint(args.draft, kinds=(DRAFT_KINDS[method],))


def drafts_per_round(args, model, prompt) -> int:
    """--k (default 4), clamped to what a round of this story can draft (io/cli.clamp_drafts)."""
    if args.k is None:
        return 4
    room = model.config.context - len(prompt)
    return clamp_drafts(args.k, min(args.max_new_tokens or room, room))


def block_size(args, drafter) -> int:
    """A DFlash block: --k drafts and the token before them, else the block the drafter was trained with."""
    if args.k:
        return BLOCK.check("--k + 1 (the drafter's block)", args.k + 1)
    return drafter.config.block_size


def compiled(args, models: dict, method: str, **shape) -> dict:
    """`models` (role -> model) with each role's decoding steps compiled for the token counts `method` reads
    (--compile; `shape`: fast.compiled.hot_steps' keywords, the table the bench compiles by), else as they are."""
    if not args.compile:
        return models
    from tinydiff.fast.compiled import compile_all, hot_steps
    models = compile_all(models, hot_steps(method, **shape), args.compile)
    args.compiled += models.values()
    return models


def view(args, method: str, tokenizer, prompt, model):
    """The loop's callback: with --html a Recorder keeps every step; a diffusion canvas on a terminal is drawn
    live by a CanvasView; else None."""
    if args.html:
        from tinydiff.tools.replay import Recorder
        return Recorder(method, tokenizer, prompt, args.prompt, model)
    if method in DIFFUSION and sys.stdout.isatty() and not args.json:
        from tinydiff.tools.replay import CanvasView
        return CanvasView(tokenizer, args.prompt, len(prompt))
    return None


def main(argv=None):
    args = parse_args(argv)
    check_device(args.device)
    if args.html:  # before any work: the page can be written
        from tinydiff.tools.replay import check_page_path
        check_page_path(args.html)
    if args.speculative_config:
        speculative_config(args)
    model, ckpt = load_model(args.ckpt, args.device, kinds=sum(METHODS.values(), ()))
    method = check_method(args, ckpt)
    tokenizer, prompt = encode_prompt(args.prompt)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    if args.temperature is None:
        args.temperature = 0.0 if method in DIFFUSION else 0.8
    args.compiled = []
    args.view = view(args, method, tokenizer, prompt, model)
    moe = ckpt["kind"] in MOE_KINDS
    if moe:  # it decodes with the routing it was saved with (train.py --init CKPT --routing block converts one)
        from tinydiff.bench.moe_stats import moe_stats, reset_stats
        reset_stats(model)

    ids, result = RUN[method](model, prompt, args, generator)

    stats = result.row() | (moe_stats(model) if moe else {})
    if args.compile:  # seconds (and tokens_per_s) include it: the first call of each step compiles it
        from tinydiff.fast.compiled import compile_seconds
        stats["compile_seconds"] = compile_seconds(args.compiled)
    if args.html:
        stats["page"] = args.view.write(args.html)
    elif args.view is not None:
        args.view.clear()  # the final text, cut at the story's end, replaces the last frame
    print_story(args, tokenizer, prompt, ids, stats)


if __name__ == "__main__":
    sys.exit(run_main(main))
