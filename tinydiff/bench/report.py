"""`python -m tinydiff.bench --report DIR`: train what is missing, run every method, write DIR/RESULTS.md.

    python -m tinydiff.bench --report docs --data ../shared/data/tinystories-sample.txt
    python -m tinydiff.bench --report docs --ckpt out/ar-tiny/ckpt.pt ...   # given models are not trained

1. Models (report_models.py). Each model the bench uses comes from its bench flag (--ckpt, --draft,
   --drafter, --eagle, --mdlm, --moe) when given, else from out/report-PRESET/ROLE/ckpt.pt, which
   train.py makes when missing, resumes when a run was interrupted, and reuses when finished with
   this preset's settings. The draft, the DFlash drafter and the EAGLE-3 head learn the target's own text
   (--regenerate, written once); the diffusion LM starts from the target's weights.
2. Methods. Every --methods entry (methods.METHODS) decodes the same held-out story openings:
   EOT + the first 8 tokens of stories from the validation split, the form the drafters trained on.
3. Output. The generated section of DIR/RESULTS.md (device, commit, date, models, one table) sits
   between the marker lines START and END below; the rest of the file is hand-written and is kept
   byte for byte. With matplotlib (`pip install -r requirements-plots.txt`) also PNGs in DIR/plots/:
   accepted lengths per speculative method, tau and speedup against k / block size / budget, the
   diffusion canvas over its steps, and experts per block under token and block routing.
One tqdm bar with an ETA covers the whole run (training steps, regenerated stories, methods); each
training run's own output goes to train.log beside its checkpoint.
Leaves out: several seeds, confidence intervals, a GPU-timed `13m` preset.
"""
import copy
import datetime
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from tinydiff.bench.measure import OPENING, device_name, git_commit, heldout_nll, heldout_openings, load_models, measure
from tinydiff.bench.methods import METHODS, USES, block_of, forward_seconds
from tinydiff.bench.report_models import REPORT_PRESETS, ROLES, plan_models, regenerations, train_missing
from tinydiff.bench.temperatures import (
    measure_temperatures,
    plot_acceptance_by_slot,
    sampled_methods,
    temperature_section,
)
from tinydiff.checks import UserError
from tinydiff.io.files import claim_run_folder, write_atomic
from tinydiff.model import PRESETS
from tinydiff.sampler import generate
from tinydiff.tokenizer import EOT, MASK, Tokenizer

START, END = "<!-- report:start -->", "<!-- report:end -->"

def canvas_frames(model, prompt, args, threshold=None):
    """(steps, new tokens) bool: which answer positions are committed after each denoising step,
    for the bench's `diffusion` settings (one token per step, blocks of 32) or a threshold."""
    n, frames = args.new_tokens, []
    generate(model, prompt, n, n, min(32, n), args.temperature, threshold=threshold,
             generator=torch.Generator(args.device).manual_seed(args.seed),
             callback=lambda event: frames.append((event["canvas"][len(prompt):] != MASK).cpu()))
    return torch.stack(frames).numpy()


SWEEP = re.compile(r"^(.+)-([a-z])(\d+)$")  # spec-k4, dflash-b16, ddtree-n32, ssd-f3: family, knob, value
KNOBS = {"k": "k", "b": "block size", "n": "budget", "f": "fan-out", "g": "branches"}


def sweeps(rows) -> dict:
    """family label -> [(knob value, row)] for every method family measured at two or more values."""
    out = {}
    for row in rows:
        match = SWEEP.match(row["method"])
        if match:
            out.setdefault(f"{match[1]} ({KNOBS.get(match[2], match[2])})", []).append((int(match[3]), row))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in out.items() if len(points) > 1}


PLOTS = ("accepted_lengths.png", "tau_speedup.png", "diffusion_canvas.png", "moe_experts.png", "acceptance_by_slot.png")


def make_plots(rows, canvases: dict, folder: Path, sampled: dict) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    folder.mkdir(exist_ok=True)
    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        made.append(folder / name)

    spec = [r for r in rows if r.get("accepted_hist")]
    if spec:
        cols, lines = min(4, len(spec)), math.ceil(len(spec) / min(4, len(spec)))
        fig, axes = plt.subplots(lines, cols, figsize=(3 * cols, 2.4 * lines), squeeze=False)
        for ax, r in zip(axes.flat, spec):
            ax.bar(range(len(r["accepted_hist"])), r["accepted_hist"])
            ax.set_title(f"{r['method']} (tau {r['tau']:.2f})", fontsize=9)
            ax.set_xlabel("drafts accepted in a round", fontsize=8)
        for ax in axes.flat[len(spec):]:
            ax.axis("off")
        save(fig, "accepted_lengths.png")
    families = sweeps(rows)
    if families:
        fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 3.6))
        for name, points in families.items():
            xs = [x for x, _ in points]
            ax_tau.plot(xs, [r["tau"] for _, r in points], "o-", label=name)
            ax_speed.plot(xs, [r["speedup_vs_ar"] or float("nan") for _, r in points], "o-", label=name)
        for ax, label in ((ax_tau, "tau (tokens per target forward)"), (ax_speed, "speedup over ar")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("k / block size / tree budget / fan-out")
            ax.set_ylabel(label)
        ax_tau.legend(fontsize=8)
        save(fig, "tau_speedup.png")
    if canvases:
        fig, axes = plt.subplots(1, len(canvases), figsize=(4.5 * len(canvases), 3.6), squeeze=False)
        for ax, (name, frames) in zip(axes.flat, canvases.items()):
            ax.imshow(frames, aspect="auto", interpolation="nearest", cmap="Greys")
            ax.set_title(f"{name}: {len(frames)} steps (black = committed)", fontsize=9)
            ax.set_xlabel("answer position")
            ax.set_ylabel("denoising step")
        save(fig, "diffusion_canvas.png")
    moe = [r for r in rows if "unique_experts_per_block" in r]
    if moe:
        fig, ax = plt.subplots(figsize=(4, 3))
        ax.bar([r["method"] for r in moe], [r["unique_experts_per_block"] for r in moe])
        ax.set_ylabel("unique experts per 32-token block")
        save(fig, "moe_experts.png")
    name = plot_acceptance_by_slot(sampled, folder, plt) if sampled else None  # --temperatures
    return made + ([folder / name] if name else [])


def section(report: dict, args, plot_paths, folder: Path) -> str:
    """The markdown between the markers."""
    def fmt(value, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"
    lines = [f"## Every method, measured by `python -m tinydiff.bench --report` ({report['date']})", "",
             f"Device: {report['device']} | commit {report['commit']} | preset `{report['preset']}` | temperature "
             f"{args.temperature} | seed {args.seed} | {report['minutes']:.1f} minutes, {report['training']}.", "",
             "Models: " + "; ".join(f"{role} `{m['path']}` ({m['kind']}, {m['step']} steps)"
                                    for role, m in report["models"].items()) + ".", "",
             f"Prompts ({args.new_tokens} new tokens each), openings of held-out stories: "
             + " / ".join(f"\"{text.strip()}\"" for text in report["prompts"]), "",
             "| method | tau | target fwd/token | tokens/s | speedup vs ar | held-out NLL | bits/byte | alpha |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['method']} | {r['tau']:.2f} | {r['target_forwards_per_token']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {fmt(r['speedup_vs_ar'], '.2f', 'x')} | "
                     f"{fmt(r['heldout_nll'], '.3f')} | {fmt(r['heldout_bpb'], '.3f')} | {fmt(r.get('alpha'), '.2f')} |")
    lines += ["", "tau: new tokens per target forward, bonus included, the prompt's prefill forward counted "
              "(generate.py's tau is per round and leaves it out); alpha: accepted / judged drafts (chains only). Held-out NLL: nats/token on 16 validation windows of the model whose distribution the "
              "method samples (the target for every speculative method: they are lossless), exact for AR, "
              "the ELBO bound for the diffusion LMs."]
    lines += [*temperature_section(report["temperatures"]), ""] if report["temperatures"] else [""]
    if plot_paths:
        lines += [f"![{p.stem.replace('_', ' ')}]({p.relative_to(folder).as_posix()})" for p in plot_paths]
    else:
        lines.append("Plots skipped: matplotlib is not installed (`pip install -r requirements-plots.txt`).")
    return "\n".join(lines)


def splice(text: str | None, body: str, where) -> str:
    """The file's text with the generated block replaced, or inserted after its title line."""
    block = f"{START}\n{body}\n{END}"
    if text is None:
        return f"# Results\n\n{block}\n"
    starts, ends = text.count(START), text.count(END)
    if (starts, ends) == (1, 1) and text.index(START) < text.index(END):
        head, rest = text.split(START)
        return head + block + rest.split(END)[1]
    if starts or ends:
        raise UserError(f"{where} has {starts} '{START}' and {ends} '{END}' lines; leave one pair "
                        "(start first) or none")
    if text.startswith("#"):
        title, _, rest = text.partition("\n")
        return f"{title}\n\n{block}\n{rest}"
    return f"{block}\n\n{text}"


def measure_all(args, methods: list[str], plans: dict, bar):
    """Load the planned models and run `methods` on held-out openings: (rows, openings, models, args)."""
    args = copy.copy(args)  # the bench's flags, now naming every model
    for role, (flag, _) in ROLES.items():
        setattr(args, flag, plans[role]["path"])
    models = load_models(args)
    openings = heldout_openings(args.data, args.prompts, args.seed)
    prompts = [[EOT] + opening for opening in openings]
    too_big = [m for m in methods if (block_of(m) or 0) > models["drafter"].config.block_size]
    methods = [m for m in methods if m not in too_big]  # as the bench does: more slots than trained
    bar.total -= len(too_big)
    nll = heldout_nll(models, args, Tokenizer(), sorted({USES.get(m, "mdlm") for m in methods}))
    args.forward_costs = (forward_seconds(models["draft"], prompts[0], reps=16),  # for SSD's modelled times
                          forward_seconds(models["target"], prompts[0], reps=16))
    rows = []
    bar.set_postfix_str("")
    for name in methods:
        bar.set_description(f"bench {name}")
        nll_row, bpb_row = nll.get(USES.get(name, "mdlm"), (None, None))
        rows.append({"method": name, **measure(METHODS[name], models, prompts, args),
                     "heldout_nll": nll_row, "heldout_bpb": bpb_row})
        bar.update(1)
    ar_speed = next((r["tokens_per_s"] for r in rows if r["method"] == "ar"), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar_speed if ar_speed else None
    return rows, openings, models, args


def write_report(args, methods: list[str]) -> dict:
    """Train what is missing, measure `methods`, write args.report/RESULTS.md (and plots); the report."""
    plan = REPORT_PRESETS.get(args.report_preset)
    if plan is None:
        raise UserError(f"unknown --report-preset {args.report_preset!r}; choose from {', '.join(REPORT_PRESETS)}")
    folder = Path(args.report)
    if not folder.resolve().parent.is_dir() or folder.is_file():
        raise UserError(f"--report {folder}: pass a folder whose parent exists (RESULTS.md and plots/ go in it)")
    with claim_run_folder(folder, "--report"):  # one report at a time: RESULTS.md is read first, spliced last
        return measure_and_write(args, methods, plan, folder)


def measure_and_write(args, methods: list[str], plan: dict, folder: Path) -> dict:
    """write_report's work, in its folder while it holds the lock."""
    results = folder / "RESULTS.md"
    old = results.read_text(encoding="utf-8") if results.exists() else None
    splice(old, "", results)  # bad markers fail now, not after the training
    room = plan.get("context", PRESETS[plan["preset"]].context) - 1 - OPENING
    if not 1 <= args.new_tokens <= room:
        raise UserError(f"--new-tokens must lie in [1, {room}] at preset {args.report_preset}, got {args.new_tokens}")
    plans = plan_models(args, plan, Path("out") / f"report-{args.report_preset}")
    methods = [m for m in methods if USES.get(m) != "distilled" or args.distilled]  # no student is trained here
    temperatures = args.temperatures or []  # --temperatures: ar and the speculative rows again at each
    runs = len(methods) + len(temperatures) * len(sampled_methods(methods))
    total = sum(job["todo"] for job in plans.values()) + regenerations(plans, plan) + runs
    with tqdm(total=total, desc="report", unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        train_missing(plans, bar)
        rows, openings, models, args = measure_all(args, methods, plans, bar)
        sampled = measure_temperatures(args, [r["method"] for r in rows], models, [[EOT] + o for o in openings],
                                       temperatures, bar)
        minutes = bar.format_dict["elapsed"] / 60
    report = {"device": device_name(args.device), "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "minutes": minutes, "training": "training included" if total > runs else "every model reused",
              "preset": args.report_preset, "prompts": [Tokenizer().decode(o) for o in openings],
              "models": {role: {key: job[key] for key in ("path", "kind", "step")} for role, job in plans.items()},
              "rows": rows, "temperatures": sampled}
    for name in PLOTS:  # the last run's plots: none may outlive the table it belonged to
        (folder / "plots" / name).unlink(missing_ok=True)
    plot_paths = []
    if importlib.util.find_spec("matplotlib") is None:
        print("plots skipped: matplotlib is not installed (pip install -r requirements-plots.txt)")
    else:
        canvases = {}
        if any(row["method"].startswith("diffusion") for row in rows):
            canvases = {name: canvas_frames(models["mdlm"], [EOT] + openings[0], args, threshold)
                        for name, threshold in (("diffusion", None), ("diffusion-threshold", 0.9))}
        plot_paths = make_plots(rows, canvases, folder / "plots", sampled)
    body = section(report, args, plot_paths, folder)
    tmp = results.with_name(f".{results.name}.tmp")
    tmp.write_text(splice(old, body, results), encoding="utf-8")
    tmp.replace(results)  # atomic: an interrupted write never leaves half a file
    report["plots"] = [str(p) for p in plot_paths]
    if args.json:
        text = json.dumps(report, indent=2)
        write_atomic(Path(args.json), lambda f: f.write(text.encode("utf-8")))
    print(body)
    print(f"wrote {results}" + (f" and {len(plot_paths)} plots in {folder / 'plots'}" if plot_paths else ""))
    return report
