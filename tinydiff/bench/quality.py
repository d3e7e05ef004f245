"""`python -m tinydiff.bench.quality`: how good are the samples? Generative perplexity and distinct-2.

    python -m tinydiff.bench.quality --judge out/ar-13m/ckpt.pt --mdlm out/mdlm-13m/ckpt.pt --samples 64
    python -m tinydiff.bench.quality --judge J --mdlm TEACHER --student STUDENT --ar AR --draft DRAFT --curve \
        --plot docs/plots/parallel_curve.png

Each sampler writes `--samples` stories from the same start (EOT, then nothing: unconditional)
with seeds 0..N-1, scored by tinydiff/tools/judge.py (generative perplexity under the --judge AR model,
with a 95% bootstrap interval, and distinct-2). `--student` is a diffusion LM distilled for
parallel decoding (train.py --distill); its samplers and the `diffusion-cached`/`-entropy` ones
run the cached block sampler, the schedule distillation trains for.
`--curve` (tinydiff/bench/curve.py) instead measures tokens per forward against quality for the
diffusion LMs at one token per step, each --thresholds value and each --entropy-bounds value (and
--ltr-bounds / --low-entropy-bounds: the same bound in another commit order; --self-spec-drafts:
the left-to-right sampler made lossless-parallel, tinydiff/extras/self_speculative.py), beside
AR decoding and, with --draft, AR + speculative decoding; then AUP per curve and, with --data,
each setting's agreement with the teacher's greedy one-token-per-step text.
"""
import json
import sys
from importlib.util import find_spec

from tinydiff.ar import ar_generate
from tinydiff.bench.curve import agreement, curve_aups, curve_rows, greedy_texts, plot_curve
from tinydiff.bench.moe_stats import routing_from_flags
from tinydiff.checks import COUNT, MASS, NATS, POSITIVE, TEMPERATURE, Rule, UserError, number_list
from tinydiff.data import load_tokens
from tinydiff.dmoe import ROUTINGS
from tinydiff.extras.drafted_diffusion import ar_drafted_generate
from tinydiff.extras.regenerate import story_openings
from tinydiff.extras.self_correction import generate_revising
from tinydiff.extras.self_speculative import self_speculative_generate
from tinydiff.io.checkpoint import AR_KINDS, DIFFUSION_KINDS, load_model
from tinydiff.io.cli import add_device, check_device, flag, given_flags, make_parser, run_main
from tinydiff.io.files import check_output
from tinydiff.io.tokens import prepare_tokens
from tinydiff.sampler import generate, generate_cached
from tinydiff.tokenizer import EOT, Tokenizer
from tinydiff.tools.eval import SAMPLES
from tinydiff.tools.judge import sample_and_judge

# Self-correction steps per block: each one a forward of the whole canvas, so a count is a run's length; past a
# block's largest size (1,024 positions) it is a typo.
REVISE = Rule(integer=True, lo=0, hi=1024)


def cached(key: str, remasking="low_confidence", **rule):
    """A sampler entry: the cached block sampler on models[key], with a commit rule read from args."""
    def sample(m, p, a, g):
        options = {name: getattr(a, flag) for name, flag in rule.items()}
        return generate_cached(m, p, a.gen_length, a.gen_length, a.block_length, a.temperature, remasking,
                               generator=g, **options)
    return key, sample


SAMPLERS = {  # name -> (model key or keys, sampling function(model(s), prompt, args, generator) -> (ids, stats))
    "ar": ("ar", lambda m, p, a, g: ar_generate(m, p, a.gen_length, a.temperature, generator=g)),
    "diffusion": ("mdlm", lambda m, p, a, g: generate(m, p, a.gen_length, a.gen_length, a.block_length,
                                                      a.temperature, generator=g)),
    "diffusion-threshold": ("mdlm", lambda m, p, a, g: generate(m, p, a.gen_length, a.gen_length, a.block_length,
                                                                a.temperature, threshold=a.threshold, generator=g)),
    "diffusion-revise": ("mdlm", lambda m, p, a, g: generate_revising(m, p, a.gen_length, a.gen_length,
                                                                      a.block_length, a.revise, a.temperature,
                                                                      generator=g)),
    "diffusion-cached": cached("mdlm"),
    "diffusion-entropy": cached("mdlm", entropy_bound="entropy_bound"),
    "distilled": cached("student"),
    "distilled-threshold": cached("student", threshold="threshold"),
    "distilled-entropy": cached("student", entropy_bound="entropy_bound"),
    "distilled-low-entropy": cached("student", "low_entropy", entropy_bound="entropy_bound"),
    "distilled-self-spec": ("student", lambda m, p, a, g: self_speculative_generate(
        m, p, a.gen_length, a.block_length, a.temperature, "left_to_right", a.draft_positions, generator=g)),
    "distilled-ar-drafted": (("student", "student_draft"), lambda m, d, p, a, g: ar_drafted_generate(
        m, d, p, a.gen_length, a.block_length, a.temperature, a.draft_positions, generator=g)),
}


def parse_args(argv=None):
    p = make_parser("python -m tinydiff.bench.quality", "Sample quality of every sampler: generative perplexity and distinct-2.")
    p.add_argument("--judge", required=True, help="AR checkpoint that scores the samples")
    p.add_argument("--mdlm", help="diffusion LM checkpoint, dense or MoE (its samplers are skipped without it)")
    p.add_argument("--student", help="diffusion LM distilled for parallel decoding (train.py --distill)")
    p.add_argument("--student-draft", help="an AR draft for --student, trained on its stories (train.py --model ar "
                   "--target STUDENT --regenerate N): distilled-ar-drafted and --ar-drafted-drafts")
    p.add_argument("--routing", choices=ROUTINGS, help="expert routing of an mdlm-moe --mdlm (default: its own)")
    p.add_argument("--route-guard", type=COUNT, help="block routing: at least this many experts (default: its own)")
    p.add_argument("--route-threshold", type=MASS, help="block routing: coreset mass (default: its own)")
    p.add_argument("--route-mask-vote", type=POSITIVE, help="block routing: a MASK token's vote, against a "
                   "committed token's 1 (default: its own)")
    p.add_argument("--ar", help="AR checkpoint (ar or ar-moe) to sample from as a baseline (skipped without it)")
    p.add_argument("--draft", help="with --curve and --ar: an AR draft for the speculative point")
    p.add_argument("--k", type=COUNT, default=4, help="draft tokens per round for the speculative point")
    p.add_argument("--samples", type=SAMPLES, default=64, help="stories per sampler")
    p.add_argument("--gen-length", type=COUNT, default=64, help="tokens per sample")
    p.add_argument("--block-length", type=COUNT, default=32, help="the diffusion samplers fill blocks of this many tokens left to right")
    p.add_argument("--temperature", type=TEMPERATURE, default=1.0, help="sampling temperature of every sampler")
    p.add_argument("--threshold", type=MASS, default=0.9, help="for the *-threshold samplers")
    p.add_argument("--entropy-bound", type=NATS, default=0.1, help="nats, for the *-entropy samplers: commit the "
                   "most confident run with sum(H) - max(H) under it (EB-Sampler)")
    p.add_argument("--draft-positions", type=COUNT, default=2, help="for distilled-self-spec and distilled-ar-drafted: "
                   "positions drafted a round (from the model's own distributions, or by --student-draft), verified by "
                   "one batched forward (lossless)")
    p.add_argument("--revise", type=REVISE, default=4, help="self-correction steps per block, for diffusion-revise")
    p.add_argument("--samplers", default=",".join(SAMPLERS), help=f"comma list from: {', '.join(SAMPLERS)}")
    curve = p.add_argument_group("--curve: tokens per forward against quality")
    curve.add_argument("--curve", action="store_true", help="measure the curve instead of the --samplers table")
    curve.add_argument("--thresholds", type=number_list(MASS), default=[0.9, 0.7, 0.5, 0.3], help="comma list")
    curve.add_argument("--entropy-bounds", type=number_list(NATS), default=[0.1, 0.5, 1.0, 2.0], help="comma list, nats")
    curve.add_argument("--ltr-bounds", type=number_list(NATS), default=[], help="comma list, nats: entropy bounds "
                       "over the run of positions right after the committed text (remasking left_to_right)")
    curve.add_argument("--low-entropy-bounds", type=number_list(NATS), default=[], help="comma list, nats: entropy "
                       "bounds over the lowest-entropy positions (remasking low_entropy: fair samples, not modes)")
    curve.add_argument("--self-spec-drafts", type=number_list(COUNT), default=[], help="comma list: self-speculative "
                       "points, left to right one token per step exactly, this many positions drafted a round")
    curve.add_argument("--ar-drafted-drafts", type=number_list(COUNT), default=[], help="comma list: the same, the "
                       "positions drafted by --student-draft (an AR draft)")
    curve.add_argument("--data", help="TinyStories-format file: T = 0 agreement on 32 openings of its validation split")
    curve.add_argument("--plot", help="write the curve as a PNG here (needs matplotlib)")
    curve.add_argument("--json", help="write the curve's rows as JSON here")
    curve.add_argument("--reuse", nargs="+", metavar="JSON", help="--json files of earlier curves with the same "
                       "sampling settings: their points of the same model, setting and checkpoint are not sampled again")
    add_device(p)
    args = p.parse_args(argv)
    args.given = given_flags(p, argv)
    args.curve_only = [a.dest for a in curve._group_actions if a.dest != "curve"]  # what only --curve reads
    return args


def load_models(args) -> tuple[dict, str]:
    """The models to sample (and the routing note of a MoE --mdlm)."""
    models, routing = {}, ""
    for key in ("mdlm", "student"):
        if getattr(args, key):
            models[key], ckpt = load_model(getattr(args, key), args.device, kinds=DIFFUSION_KINDS)
            if key == "mdlm":
                config = routing_from_flags(models[key], ckpt["kind"], args.mdlm, args.routing, args.route_threshold,
                                            args.route_guard, args.route_mask_vote)
                if config is not None:
                    routing = f", {config.routing} expert routing"
                    if config.routing == "block":
                        routing += (f" (threshold {config.route_threshold}, guard {config.route_guard}, "
                                    f"mask vote {config.route_mask_vote:g})")
    for key in ("ar", "draft", "student_draft"):  # the AR baseline may be an ar-moe (float or FP4 experts); a
        # draft is dense
        if getattr(args, key):
            models[key], _ = load_model(getattr(args, key), args.device, kinds=AR_KINDS if key == "ar" else ("ar",))
    return models, routing


def check_args(args):
    check_device(args.device)
    if not (args.mdlm or args.ar or args.student):
        raise UserError("nothing to sample from; pass --mdlm, --student and/or --ar checkpoints")
    for dest in args.curve_only if not args.curve else ():
        if dest in args.given:
            raise UserError(f"{flag(dest)} is a --curve setting; add --curve or drop it")
    if args.draft and not (args.curve and args.ar):
        raise UserError("--draft adds the speculative point of --curve: pass --curve and --ar (its target)")
    if args.student_draft and not args.student:
        raise UserError("--student-draft drafts for --student: pass --student too")
    if args.ar_drafted_drafts and not args.student_draft:
        raise UserError("--ar-drafted-drafts needs --student-draft, the AR draft that proposes the positions")
    for key in ("json", "plot"):  # written at the end: a folder that is not there fails now, not then
        check_output(getattr(args, key), f"--{key}")
    if args.plot and find_spec("matplotlib") is None:  # before the minutes of sampling, not after
        raise UserError("--plot needs matplotlib: pip install -r requirements-plots.txt, or drop --plot")


def clamp_counts(args):
    """Draft counts no round can use, clamped where they enter, each said once: a speculative round drafts at
    most the gen_length - 1 tokens before its bonus, a diffusion round at most a block's positions. The clamped
    run writes what the count would have (the samplers clamp the same way inside): the same stories."""
    def clamped(name: str, value: int, most: int, what: str) -> int:
        if value > most and name[2:].replace("-", "_") in args.given:  # a default clamped says nothing
            print(f"notice: {name} {value} is more than {what}; drafting at most {most} a round", file=sys.stderr)
        return min(value, most)
    block = f"a block's {args.block_length} positions"
    args.k = clamped("--k", args.k, max(1, args.gen_length - 1),
                     f"the {max(1, args.gen_length - 1)} drafts a round of {args.gen_length} new tokens can use")
    args.draft_positions = clamped("--draft-positions", args.draft_positions, args.block_length, block)
    for dest in ("self_spec_drafts", "ar_drafted_drafts"):
        counts = getattr(args, dest)
        if any(k > args.block_length for k in counts):
            clamped(flag(dest), max(counts), args.block_length, block)
            setattr(args, dest, list(dict.fromkeys(min(k, args.block_length) for k in counts)))  # one point each


SAMPLING = ("samples", "gen_length", "block_length", "temperature", "judge")  # what makes two curve points comparable


def run_curve(args, models, judge):
    """--curve: the table, AUPs, agreement, plot and JSON (which --reuse reads back)."""
    if not ({"mdlm", "student"} & models.keys()):
        raise UserError("--curve compares diffusion LMs: pass --mdlm (the teacher) and/or --student")
    reused = []
    for path in args.reuse or ():
        try:
            with open(path) as f:
                old = json.load(f)
            differ = [key for key in SAMPLING if old[key] != getattr(args, key)]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--reuse {path} is not a curve written by --json ({e})") from None
        if differ:
            raise UserError(f"--reuse {path} was sampled with other {', '.join(differ)}; pass the same or drop it")
        reused += old["rows"]
    if args.data:  # read before the sampling: a bad file fails in seconds, not after the curve
        _, val_path = prepare_tokens(args.data)
        prompts = [[EOT] + o for o in story_openings(load_tokens(val_path), 32, 8, seed=0)]
    paths = {key: getattr(args, key) for key in ("mdlm", "student", "ar", "draft", "student_draft")}
    rows, reference, y_max = curve_rows(models, paths, judge, args, reused)
    if args.data:
        greedy = args.mdlm or args.student  # the teacher's text, or the student's own without one
        want = greedy_texts(models.get("mdlm", models.get("student")), prompts, args.gen_length, args.block_length)
        for r in rows:
            if r["model"] in ("teacher", "student") and r.get("agreement_with") != greedy:
                model = models["mdlm" if r["model"] == "teacher" else "student"]
                texts = greedy_texts(model, prompts, args.gen_length, args.block_length, r["rule"])
                r["agreement_t0"], r["agreement_with"] = agreement(want, texts), greedy
    print(f"{args.samples} samples x {args.gen_length} tokens, temperature {args.temperature}, blocks of "
          f"{args.block_length}, judge {args.judge}; y = 100 x min(1, ppl {reference['gen_ppl']:.2f} / ppl, "
          f"distinct-2 / {reference['distinct_2']:.3f}) against {reference['model']}, {reference['setting']}")
    print(f"{'model':<18}{'setting':<22}{'tok/fwd':>8}{'gen ppl':>9}{'95% interval':>18}{'distinct-2':>11}{'y':>7}"
          f"{'agree T=0':>10}")
    for r in rows:
        agree = f"{r['agreement_t0']:>10.3f}" if "agreement_t0" in r else f"{'-':>10}"
        interval = "[{:.2f}, {:.2f}]".format(*r["gen_ppl_95"])
        print(f"{r['model']:<18}{r['setting']:<22}{1 / r['forwards_per_token']:>8.2f}{r['gen_ppl']:>9.2f}"
              f"{interval:>18}{r['distinct_2']:>11.3f}{r['y']:>7.1f}{agree}")
    aups = curve_aups(rows, y_max)
    print("AUP (d3LLM; y_max {:.1f}): ".format(y_max) + " | ".join(f"{k} {v:.1f}" for k, v in aups.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{key: getattr(args, key) for key in SAMPLING}, "aup": aups, "y_max": y_max,
                       "rows": [{k: v for k, v in r.items() if k != "stories"} for r in rows]}, f, indent=2)
    if args.plot:
        plot_curve(rows, args.plot)
        print(f"plot: {args.plot}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    clamp_counts(args)
    wanted = [name.strip() for name in args.samplers.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in SAMPLERS]
    if unknown or not wanted:
        raise UserError(f"unknown sampler(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SAMPLERS)}")
    judge, _ = load_model(args.judge, args.device, kinds=("ar",))
    models, routing = load_models(args)
    if args.curve:
        return run_curve(args, models, judge)
    tokenizer = Tokenizer()
    rows = []
    for name in wanted:
        keys, sample = SAMPLERS[name]
        keys = (keys,) if isinstance(keys, str) else keys
        if not set(keys) <= models.keys():
            continue
        judged = sample_and_judge(lambda p, g: sample(*(models[k] for k in keys), p, args, g), judge, args.samples,
                                  args.device, name)
        rows.append({"sampler": name, **judged, "example": tokenizer.decode(judged["stories"][0]).replace("\n", " ")})
    print(f"{args.samples} samples x {args.gen_length} tokens, temperature {args.temperature}, judge {args.judge}{routing}")
    print(f"{'sampler':<22}{'fwd/token':>10}{'gen ppl':>10}{'95% interval':>18}{'distinct-2':>12}")
    for r in rows:
        interval = "[{:.2f}, {:.2f}]".format(*r["gen_ppl_95"])
        print(f"{r['sampler']:<22}{r['forwards_per_token']:>10.3f}{r['gen_ppl']:>10.2f}{interval:>18}"
              f"{r['distinct_2']:>12.3f}")
    for r in rows:
        print(f"\n{r['sampler']}: {r['example'][:400]}")
    return rows


if __name__ == "__main__":
    sys.exit(run_main(main))
