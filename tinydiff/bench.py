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
--distilled model (train.py --distill): the threshold in the name, or the entropy bound.
`dmoe-token` / `dmoe-block` decode like `diffusion-cached` with the MoE diffusion LM (--moe).
Without --ckpt / --mdlm the models are untrained `tiny` ones: speeds are real, the text is noise.
`--report DIR` trains the missing models first and writes DIR/RESULTS.md and plots: tinydiff/report.py.
"""
import json
import math
import platform
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinydiff.bench_methods import MEANS, METHODS, USES
from tinydiff.checkpoint import load_checkpoint, load_model
from tinydiff.cli import add_device, make_parser
from tinydiff.dflash import DFlashConfig, DFlashDrafter, drafter_from
from tinydiff.data import eval_windows, load_tokens, prepare_tokens
from tinydiff.block_diffusion import diffusion_elbo
from tinydiff.dmoe import MoETransformer, moe_config, set_routing
from tinydiff.eagle import EagleConfig, EagleHead, head_from
from tinydiff.errors import UserError
from tinydiff.model import Transformer, preset
from tinydiff.speculative import expected_tokens_per_round, leviathan_speedup
from tinydiff.ssd import forward_seconds
from tinydiff.tokenizer import EOT, Tokenizer

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park.",
    "One day, a big bear found a red ball in the forest.",
    "Sam wanted to help his mom in the kitchen.",
]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:  # Linux names the CPU model here; platform only knows the architecture
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"{cpu} CPU, {threads} thread{'s' * (threads != 1)}"


def measure(method, models, prompts, args) -> dict:
    """Sum a method's counts over all prompts (after one untimed warm-up run).

    Every method reports new_tokens, seconds and target_forwards; speculative ones also an
    accepted-count histogram, the drafts proposed and, for chains, the rounds that rejected one,
    from which alpha (accepted / judged) follows.
    """
    generator = torch.Generator(args.device).manual_seed(args.seed)
    method(models, prompts[0], args, generator)
    totals = {}
    for prompt in prompts:
        generator.manual_seed(args.seed)
        for key, value in method(models, prompt, args, generator).items():
            if isinstance(value, list):
                totals[key] = [a + b for a, b in zip(totals.get(key, [0] * len(value)), value)]
            else:
                totals[key] = totals.get(key, 0) + value
    row = {"tokens_per_s": totals["new_tokens"] / totals["seconds"],
           "target_forwards_per_token": totals["target_forwards"] / totals["new_tokens"],
           "tau": totals["new_tokens"] / totals["target_forwards"]}
    row.update({key: totals[key] / len(prompts) for key in MEANS if key in totals})
    if "nodes" in totals:  # a tree's verify cost: nodes per round (alpha is not defined for trees)
        row["nodes_per_round"] = totals["nodes"] / totals["rounds"]
    if "hits" in totals:
        row["hit_rate"] = sum(totals["hits"]) / max(1, sum(totals["lookups"]))
        row["modelled_speedup_vs_spec"] = totals["modelled_seconds_sd"] / totals["modelled_seconds_ssd"]
    if "draft_seconds" in totals:  # the loop's own costs, for Leviathan's formula with real prices
        row["seconds_per_draft"] = totals["draft_seconds"] / totals["proposed"]
        row["seconds_per_verify"] = totals["verify_seconds"] / totals["target_forwards"]
    if "accepted" in totals:
        row["accepted_hist"] = totals["accepted"]
        accepted = sum(n * count for n, count in enumerate(totals["accepted"]))
        judged = accepted + totals.get("rejected", 0)
        row["alpha"] = accepted / judged if "rejected" in totals and judged else None
    return row


def load_models(args) -> dict:
    models = {}
    for name, path, kind, size in (("target", args.ckpt, "ar", "tiny"), ("draft", args.draft, "ar", "draft"),
                                   ("mdlm", args.mdlm, "mdlm", "tiny"), ("distilled", args.distilled, "mdlm", "tiny")):
        if path:
            models[name], _ = load_model(path, args.device, kinds=(kind,))
        else:
            print(f"notice: no checkpoint for the {name} model, timing an untrained '{size}' one "
                  "(speeds are real, text is not)", file=sys.stderr)
            torch.manual_seed(args.seed)
            models[name] = Transformer(preset(size, causal=kind == "ar")).to(args.device).eval()
    if args.drafter:
        models["drafter"] = drafter_from(load_checkpoint(args.drafter), models["target"], args.drafter)
    else:
        print("notice: no --drafter, timing an untrained DFlash drafter", file=sys.stderr)
        models["drafter"] = DFlashDrafter(DFlashConfig.for_target(models["target"].config), models["target"])
    if args.eagle:
        models["eagle"] = head_from(load_checkpoint(args.eagle), models["target"], args.eagle)
    else:
        print("notice: no --eagle, timing an untrained EAGLE-3 head", file=sys.stderr)
        models["eagle"] = EagleHead(EagleConfig.for_target(models["target"].config), models["target"])
    if args.moe:
        models["moe"], _ = load_model(args.moe, args.device, kinds=("mdlm-moe",))
    else:
        print("notice: no checkpoint for the moe model, timing an untrained one", file=sys.stderr)
        models["moe"] = MoETransformer(moe_config("tiny")).to(args.device).eval()
    return models


@torch.no_grad()
def heldout_nll(models, args, tokenizer, wanted) -> dict:
    """(nats/token, bits/byte) on 16 windows of --data's validation split, for each `wanted` model
    ("target", "mdlm", "distilled", "moe-token", "moe-block"): exact for the AR model, the ELBO bound (4 noise
    draws; block diffusion's for a model trained with --noise-block) for the diffusion LMs, the MoE
    one under each routing."""
    _, val_path = prepare_tokens(args.data)
    out = {}
    scored_models = [(name, models["moe"] if name.startswith("moe-") else models[name]) for name in wanted]
    for name, model in scored_models:
        if name.startswith("moe-"):
            set_routing(model, name[len("moe-"):])
        windows = eval_windows(load_tokens(val_path), 16, model.config.context).to(args.device)
        if name == "target":
            logits = model(windows[:, :-1], causal=True)
            nll = F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten()).item()
            scored = windows[:, 1:]
        else:
            nll = diffusion_elbo(model, windows, mc=4, generator=torch.Generator(args.device).manual_seed(0))["bound"]
            scored = windows[:, 1:] if model.config.shift else windows  # diffusion.scored_tokens
        n_bytes = sum(len(tokenizer.decode(row).encode()) for row in scored.tolist())
        out[name] = (nll, nll * scored.numel() / (n_bytes * math.log(2)))
    return out


def parse_args(argv=None):
    p = make_parser("python -m tinydiff.bench", "Benchmark every decoding method on the same prompts.")
    p.add_argument("--ckpt", help="AR target checkpoint (default: an untrained tiny model)")
    p.add_argument("--draft", help="AR draft checkpoint for the spec rows (default: an untrained draft model)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint trained for --ckpt (default: an untrained one)")
    p.add_argument("--eagle", help="EAGLE-3 head checkpoint trained for --ckpt (default: an untrained one)")
    p.add_argument("--moe", help="mixture-of-experts diffusion LM checkpoint (default: an untrained tiny one)")
    p.add_argument("--mdlm", help="masked-diffusion LM checkpoint (default: an untrained tiny model)")
    p.add_argument("--distilled", help="diffusion LM distilled for parallel decoding, train.py --distill "
                   "(default: an untrained tiny model)")
    p.add_argument("--entropy-bound", type=float, default=0.5, help="nats, for the *-entropy rows (EB-Sampler)")
    p.add_argument("--data", help="TinyStories-format file: report held-out NLL on its validation split")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from: {', '.join(METHODS)}")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts "
                   "(with --report: how many held-out story openings)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, the same text for every method")
    p.add_argument("--seed", type=int, default=1337, help="seeds every random choice: same seed, same output")
    add_device(p)
    p.add_argument("--json", help="also write the table as JSON to this path")
    p.add_argument("--report", metavar="DIR", help="train the models not given (out/report-PRESET/), run the "
                   "methods on held-out story openings, write DIR/RESULTS.md and DIR/plots/")
    p.add_argument("--report-preset", default="tiny", help="with --report: smoke (a one-minute pipeline check), "
                   "tiny (under 30 CPU minutes) or 13m (a GPU)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UserError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(METHODS)}")
    if args.prompts < 1 or (args.prompts > len(PROMPTS) and not args.report):
        raise UserError(f"--prompts must lie in [1, {len(PROMPTS)}] (any count >= 1 with --report, which draws "
                        f"held-out story openings), got {args.prompts}")
    if not 0 <= args.entropy_bound < float("inf"):
        raise UserError(f"--entropy-bound must be a finite number of nats >= 0, got {args.entropy_bound}")
    if args.report:  # imported here: tinydiff.report builds on this module
        from tinydiff.report import write_report
        return write_report(args, methods)
    tokenizer = Tokenizer()
    prompts = [[EOT] + tokenizer.encode(text) for text in PROMPTS[:args.prompts]]
    models = load_models(args)
    too_big = [m for m in methods if m.startswith("dflash-b") and int(m[len("dflash-b"):]) > models["drafter"].config.block_size]
    if too_big:
        print(f"notice: skipping {', '.join(too_big)}: the drafter was trained with blocks of "
              f"{models['drafter'].config.block_size}", file=sys.stderr)
        methods = [m for m in methods if m not in too_big]
    nll = heldout_nll(models, args, tokenizer, sorted({USES.get(m, "mdlm") for m in methods})) if args.data else {}
    # Leviathan's c: a draft forward's cost over a target forward's, both one cached token.
    args.forward_costs = (forward_seconds(models["draft"], prompts[0], reps=16),
                          forward_seconds(models["target"], prompts[0], reps=16))
    c = args.forward_costs[0] / args.forward_costs[1]
    rows = []
    for name in tqdm(methods, desc="bench", unit="method", file=sys.stderr):
        nll_row, bpb_row = nll.get(USES.get(name, "mdlm"), (None, None))
        rows.append({"method": name, **measure(METHODS[name], models, prompts, args),
                     "heldout_nll": nll_row, "heldout_bpb": bpb_row})
    ar_speed = next((r["tokens_per_s"] for r in rows if r["method"] == "ar"), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar_speed if ar_speed else None
        if row["method"].startswith("spec-") and row.get("alpha") is not None:
            k = int(row["method"][len("spec-k"):])
            row["predicted_speedup"] = leviathan_speedup(row["alpha"], k, c)
            if ar_speed:  # the same formula, each cost in `ar` steps as the loop paid it
                row["loop_c"], row["loop_v"] = row["seconds_per_draft"] * ar_speed, row["seconds_per_verify"] * ar_speed
                row["predicted_at_loop_costs"] = (expected_tokens_per_round(row["alpha"], k)
                                                  / (k * row["loop_c"] + row["loop_v"]))
    report = {"device": device_name(args.device), "draft_target_cost_c": c, "rows": rows}
    print(f"device: {report['device']} | {len(prompts)} prompts x {args.new_tokens} new tokens | "
          f"temperature {args.temperature}")
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
        if "loop_c" in r:
            print(f"{r['method']}: one draft {r['loop_c']:.2f}, one verify {r['loop_v']:.2f} `ar` steps")
    spec4 = next((r["tokens_per_s"] for r in rows if r["method"] == "spec-k4"), None)
    dflash = next((r["tokens_per_s"] for r in rows if r["method"] == "dflash-b16"), None)
    for r in rows:
        if "nodes_per_round" in r and dflash:
            r["speedup_vs_dflash"] = r["tokens_per_s"] / dflash
    for r in rows:
        if "hit_rate" in r:
            measured = f"{r['tokens_per_s'] / spec4:.2f}x spec-k4 measured, " if spec4 else ""
            print(f"{r['method']}: hit rate {r['hit_rate']:.2f}, {measured}"
                  f"{r['modelled_speedup_vs_spec']:.2f}x modelled with the draft on its own device")
        if "nodes_per_round" in r:
            versus = f", {r['speedup_vs_dflash']:.2f}x dflash-b16's tokens/s" if "speedup_vs_dflash" in r else ""
            print(f"{r['method']}: {r['nodes_per_round']:.1f} tree nodes verified per target forward{versus}")
        if "unique_experts_per_block" in r:
            print(f"{r['method']}: {r['unique_experts_per_block']:.1f} unique experts per 32-token block, "
                  f"{r['expert_bytes_per_forward'] / 1e6:.2f} MB of expert weights per forward, "
                  f"{1e3 * r['moe_seconds_per_forward']:.1f} ms in MoE layers per forward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
