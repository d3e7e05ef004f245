"""Generate a story from a trained checkpoint.

    python generate.py --ckpt out/mdlm-tiny/ckpt.pt --prompt "Once upon a time"
    python generate.py --ckpt out/mdlm-tiny/ckpt.pt --prompt "Tom had a dog" --threshold 0.9
    python generate.py --ckpt out/mdlm-distilled/ckpt.pt --prompt "Tom had a dog" --cached --entropy-bound 1
    python generate.py --ckpt out/mdlm-distilled/ckpt.pt --prompt "Tom had a dog" --temperature 1 --self-speculate 2
    python generate.py --ckpt out/mdlm-distilled/ckpt.pt --prompt "Tom had a dog" --temperature 1 --self-speculate 8 \
        --draft out/ar-student-draft/ckpt.pt
    python generate.py --ckpt out/ar-tiny/ckpt.pt --prompt "Tom had a dog" --temperature 0 --json
    python generate.py --ckpt out/ar-tiny/ckpt.pt --method spec --draft out/ar-draft/ckpt.pt --k 4 \
        --prompt "Tom had a dog"

The method follows the checkpoint: `diffusion` for a masked-diffusion LM (the canvas starts
all-MASK and fills in; on a terminal you watch it happen), `ar` for an autoregressive one (dense,
or ar-moe with float or FP4 experts: every method below decodes it as a target);
`spec` decodes an AR target with a small AR draft proposing k tokens per target forward
(lossless: the same distribution as `ar`); `ssd` is `spec` with the draft running ahead in a
second thread, pre-drafting the next round for likely outcomes while the target verifies;
`dflash` drafts a whole block per forward with a block-diffusion drafter trained by
`train.py --model dflash`; `ddtree` turns that one drafter pass into a tree of the likeliest
continuations (--budget nodes) and verifies the whole tree in one target forward; `eagle3` drafts
with an EAGLE-3 head (`train.py --model eagle3`), a chain of --k tokens or, with --budget, a tree.
vLLM's spelling works too:
    --speculative-config '{"method": "draft_model", "model": "out/ar-draft/ckpt.pt", "num_speculative_tokens": 4}'
    --speculative-config '{"method": "dflash", "model": "out/dflash-tiny/ckpt.pt"}'

The prompt is encoded as plain text after an EOT token (every training story follows one, so
EOT is how a model knows a story starts). Text goes to stdout, stats to stderr; with --json one
object {"text", "prompt_ids", "ids", "stats"} goes to stdout instead.
"""
import json
import shutil
import sys

import torch

from tinydiff.ar import ar_generate
from tinydiff.checks import BLOCK, COUNT, COUNT_OR_NONE, MASS, NATS, POSITIVE, PROBABILITY, SEED, TEMPERATURE, UserError
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash import RULES, dflash_generate
from tinydiff.dmoe import MOE_KINDS, moe_stats, reset_stats, routing_from_flags
from tinydiff.eagle3 import eagle_generate
from tinydiff.extras.ddtree_sampled import ddtree_sampled_generate
from tinydiff.extras.drafted_diffusion import ar_drafted_generate
from tinydiff.extras.self_speculative import ORDERS, self_speculative_generate
from tinydiff.fast.compiled import StaticModel, compile_seconds, hot_steps, wrap
from tinydiff.fast.fused_ddtree import FusedDDTree, fused_ddtree_generate
from tinydiff.fast.fused_dflash import FusedDFlash, fused_dflash_generate, static_pair
from tinydiff.fast.fused_round import PREFILL_CHUNK, fused_speculation, fused_speculative_generate
from tinydiff.fast.fused_steps import FusedSteps, multi_step_generate
from tinydiff.io.checkpoint import AR_KINDS, DIFFUSION_KINDS, drafter_from, head_from, load_checkpoint, load_model
from tinydiff.io.cli import add_compile, add_device, check_device, given_flags, make_parser, run_main
from tinydiff.sampler import REMASKING, generate, generate_cached
from tinydiff.speculative import speculative_generate
from tinydiff.ssd import ssd_generate
from tinydiff.tokenizer import EOT, Tokenizer

AR_FAMILY = ("ar", "spec", "ssd", "dflash", "ddtree", "eagle3")
# method -> checkpoint kinds it decodes (the AR family: a dense or MoE target, its experts float or FP4)
METHODS = {**{method: AR_KINDS for method in AR_FAMILY}, "diffusion": DIFFUSION_KINDS}
DRAFTER_KINDS = {"dflash": "dflash", "ddtree": "dflash", "eagle3": "eagle3"}  # method -> its --drafter's kind
DIFFUSION_FLAGS = ("gen_length", "steps", "block_length", "remasking", "threshold", "entropy_bound", "revise",
                   "self_speculate", "cached", "no_animate", "routing", "route_threshold", "route_guard",
                   "route_mask_vote")
# flag -> the methods that read it; a flag given to another method is an error, never ignored
USED_BY = {"max_new_tokens": AR_FAMILY, "top_k": AR_FAMILY, "top_p": AR_FAMILY, "draft": ("spec", "ssd", "diffusion"),
           "k": ("spec", "ssd", "eagle3"), "fan_out": ("ssd",), "drafter": ("dflash", "ddtree", "eagle3"),
           "block_size": ("dflash", "ddtree"), "budget": ("ddtree", "eagle3"), "branch": ("eagle3",),
           "rule": ("dflash", "ddtree"), "min_confidence": ("dflash",),
           "compile": ("ar", "spec", "dflash", "ddtree", "eagle3", "diffusion"),
           **{key: ("diffusion",) for key in DIFFUSION_FLAGS}}


def fan_out(text: str):
    """'3' -> 3 (every accepted count); '0,0,0,0,1' -> [0, 0, 0, 0, 1] (one count per accepted 0..k)."""
    return [COUNT_OR_NONE(f) for f in text.split(",")] if "," in text else COUNT_OR_NONE(text)


def parse_args(argv=None):
    p = make_parser("python generate.py", __doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py")
    p.add_argument("--prompt", required=True, help="the story's opening")
    p.add_argument("--method", choices=sorted(METHODS), help="default: the checkpoint's own")
    p.add_argument("--seed", type=SEED, default=1337, help="seeds every random choice: same seed, same output")
    add_device(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--temperature", type=TEMPERATURE, help="0 = greedy (default: 0.8 for ar, 0 for diffusion)")
    add_compile(p, "; the same tokens, compile time apart in the stats (diffusion: with --cached)")
    ar = p.add_argument_group("ar")
    ar.add_argument("--max-new-tokens", type=COUNT, help="default: until the story ends or the context is full")
    ar.add_argument("--top-k", type=COUNT_OR_NONE, default=50, help="sample among the k likeliest tokens (0 = all)")
    ar.add_argument("--top-p", type=MASS, help="nucleus sampling mass")
    spec = p.add_argument_group("spec (speculative decoding of an AR target)")
    spec.add_argument("--draft", help="AR draft checkpoint (same tokenizer, e.g. trained with --preset draft); for a "
                      "diffusion model with --self-speculate, the draft that proposes its positions left to right "
                      "(train.py --model ar --target DIFFUSION_CKPT --regenerate N)")
    spec.add_argument("--k", type=COUNT, default=4, help="draft tokens proposed per target forward")
    spec.add_argument("--speculative-config", help="vLLM-style JSON: method, model, num_speculative_tokens")
    spec.add_argument("--fan-out", type=fan_out, default=3,
                      help="--method ssd: bonus tokens pre-drafted per accepted count, or k+1 counts "
                           "(0,0,0,0,1: only after all 4 drafts pass, the fastest on a CPU)")
    spec.add_argument("--drafter", help="--method dflash/ddtree: the DFlash drafter; --method eagle3: the EAGLE-3 head")
    spec.add_argument("--block-size", type=BLOCK, help="--method dflash/ddtree: block size (default: the drafter's)")
    spec.add_argument("--rule", choices=list(RULES), help="--method dflash: keep argmax drafts that match the "
                      "target's samples (match, the default) or sample them and apply the rejection rule (reject); "
                      "--method ddtree: a tree of the drafter's top guesses that follows the target's samples (match), "
                      "or of sampled children judged by recursive rejection sampling (reject, for T > 0)")
    spec.add_argument("--min-confidence", type=PROBABILITY, help="--method dflash: verify only the drafts before the "
                      "first one the drafter gives under this probability (DSpark's verify length)")
    spec.add_argument("--budget", type=COUNT, help="tree nodes verified per round (ddtree: default 32; eagle3: a tree "
                      "instead of a chain of --k)")
    spec.add_argument("--branch", type=COUNT, default=4, help="--method eagle3 with --budget: children per tree node")
    diff = p.add_argument_group("diffusion")
    diff.add_argument("--gen-length", type=COUNT, default=128, help="tokens on the canvas after the prompt")
    diff.add_argument("--steps", type=COUNT, help="forward passes in all (default: gen-length, one token per step)")
    diff.add_argument("--block-length", type=COUNT, default=32, help="blocks are filled left to right")
    diff.add_argument("--remasking", choices=REMASKING, default="low_confidence", help="which positions to commit")
    diff.add_argument("--threshold", type=MASS, help="commit every position at least this confident (parallel decoding)")
    diff.add_argument("--entropy-bound", type=NATS, help="commit the most confident run of positions whose entropies, "
                      "less the largest, sum to at most this many nats (EB-Sampler; parallel decoding)")
    diff.add_argument("--self-speculate", type=COUNT, help="draft this many positions a round from the model's own "
                      "distributions (or with --draft, by an AR draft) and verify them in one batched forward: one "
                      "token per step in the --remasking order (left_to_right, the default here, or low_entropy) "
                      "exactly, in fewer forwards (cached)")
    diff.add_argument("--revise", type=COUNT_OR_NONE, default=0, help="self-correction steps per block (re-predict the least confident)")
    diff.add_argument("--cached", action="store_true", help="block-causal attention with a KV cache of finished blocks")
    diff.add_argument("--no-animate", action="store_true", help="do not draw the canvas as it fills in")
    moe = p.add_argument_group("mdlm-moe checkpoints (an ar-moe routes by token, as saved)")
    moe.add_argument("--routing", choices=["token", "block"], help="expert routing (default: the checkpoint's)")
    moe.add_argument("--route-threshold", type=MASS, help="block routing: coreset mass")
    moe.add_argument("--route-guard", type=COUNT, help="block routing: at least this many experts")
    moe.add_argument("--route-mask-vote", type=POSITIVE,
                     help="block routing: a MASK token's vote, against a committed token's 1")
    args = p.parse_args(argv)
    args.given = given_flags(p, argv)
    return args


def check_flags_apply(args, method: str):
    """Every flag given is one `method` reads."""
    stray = sorted(key for key in args.given if method not in USED_BY.get(key, (method,)))
    if stray:
        names = ", ".join("--" + key.replace("_", "-") for key in stray)
        raise UserError(f"{names} do{'es' if len(stray) == 1 else ''} not apply to --method {method}; drop "
                        f"{'it' if len(stray) == 1 else 'them'}")


class CanvasView:
    """Redraws the canvas in place as the sampler commits tokens (masks show as placeholders)."""

    def __init__(self, tokenizer, prompt_text: str, prompt_len: int):
        self.tokenizer, self.prompt_text, self.prompt_len = tokenizer, prompt_text, prompt_len
        self.width = shutil.get_terminal_size().columns
        self.lines = 0

    def __call__(self, event):
        self.clear()
        text = self.prompt_text + self.tokenizer.decode(event["canvas"][self.prompt_len:].tolist())
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        self.lines = sum(max(1, -(-len(line) // self.width)) for line in text.split("\n"))

    def clear(self):
        if self.lines:  # cursor up to the frame's first line, erase to the end of the screen
            sys.stdout.write(f"\x1b[{self.lines}F\x1b[J")
            self.lines = 0


def apply_speculative_config(args):
    """Fold a vLLM-style --speculative-config into --method / --draft or --drafter / --k or --block-size."""
    try:
        config = json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise UserError(f"--speculative-config is not valid JSON ({e.msg}); e.g. "
                        '\'{"method": "draft_model", "model": "out/ar-draft/ckpt.pt", "num_speculative_tokens": 4}\'') from None
    if (not isinstance(config, dict) or config.get("method") not in ("draft_model", "dflash")
            or not isinstance(config.get("model"), str) or not config["model"]):
        raise UserError('--speculative-config needs {"method": "draft_model" or "dflash", "model": PATH, ...}')
    n = config.get("num_speculative_tokens")
    if n is not None:
        COUNT.check("--speculative-config's num_speculative_tokens", n)
    if config["method"] == "dflash":
        args.method, args.drafter = "dflash", config["model"]
        args.block_size = args.block_size if n is None else n + 1  # n drafts fill a block of n + 1
    else:
        if args.draft and args.draft != config["model"]:
            raise UserError("--draft and --speculative-config name different drafts; pass one of them")
        args.method, args.draft, args.k = "spec", config["model"], args.k if n is None else n


def run_speculative(model, prompt, args, generator, warping):
    if args.method in ("spec", "ssd"):
        if not args.draft:
            raise UserError(f"--method {args.method} needs --draft DRAFT_CKPT (an AR model with the same tokenizer)")
        draft, _ = load_model(args.draft, args.device, kinds=("ar",))
        if args.method == "spec" and args.compile:  # each round one graph (fused_round.py), the plain draft
            # as the subset of every id (frequent_vocab.every_id): the same tokens
            fused = fused_speculation(model, draft, args.k, args.compile)
            args.compiled_models = [fused]
            return fused_speculative_generate(fused, prompt, args.max_new_tokens, *warping, generator)
        if args.method == "spec":
            return speculative_generate(model, draft, prompt, args.max_new_tokens, args.k, *warping, generator)
        if args.device == "cpu":
            torch.set_num_threads(1)  # the draft's thread and the target's each get one core
        return ssd_generate(model, draft, prompt, args.max_new_tokens, args.k, args.fan_out, *warping, generator,
                            threaded=True)
    kind = DRAFTER_KINDS[args.method]
    if not args.drafter:
        raise UserError(f"--method {args.method} needs --drafter DRAFTER_CKPT (trained with train.py --model {kind})")
    drafter_ckpt = load_checkpoint(args.drafter)
    if drafter_ckpt["kind"] != kind:
        raise UserError(f"{args.drafter} holds a {drafter_ckpt['kind']} model, not a {kind} drafter")
    if args.method == "eagle3":
        head = head_from(drafter_ckpt, model, args.drafter)
        (model,) = compiled(args, "eagle3", target=model, k=args.k, budget=args.budget)
        return eagle_generate(model, head, prompt, args.max_new_tokens, args.k, args.budget, args.branch, *warping,
                              generator)
    drafter = drafter_from(drafter_ckpt, model, args.drafter)
    block_size = args.block_size or drafter.config.block_size
    if args.method == "ddtree":
        budget = 32 if args.budget is None else args.budget
        if args.compile and args.rule != "reject" and drafter.markov is None:  # each round one graph (fused_ddtree.py)
            fused = FusedDDTree(*static_pair(model, drafter, args.compile), budget, block_size, args.compile)
            args.compiled_models = [fused]
            return fused_ddtree_generate(fused, prompt, args.max_new_tokens, *warping, generator)
        model, drafter = compiled(args, "ddtree", target=model, drafter=drafter, block_size=block_size, budget=budget)
        decode = ddtree_sampled_generate if args.rule == "reject" else ddtree_generate
        return decode(model, drafter, prompt, args.max_new_tokens, args.block_size, budget, *warping, generator)
    if args.compile and args.min_confidence is None:  # each round one graph (fused_dflash.py)
        fused = FusedDFlash(*static_pair(model, drafter, args.compile), block_size, args.compile)
        args.compiled_models = [fused]
        return fused_dflash_generate(fused, prompt, args.max_new_tokens, *warping, generator, rule=args.rule or "match")
    model, drafter = compiled(args, "dflash", target=model, drafter=drafter, block_size=block_size)
    return dflash_generate(model, drafter, prompt, args.max_new_tokens, args.block_size, *warping, generator,
                           rule=args.rule or "match", min_confidence=args.min_confidence)


def compiled(args, method, k=4, block_size=16, budget=None, block_length=32, shift=0, **models):
    """The models (target=..., draft=..., drafter=...) as the method's loop reads them: wrapped for
    compiled static decoding with --compile (tinydiff/fast/compiled.py), else as they are."""
    if not args.compile:
        return tuple(models.values())
    hot = hot_steps(method, k=k, block_size=block_size, budget=budget, block_length=block_length, shift=shift)
    args.compiled_models = list(wrap(models, hot, args.compile).values())
    return tuple(args.compiled_models)


def run_self_speculative(model, prompt, args, generator, callback):
    """--self-speculate K: the cached sampler one token per step, K positions drafted a round (self_speculative.py)."""
    clash = [flag for flag, value in (("--threshold", args.threshold), ("--entropy-bound", args.entropy_bound),
                                      ("--revise", args.revise), ("--compile", args.compile)) if value]
    if args.steps not in (None, args.gen_length):
        clash.append("--steps")
    if clash:
        raise UserError(f"--self-speculate samples one token per step exactly (cached, eager); drop {', '.join(clash)}")
    order = args.remasking if "remasking" in args.given else "left_to_right"
    if args.draft:  # an AR draft proposes the positions (drafted_diffusion.py)
        if order != "left_to_right":
            raise UserError("--draft proposes the positions left to right, as an AR model reads: drop --remasking")
        draft, _ = load_model(args.draft, args.device, kinds=("ar",))
        return ar_drafted_generate(model, draft, prompt, args.gen_length, args.block_length, args.temperature,
                                   args.self_speculate, generator, on_round=callback)
    if order not in ORDERS:
        raise UserError(f"--self-speculate commits in an order chosen before the draw: pass --remasking "
                        f"{' or '.join(ORDERS)}, not {order}")
    return self_speculative_generate(model, prompt, args.gen_length, args.block_length, args.temperature, order,
                                     args.self_speculate, generator, on_round=callback)


def run_diffusion(model, prompt, args, generator, callback):
    if args.draft and not args.self_speculate:
        raise UserError("--draft proposes the positions of --self-speculate K for a diffusion model: add it")
    if args.self_speculate:
        return run_self_speculative(model, prompt, args, generator, callback)
    steps = args.gen_length if args.steps is None else args.steps
    common = dict(temperature=args.temperature, remasking=args.remasking, threshold=args.threshold,
                  entropy_bound=args.entropy_bound, generator=generator, callback=callback)
    if args.cached:
        if args.revise:
            raise UserError("--revise works with the uncached sampler only; drop --cached or --revise")
        (model,) = compiled(args, "diffusion-cached", target=model, block_length=args.block_length,
                            shift=int(model.config.shift))
        return generate_cached(model, prompt, args.gen_length, steps, args.block_length, **common)
    return generate(model, prompt, args.gen_length, steps, args.block_length, revise=args.revise, **common)


NAMES = {"tau": "tau (tokens per round)"}  # a round is one verify forward; the prompt's prefill is not one


def stats_line(stats: dict) -> str:
    """One line of stats; what does not apply to this method (None: a tree's alpha) is left out."""
    def shown(v):
        if isinstance(v, list):
            return "[" + ", ".join("-" if x is None else shown(x) for x in v) + "]"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return " | ".join(f"{NAMES.get(k, k)} {shown(v)}" for k, v in stats.items() if v is not None)


def main(argv=None):
    args = parse_args(argv)
    check_device(args.device)
    if args.speculative_config:
        apply_speculative_config(args)
    tokenizer = Tokenizer()
    model, ckpt = load_model(args.ckpt, args.device, kinds=sum(METHODS.values(), ()))
    method = args.method or next(m for m, kinds in METHODS.items() if ckpt["kind"] in kinds)
    if ckpt["kind"] not in METHODS[method]:
        raise UserError(f"--method {method} needs a {' or '.join(METHODS[method])} checkpoint; "
                        f"{args.ckpt} holds a {ckpt['kind']} model")
    check_flags_apply(args, method)
    routing_from_flags(model, ckpt["kind"], args.ckpt, args.routing, args.route_threshold, args.route_guard,
                       args.route_mask_vote)  # the saved expert routing unless a flag says otherwise
    moe = ckpt["kind"] in MOE_KINDS
    if args.compile and moe:
        raise UserError("--compile does not cover mixture-of-experts checkpoints (their routing has no fixed "
                        "shapes); drop --compile")
    if args.compile and method == "diffusion" and not args.cached:
        raise UserError("--compile decodes diffusion with the cached sampler: add --cached")
    if not args.prompt.strip():
        raise UserError("the prompt is empty; pass some text, e.g. --prompt 'Once upon a time'")
    prompt = [EOT] + tokenizer.encode(args.prompt)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    if moe:
        reset_stats(model)
    if method != "diffusion":
        args.temperature = 0.8 if args.temperature is None else args.temperature
        warping = (args.temperature, args.top_k or None, args.top_p)
        args.method = method
        if method == "ar" and args.compile:  # each step and its draw one graph (fused_steps.py)
            fused = FusedSteps(StaticModel(model, (PREFILL_CHUNK,), args.compile), 1, args.compile)
            args.compiled_models = [fused]
            ids, result = multi_step_generate(fused, prompt, args.max_new_tokens, *warping, generator)
        elif method == "ar":
            ids, result = ar_generate(model, prompt, args.max_new_tokens, *warping, generator)
        else:
            ids, result = run_speculative(model, prompt, args, generator, warping)
    else:
        args.temperature = 0.0 if args.temperature is None else args.temperature
        animate = sys.stdout.isatty() and not (args.no_animate or args.json)
        view = CanvasView(tokenizer, args.prompt, len(prompt)) if animate else None
        ids, result = run_diffusion(model, prompt, args, generator, view)
        if view:
            view.clear()  # the final text, cut at the story's end, replaces the last frame
    stats = result.row() | (moe_stats(model) if moe else {})
    if args.compile:  # seconds (and tokens_per_s) include it: the first call of each step compiles it
        stats["compile_seconds"] = compile_seconds(args.compiled_models)
    story = ids[:ids.index(EOT)] if EOT in ids else ids  # a story ends at its first EOT
    text = args.prompt + tokenizer.decode(story)
    if args.json:
        print(json.dumps({"text": text, "prompt_ids": prompt, "ids": ids, "stats": stats}))
    else:
        print(text)
        print(stats_line(stats), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_main(main))
