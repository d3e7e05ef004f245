"""`python -m tinydiff.bench`: every decoding method on the same prompts and checkpoints, one table.

    python -m tinydiff.bench --ckpt out/ar-tiny/ckpt.pt --mdlm out/mdlm-tiny/ckpt.pt --json bench.json

Each method decodes the same fixed story openings for the same number of new tokens (no stop at
EOT, so every method does the same work) after one untimed warm-up prompt. Columns:
  tokens_per_s               new tokens / wall seconds, over all prompts
  target_forwards_per_token  forward passes of the target model / new tokens
  tau                        new tokens per target forward, the prefill counted (1 for plain AR decoding)
  speedup_vs_ar              tokens_per_s / the `ar` row's tokens_per_s
  heldout_nll, heldout_bpb   with --data: nats/token and bits/byte on the file's validation
                             split; exact for the AR model, the ELBO bound for the diffusion LM
For the diffusion rows the "target" is the diffusion LM: one forward = one denoising step.
`diffusion` commits one token per step (LLaDA, blocks of 32), `diffusion-threshold` every token
at least 0.9 confident (Fast-dLLM), `diffusion-cached` is block-causal with a prefix KV cache,
`diffusion-entropy` that with an entropy bound (EB-Sampler, --entropy-bound nats).
`diffusion-distilled-t<threshold>` and `diffusion-distilled-entropy` decode the same way with the
--distilled model (train.py --distill): the threshold in the name, or the entropy bound;
`diffusion-distilled-low-entropy` commits the lowest-entropy positions under the bound instead of
the most confident (a fair sample of each position rather than its mode: sampler.py).
`diffusion-distilled-self-spec-k<k>` samples the distilled model one token per step left to right,
exactly, with k positions a round drafted from its own distributions and verified by one batched
forward (self_speculative.py; tau counts the batched forward once, the block's first forward too);
k = 1 is that sampler itself, one forward a token. `diffusion-distilled-ar-drafted-k<k>` samples the same,
the k positions drafted by an AR draft trained on the distilled model's stories (--distilled-draft;
drafted_diffusion.py): the draft reads the token it drafted before, where self-speculation cannot.
`dmoe-token` / `dmoe-block` decode like `diffusion-cached` with the MoE diffusion LM (--moe).
`dflash-b<B>` verifies by DFlash's rule (argmax drafts, kept while they match the target's samples),
`dflash-b16-reject` samples its drafts and applies the rejection rule (extras/dflash_reject.RULES): at T > 0
the second keeps a draft with probability min(1, p/q) instead of p(argmax). `-sched` verifies only
the drafts before the first the drafter gives under --min-confidence (DSpark's verify length).
Every speculative row adds a line: its accepted-length histogram (rounds that kept n drafts) and
its acceptance by slot (slot k kept given slots < k were: DSpark's per-position curve; for a tree,
the accepted path going one deeper). `--openings` decodes --prompts openings of held-out stories
(--data's validation split) instead of the fixed prompts.
Without --ckpt / --mdlm the models are untrained `tiny` ones: speeds are real, the text is noise.
`--html DIR` also writes DIR/<method>.html for every row that has steps or rounds to show: the page
(tinydiff/tools/replay.py) that replays that row's decode of the first prompt (`recording`).
`--report DIR` trains the missing models first and writes DIR/RESULTS.md and plots: tinydiff/bench/report.py
(`--temperatures T1,T2`: the speculative rows again at each temperature, tinydiff/bench/temperatures.py).
"""
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from tinydiff.bench.measure import (
    PROMPTS,
    device_name,
    heldout_nll,
    heldout_openings,
    load_models,
    measure,
    measure_interleaved,
)
from tinydiff.bench.methods import (
    FR_ROWS,
    METHODS,
    STEPS_ROWS,
    USES,
    block_of,
    compiled_models,
    draft_count,
    forward_seconds,
)
from tinydiff.bench.report import write_report
from tinydiff.bench.temperatures import parse_temperatures
from tinydiff.checks import COUNT, NATS, PROBABILITY, SEED, TEMPERATURE, UserError
from tinydiff.fast.compiled import compile_seconds
from tinydiff.io.cli import add_compile, add_device, check_device, flag, given_flags, make_parser
from tinydiff.io.files import check_output
from tinydiff.speculative import expected_tokens_per_round, leviathan_speedup
from tinydiff.tokenizer import EOT, Tokenizer
from tinydiff.tools.replay import Recorder, check_page_path


def parse_args(argv=None):
    p = make_parser("python -m tinydiff.bench", "Benchmark every decoding method on the same prompts.")
    p.add_argument("--ckpt", help="AR target checkpoint, ar or ar-moe (default: an untrained tiny model)")
    p.add_argument("--draft", help="AR draft checkpoint for the spec rows (default: an untrained draft model)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint trained for --ckpt (default: an untrained one)")
    p.add_argument("--eagle", help="EAGLE-3 head checkpoint trained for --ckpt (default: an untrained one)")
    p.add_argument("--moe", help="mixture-of-experts diffusion LM checkpoint (default: an untrained tiny one)")
    p.add_argument("--mdlm", help="masked-diffusion LM checkpoint (default: an untrained tiny model)")
    p.add_argument("--distilled", help="diffusion LM distilled for parallel decoding, train.py --distill "
                   "(default: an untrained tiny model)")
    p.add_argument("--distilled-draft", help="AR draft for --distilled, trained on its stories (train.py --model ar "
                   "--target DISTILLED --regenerate N), for the -ar-drafted rows (default: an untrained draft model)")
    p.add_argument("--entropy-bound", type=NATS, default=0.5, help="nats, for the *-entropy rows (EB-Sampler)")
    p.add_argument("--min-confidence", type=PROBABILITY, default=0.3, help="for the dflash-*-sched rows: verify "
                   "the drafts before the first one the drafter gives under this probability")
    p.add_argument("--data", help="TinyStories-format file: report held-out NLL on its validation split")
    p.add_argument("--draft-vocab", type=COUNT, default=4096, help="for the spec-*-fr rows (FR-Spec): the draft's "
                   "head scores only this many ids, the most frequent in --data's training split")
    p.add_argument("--methods", help=f"comma list from: {', '.join(METHODS)} (default: all but the ar-steps rows, "
                   "which pay only with --compile; the -fr rows only with --data, where they count their vocabulary)")
    p.add_argument("--new-tokens", type=COUNT, default=64, help="tokens generated per prompt")
    p.add_argument("--prompts", type=COUNT, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts "
                   "(with --openings or --report: how many held-out story openings)")
    p.add_argument("--openings", action="store_true", help="decode --prompts openings of held-out stories "
                   "(--data's validation split, 8 tokens each, as --report does) instead of the fixed prompts")
    p.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy, the same text for every method")
    p.add_argument("--seed", type=SEED, default=1337, help="seeds every random choice: same seed, same output")
    add_compile(p, ", compiled in the untimed warm-up; methods it does not cover run eagerly")
    p.add_argument("--interleave", action="store_true", help="time the methods prompt by prompt in turn (every "
                   "method decodes a prompt before the next prompt), so that a slow phase of a shared machine falls "
                   "on every method alike; the same tokens and counts")
    add_device(p)
    p.add_argument("--json", help="also write the table as JSON to this path")
    p.add_argument("--html", metavar="DIR", help="also write DIR/<method>.html, a page that replays the row's "
                   "decode of the first prompt step by step (rows with steps or rounds to show; an existing folder)")
    p.add_argument("--report", metavar="DIR", help="train the models not given (out/report-PRESET/), run the "
                   "methods on held-out story openings, write DIR/RESULTS.md and DIR/plots/")
    p.add_argument("--report-preset", default="tiny", help="with --report: smoke (a one-minute pipeline check), "
                   "tiny (under 30 CPU minutes) or 13m (a GPU)")
    p.add_argument("--temperatures", type=parse_temperatures, help="with --report: also run ar and every speculative "
                   "row at each of these temperatures, e.g. 0,0.8,1 (a section and plots/acceptance_by_slot.png)")
    args = p.parse_args(argv)
    args.given = given_flags(p, argv)
    return args


# A flag -> the rows that read it: given for none of the rows --methods runs, it would change nothing.
READ_BY = {"drafter": lambda m: m.startswith(("dflash-", "ddtree-")), "eagle": lambda m: m.startswith("eagle3-"),
           "moe": lambda m: m.startswith("dmoe-"), "distilled": lambda m: m.startswith("diffusion-distilled"),
           "mdlm": lambda m: m.startswith("diffusion") and not m.startswith("diffusion-distilled"),
           "distilled_draft": lambda m: "-ar-drafted" in m, "entropy_bound": lambda m: m.endswith("entropy"),
           "min_confidence": lambda m: m.endswith("-sched"), "draft_vocab": lambda m: m in FR_ROWS}


# Held-out openings (--openings, --report): each is decoded by every method, and drawn up front (8 tokens each);
# past this a count is a typo that would hold its openings in memory before the first decode.
OPENINGS = 10_000


def check_args(args) -> list[str]:
    """The methods to run; every flag checked before any model loads (a bad --json path included)."""
    if args.methods is None:
        args.methods = ",".join(m for m in METHODS if (args.data or m not in FR_ROWS) and m not in STEPS_ROWS
                                and not m.endswith("-fused"))  # one-graph twins: the same loop without --compile
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UserError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(METHODS)}")
    check_device(args.device)
    if FR_ROWS.intersection(methods) and not args.data:
        raise UserError("the -fr rows count the draft's vocabulary on --data's training split: add --data FILE")
    if args.openings and not args.data:
        raise UserError("--openings draws story openings from --data's validation split: add --data FILE")
    if args.prompts > len(PROMPTS) and not (args.report or args.openings):
        raise UserError(f"--prompts must lie in [1, {len(PROMPTS)}] (any count >= 1 with --openings or --report, "
                        f"which draw held-out story openings), got {args.prompts}")
    if args.prompts > OPENINGS:
        raise UserError(f"--prompts {args.prompts}: the bench decodes at most {OPENINGS:,} held-out openings (every "
                        f"method decodes each); pass at most {OPENINGS:,}")
    for dest, reads in READ_BY.items():
        if dest in args.given and not any(reads(m) for m in methods):
            raise UserError(f"{flag(dest)} is read by no row of --methods {','.join(methods)}; add a "
                            "row that reads it (python -m tinydiff.bench --help) or drop the flag")
    if "report_preset" in args.given and not args.report:
        raise UserError("--report-preset sizes the models --report trains: add --report DIR or drop it")
    if args.temperatures and not args.report:
        raise UserError("--temperatures adds a section to --report's RESULTS.md: add --report DIR (or run the bench "
                        "once per --temperature)")
    check_output(args.json, "--json")
    if args.html:
        check_pages(args.html, methods, args.report)
    return methods


def check_pages(folder, methods, report):
    """Before any work (--html): `folder` exists, is a writable folder and holds none of the pages this run
    writes (<method>.html for each method); a missing folder, a file or a page already there is refused."""
    if report:
        raise UserError("--html writes the pages of one bench run, --report runs several: drop one of them")
    if not os.path.isdir(folder):
        raise UserError(f"--html {folder} is {'a file' if os.path.exists(folder) else 'missing'}; pass an "
                        "existing folder (the bench writes <method>.html into it)")
    for method in methods:
        check_page_path(Path(folder) / f"{method}.html", "--html")


def recording(name: str, method, tokenizer, pages: dict):
    """`method` (a runner) with its first call recorded: the warm-up's first prompt, untimed, the very decode the
    timed first prompt repeats (the same prompt, models and seed, so the same tokens). args.record, the Recorder
    the runner hands its loop, is set for that call only; its page goes to --html DIR/<name>.html, and
    pages[name] is the path, or None where the loop reported nothing (ar: one token a forward)."""
    def run(models, prompt, args, generator):
        if name in pages:
            return method(models, prompt, args, generator)
        moe = models["moe"] if name.startswith("dmoe-") else None  # the page shows the experts each step read
        args.record = Recorder(name, tokenizer, prompt, tokenizer.decode(prompt[1:]), moe)  # prompt: EOT + text
        try:
            counts = method(models, prompt, args, generator)
        finally:
            recorder, args.record = args.record, None
        pages[name] = recorder.write(Path(args.html) / f"{name}.html") if recorder.steps else None
        return counts
    return run


def measure_rows(args, methods, models, prompts, tokenizer) -> tuple[list[dict], float]:
    """(one row per method, Leviathan's c): each method's totals over the prompts, with the columns
    derived from them (speedup over `ar`, Leviathan's prediction, the tree and SSD comparisons)."""
    nll = heldout_nll(models, args, tokenizer, sorted({USES.get(m, "mdlm") for m in methods})) if args.data else {}
    # Leviathan's c: a draft forward's cost over a target forward's, both one cached token.
    args.forward_costs = (forward_seconds(models["draft"], prompts[0], reps=16),
                          forward_seconds(models["target"], prompts[0], reps=16))
    c = args.forward_costs[0] / args.forward_costs[1]
    statics = {name: compiled_models(name, models, args) if args.compile else None for name in methods}
    args.pages = {}  # --html: method -> its page, or None
    runners = {name: recording(name, METHODS[name], tokenizer, args.pages) if args.html else METHODS[name]
               for name in methods}
    if args.interleave:  # every method decodes a prompt before the next prompt
        measured = measure_interleaved([(runners[name], statics[name] or models) for name in methods], prompts, args)
    else:
        measured = [measure(runners[name], statics[name] or models, prompts, args)
                    for name in tqdm(methods, desc="bench", unit="method", file=sys.stderr)]
    rows = []
    for name, row in zip(methods, measured):
        nll_row, bpb_row = nll.get(USES.get(name, "mdlm"), (None, None))
        static = statics[name]
        rows.append({"method": name, **row, "heldout_nll": nll_row, "heldout_bpb": bpb_row,
                     "compiled": static is not None,
                     "compile_seconds": compile_seconds(static.values()) if static else None})
    ar_speed = next((r["tokens_per_s"] for r in rows if r["method"] == "ar"), None)
    dflash = next((r["tokens_per_s"] for r in rows if r["method"] == "dflash-b16"), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar_speed if ar_speed else None
        if "nodes_per_round" in row and dflash:
            row["speedup_vs_dflash"] = row["tokens_per_s"] / dflash
        if row["method"].startswith("spec-") and row.get("alpha") is not None:
            k = draft_count(row["method"])
            row["predicted_speedup"] = leviathan_speedup(row["alpha"], k, c)
            if ar_speed and "seconds_per_draft" in row:  # the same formula, each cost in `ar` steps as the loop paid it
                row["loop_c"], row["loop_v"] = row["seconds_per_draft"] * ar_speed, row["seconds_per_verify"] * ar_speed
                row["predicted_at_loop_costs"] = (expected_tokens_per_round(row["alpha"], k)
                                                  / (k * row["loop_c"] + row["loop_v"]))
    return rows, c


def print_table(rows: list[dict], c: float):
    """The table, the formulas behind its columns, and each row's extra lines (loop costs, trees, SSD, dMoE)."""
    print(f"{'method':<22}{'tokens/s':>10}{'target fwd/token':>18}{'tau':>7}{'speedup vs ar':>15}"
          f"{'heldout nll':>13}{'bits/byte':>11}{'alpha':>7}{'Leviathan':>11}{'loop costs':>12}")
    for r in rows:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        quality = (f"{r['heldout_nll']:>13.3f}{r['heldout_bpb']:>11.3f}" if r["heldout_nll"] is not None
                   else f"{'-':>13}{'-':>11}")
        alpha = f"{r['alpha']:>7.2f}" if r.get("alpha") is not None else f"{'-':>7}"
        predicted = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"
        costed = f"{r['predicted_at_loop_costs']:.2f}x" if "predicted_at_loop_costs" in r else "-"
        print(f"{r['method']:<22}{r['tokens_per_s']:>10.1f}{r['target_forwards_per_token']:>18.3f}"
              f"{r['tau']:>7.2f}{speedup:>15}{quality}{alpha}{predicted:>11}{costed:>12}")
    print("tau: new tokens per target forward (bonus included, the prefill counted); alpha: accepted / judged "
          "drafts (a round judges its drafts up to the first rejection)")
    print(f"c (draft / target forward cost) = {c:.3f}; Leviathan = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)); "
          "loop costs: the same with c and the verify's 1 replaced by what one draft and one verify "
          "took inside the loop, in `ar` decoding steps")
    for r in rows:
        if r.get("compiled"):
            print(f"{r['method']}: compiled, {r['compile_seconds']:.1f} s compiling in the untimed warm-up")
        elif r.get("compiled") is False and any(row.get("compiled") for row in rows):
            print(f"{r['method']}: eager (--compile does not cover it)")
        if "loop_c" in r:
            print(f"{r['method']}: one draft {r['loop_c']:.2f}, one verify {r['loop_v']:.2f} `ar` steps")
        if "us_per_round" in r:
            print(f"{r['method']}: per round " + ", ".join(f"{us:.0f} us {part}" for part, us in r["us_per_round"].items()))
    spec4 = next((r["tokens_per_s"] for r in rows if r["method"] == "spec-k4"), None)
    for r in rows:
        if "hit_rate" in r:
            measured = f"{r['tokens_per_s'] / spec4:.2f}x spec-k4 measured, " if spec4 else ""
            print(f"{r['method']}: hit rate {r['hit_rate']:.2f}, {measured}"
                  f"{r['modelled_speedup_vs_spec']:.2f}x modelled with the draft on its own device")
        if r.get("acceptance_by_slot"):
            slots = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_slot"])
            print(f"{r['method']}: accepted lengths {r['accepted_hist']} | acceptance by slot {slots}")
        if "canvases_per_token" in r:
            print(f"{r['method']}: {r['canvases_per_token']:.2f} canvases run per token (a batched forward is one forward)")
        if "nodes_per_round" in r:
            versus = f", {r['speedup_vs_dflash']:.2f}x dflash-b16's tokens/s" if "speedup_vs_dflash" in r else ""
            print(f"{r['method']}: {r['nodes_per_round']:.1f} tree nodes verified per target forward{versus}")
        if "unique_experts_per_block" in r:
            print(f"{r['method']}: {r['unique_experts_per_block']:.1f} unique experts per 32-token block, "
                  f"{r['expert_bytes_per_forward'] / 1e6:.2f} MB of expert weights per forward, "
                  f"{1e3 * r['moe_seconds_per_forward']:.1f} ms in MoE layers per forward")


def check_room(new_tokens: int, methods, models, prompts):
    """--new-tokens must fit after the longest prompt in the context of every model the rows decode with: one line
    before the first decode (each method checks it too, but after the progress bar has started)."""
    used = {USES.get(m, "mdlm") for m in methods}
    context = min((models["moe"] if u.startswith("moe-") else models[u]).config.context for u in used)
    longest = max(map(len, prompts))
    if new_tokens > context - longest:
        raise UserError(f"--new-tokens {new_tokens} does not fit: a {longest}-token prompt leaves "
                        f"{max(0, context - longest)} of a {context}-token context; pass at most "
                        f"{max(1, context - longest)}")


def main(argv=None):
    args = parse_args(argv)
    methods = check_args(args)
    if args.report:
        return write_report(args, methods)
    tokenizer = Tokenizer()
    if args.openings:
        texts = heldout_openings(args.data, args.prompts, args.seed)
    else:
        texts = [tokenizer.encode(text) for text in PROMPTS[:args.prompts]]
    prompts = [[EOT] + text for text in texts]
    models = load_models(args)
    too_big = [m for m in methods if (block_of(m) or 0) > models["drafter"].config.block_size]
    if too_big:
        print(f"notice: skipping {', '.join(too_big)}: the drafter was trained with blocks of "
              f"{models['drafter'].config.block_size}", file=sys.stderr)
        methods = [m for m in methods if m not in too_big]
    check_room(args.new_tokens, methods, models, prompts)
    rows, c = measure_rows(args, methods, models, prompts, tokenizer)
    report = {"device": device_name(args.device), "draft_target_cost_c": c, "rows": rows}
    source = "held-out openings" if args.openings else "prompts"
    print(f"device: {report['device']} | {len(prompts)} {source} x {args.new_tokens} new tokens | "
          f"temperature {args.temperature}")
    print_table(rows, c)
    if args.html:
        none = [name for name, page in args.pages.items() if page is None]
        print(f"--html: {len(args.pages) - len(none)} pages in {args.html}" + (f"; none for {', '.join(none)} (one "
              "token a forward: nothing to replay)" if none else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report
