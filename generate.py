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
from tinydiff.io.checkpoint import AR_KINDS, DIFFUSION_KINDS, MOE_KINDS, drafter_from, load_checkpoint, load_model
from tinydiff.io.cli import (
    add_compile,
    check_device,
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
    args.method, args.draft, args.k = ("dflash" if config["method"] == "dflash" else "spec"), config["model"], \
        None if n is None else COUNT.check("--speculative-config's num_speculative_tokens", n)
    args.given |= {"method", "draft", "k"}


def compiled(args, model, hot):
    """The model with its decoding steps compiled for the token counts in `hot` (--compile), else as it is."""
    if not args.compile:
        return model
    from tinydiff.fast.compiled import compiled as compile_model
    args.compiled.append(compile_model(model, hot, args.compile))
    return args.compiled[-1]


def decode(method, model, prompt, args, generator):
    """(new ids, result) of `method` on `model`; each method's module imported only when it runs."""
    warping, loop = (args.temperature, args.top_k or None, args.top_p), dict(generator=generator, on_round=args.view)
    new = args.max_new_tokens
    if method == "ar":
        from tinydiff.ar import ar_generate
        return ar_generate(compiled(args, model, (1,)), prompt, new, *warping, generator)
    if method in DIFFUSION:
        from tinydiff.sampler import diffusion_lengths, generate, generate_cached
        new, block = diffusion_lengths(model, prompt, new, args.block_length)
        rule = dict(threshold=args.threshold, entropy_bound=args.entropy_bound, generator=generator,
                    callback=args.view)
        if method == "diffusion":
            return generate(model, prompt, new, args.steps or new, block, args.temperature, **rule)
        model = compiled(args, model, (block + model.config.shift, 2 * block + model.config.shift))
        return generate_cached(model, prompt, new, args.steps or new, block, args.temperature, **rule)
    if not args.draft:
        raise UserError(f"--method {method} needs --draft CKPT (a {DRAFT_KINDS[method]} model trained for --ckpt)")
    draft_ckpt = load_checkpoint(args.draft, kinds=(DRAFT_KINDS[method],))
    k = args.k or 4
    if method in ("spec", "ssd"):
        from tinydiff.io.checkpoint import model_from
        draft = model_from(draft_ckpt, args.draft, args.device).eval()
        if method == "ssd":
            from tinydiff.ssd import ssd_generate
            if args.device == "cpu":
                torch.set_num_threads(1)  # the draft's thread and the target's each get one core
            return ssd_generate(model, draft, prompt, new, k, 3, *warping, threaded=True, **loop)
        from tinydiff.speculative import speculative_generate
        return speculative_generate(compiled(args, model, (k + 1,)), compiled(args, draft, (1, 2)), prompt, new, k,
                                    *warping, **loop)
    if method == "eagle3":
        from tinydiff.eagle3 import eagle_generate
        from tinydiff.io.checkpoint import head_from
        head = head_from(draft_ckpt, model, args.draft)
        model = compiled(args, model, (k + 1 if args.budget is None else args.budget + 1,))
        return eagle_generate(model, head, prompt, new, k, args.budget, 4, *warping, **loop)
    drafter = drafter_from(draft_ckpt, model, args.draft)
    B = BLOCK.check("--k + 1 (the drafter's block)", k + 1) if args.k else drafter.config.block_size
    if method == "dflash":
        from tinydiff.dflash import dflash_generate
        return dflash_generate(compiled(args, model, (B,)), compiled(args, drafter, (B,)), prompt, new, B, *warping,
                               **loop)
    from tinydiff.ddtree import ddtree_generate
    budget = args.budget or 32
    return ddtree_generate(compiled(args, model, (budget + 1,)), compiled(args, drafter, (B,)), prompt, new, B,
                           budget, *warping, **loop)


def main(argv=None):
    args = parse_args(argv)
    check_device(args.device)
    if args.html:  # before any work: the page can be written; a Recorder, the loop's callback, keeps every step
        from tinydiff.tools.replay import Recorder, check_page_path
        check_page_path(args.html)
    if args.speculative_config:
        speculative_config(args)
    model, ckpt = load_model(args.ckpt, args.device, kinds=sum(METHODS.values(), ()))
    method = args.method or ("diffusion" if ckpt["kind"] in DIFFUSION_KINDS else "ar")
    if ckpt["kind"] not in METHODS[method]:
        raise UserError(f"--method {method} needs a {' or '.join(METHODS[method])} checkpoint; {args.ckpt} holds a "
                        f"{ckpt['kind']} model")
    stray = ["--" + key.replace("_", "-") for key in sorted(args.given) if method not in USED_BY.get(key, (method,))]
    if stray:
        raise UserError(f"{', '.join(stray)} do{'es' if len(stray) == 1 else ''} not apply to --method {method}; "
                        f"drop {'it' if len(stray) == 1 else 'them'}")
    moe = ckpt["kind"] in MOE_KINDS
    if args.compile and moe:
        raise UserError("--compile does not cover mixture-of-experts checkpoints (their routing has no fixed shapes)")
    if moe:  # it decodes with the routing it was saved with (train.py --init CKPT --routing block converts one)
        from tinydiff.bench.moe_stats import moe_stats, reset_stats
        reset_stats(model)
    (tokenizer, prompt), generator = encode_prompt(args.prompt), torch.Generator(args.device).manual_seed(args.seed)
    args.temperature = (0.0 if method in DIFFUSION else 0.8) if args.temperature is None else args.temperature
    animate = method in DIFFUSION and sys.stdout.isatty() and not (args.json or args.html)  # on a terminal: watch it
    args.compiled, args.view = [], None
    if args.html or animate:  # the loop's callback: a Recorder keeps every step, a CanvasView draws it live
        from tinydiff.tools.replay import CanvasView
        args.view = Recorder(method, tokenizer, prompt, args.prompt, model) if args.html else \
            CanvasView(tokenizer, args.prompt, len(prompt))
    ids, result = decode(method, model, prompt, args, generator)
    if animate:
        args.view.clear()  # the final text, cut at the story's end, replaces the last frame
    stats = result.row() | (moe_stats(model) if moe else {})
    if args.compile:  # seconds (and tokens_per_s) include it: the first call of each step compiles it
        from tinydiff.fast.compiled import compile_seconds
        stats["compile_seconds"] = compile_seconds(args.compiled)
    if args.html:
        stats["page"] = args.view.write(args.html)
    print_story(args, tokenizer, prompt, ids, stats)


if __name__ == "__main__":
    sys.exit(run_main(main))
