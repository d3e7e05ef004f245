"""The quality-vs-parallelism curve: tokens per forward against sample quality, and d3LLM's AUP.

For a diffusion LM and its distilled student (tinydiff/extras/distill.py) the cached block sampler runs
one token per step, then at several confidence thresholds (Fast-dLLM) and entropy bounds
(EB-Sampler). Each point is N unconditional samples, judged as every quality number here is
(tinydiff/tools/judge.py: generative perplexity with a 95% bootstrap interval, distinct-2). Beside them
on the same axes: AR decoding (one token per forward) and AR + speculative decoding, whose x is
tau, the tokens per *target* forward (draft forwards are not counted), and whose samples follow
the AR model's distribution exactly (lossless), so its quality differs from AR's by noise only.
One number per curve, d3LLM's AUP (accuracy under parallelism), over points (rho, y), rho =
tokens per forward ascending:
    keep points with y_i >= y_1 - 5;  W(y) = min(exp(-3 (1 - y / y_max)), 1)
    AUP = rho_1 y_1 + sum_{i>=2} (rho_i - rho_{i-1}) (y_i W(y_i) + y_{i-1} W(y_{i-1})) / 2
Text has no accuracy, so y stands in as 100 x the worse of (reference ppl / ppl) and (distinct-2 /
reference distinct-2), capped at 100; the reference is the first diffusion LM's one-token-per-step
point, and y_max the best y of any point. Both ratios count: repeating a phrase lowers perplexity.
`agreement` is a noise-free companion: at temperature 0, the share of positions where a setting
writes the teacher's one-token-per-step greedy token, on held-out story openings.
Leaves out: AUP on task accuracy (we have no tasks), wall-clock axes (the bench measures those).
"""
import math

import torch

from tinydiff.ar import ar_generate
from tinydiff.extras.drafted_diffusion import ar_drafted_generate
from tinydiff.extras.self_speculative import self_speculative_generate
from tinydiff.sampler import generate_cached
from tinydiff.speculative import speculative_generate
from tinydiff.tools.judge import sample_and_judge


def aup(points, y_max: float) -> float:
    """d3LLM's accuracy under parallelism of points [(rho, y), ...] (y in percent)."""
    points = sorted(points)
    kept = [p for p in points if p[1] >= points[0][1] - 5]

    def weighted(y):
        return y * min(math.exp(-3 * (1 - y / y_max)), 1.0)

    total = kept[0][0] * kept[0][1]
    for (rho0, y0), (rho1, y1) in zip(kept, kept[1:]):
        total += (rho1 - rho0) * (weighted(y1) + weighted(y0)) / 2
    return total


def quality_y(row: dict, reference: dict) -> float:
    """100 x min(1, ppl_ref / ppl, distinct2 / distinct2_ref): the curve's stand-in for accuracy."""
    return 100 * min(1.0, reference["gen_ppl"] / row["gen_ppl"], row["distinct_2"] / reference["distinct_2"])


# a diffusion LM's curves, each the rows whose setting starts with its name
FAMILIES = ("threshold", "entropy bound", "left-to-right bound", "low-entropy bound", "self-speculative", "ar-drafted")
# the point each family's line starts from: the confidence order's one token per step, or None for its own first
# point (another order from the first step); self-speculative and ar-drafted points sample the left-to-right
# sampler exactly
START = {"threshold": "one token per step", "entropy bound": "one token per step", "left-to-right bound": None,
         "low-entropy bound": None, "self-speculative": "left-to-right bound 0", "ar-drafted": "left-to-right bound 0"}


def family_points(rows, model: str, family: str) -> list:
    """A diffusion LM's points of one family, its START point first where it was measured."""
    start = [r for r in rows if r["model"] == model and r["setting"] == START[family]]
    return start + [r for r in rows if r["model"] == model and r["setting"].startswith(family)]


def diffusion_settings(thresholds, bounds, ltr_bounds=(), low_entropy_bounds=()) -> list[tuple[str, dict]]:
    """(label, generate_cached keywords) of each point of a diffusion LM's curve: one token per step,
    thresholds, entropy bounds over the most confident positions, over the run right after the
    committed text (remasking left_to_right), and over the lowest-entropy positions (remasking
    low_entropy, DiffusionGemma's order: the order does not read the draw, so each committed token
    is a fair sample of its position, where the confidence order commits modes)."""
    return ([("one token per step", {})] + [(f"threshold {t:g}", {"threshold": t}) for t in thresholds]
            + [(f"entropy bound {e:g}", {"entropy_bound": e}) for e in bounds]
            + [(f"left-to-right bound {e:g}", {"entropy_bound": e, "remasking": "left_to_right"}) for e in ltr_bounds]
            + [(f"low-entropy bound {e:g}", {"entropy_bound": e, "remasking": "low_entropy"})
               for e in low_entropy_bounds])


def curve_rows(models: dict, paths: dict, judge, args, reused=()):
    """(rows, reference row, y_max): every point of the curve. models holds "mdlm" and/or "student"
    (diffusion LMs), "student_draft" (an AR draft for the student), "ar" and "draft" (AR target and
    draft, for the AR and speculative points), paths their checkpoints; args: samples, gen_length,
    block_length, temperature, thresholds, entropy_bounds, ltr_bounds, low_entropy_bounds,
    self_spec_drafts, ar_drafted_drafts, k, device. A row of `reused` (an earlier
    run's rows, same sampling settings) stands in for a point of the same model, setting and checkpoint: a point
    costs minutes. A "self-speculative k" point samples exactly the left-to-right one-token-per-step sampler
    (self_speculative.py, k positions drafted a round), an "ar-drafted k" point too, with k positions drafted
    a round by the AR student_draft (drafted_diffusion.py); their rule is that sampler's, whose T = 0 text
    they write."""
    n, block = args.gen_length, args.block_length
    plans = []  # (model, setting, rule, checkpoint, sample(prompt, generator))
    for key, name in (("mdlm", "teacher"), ("student", "student")):
        if key in models:
            settings = diffusion_settings(args.thresholds, args.entropy_bounds, args.ltr_bounds, args.low_entropy_bounds)
            for label, rule in settings:
                plans.append((name, label, rule, paths[key], lambda p, g, m=models[key], r=rule: generate_cached(
                    m, p, n, n, block, args.temperature, generator=g, **r)))
            for k in args.self_spec_drafts:
                plans.append((name, f"self-speculative {k}", {"remasking": "left_to_right"}, paths[key],
                              lambda p, g, m=models[key], k=k: self_speculative_generate(
                                  m, p, n, block, args.temperature, "left_to_right", k, generator=g)))
    for k in args.ar_drafted_drafts if "student_draft" in models else ():
        plans.append(("student", f"ar-drafted {k}", {"remasking": "left_to_right"},
                      f"{paths['student']} + {paths['student_draft']}",
                      lambda p, g, k=k: ar_drafted_generate(models["student"], models["student_draft"], p, n, block,
                                                            args.temperature, k, generator=g)))
    if "ar" in models:
        plans.append(("ar", "one token per forward", {}, paths["ar"], lambda p, g: ar_generate(
            models["ar"], p, n, args.temperature, generator=g)))
        if "draft" in models:
            plans.append(("ar + speculative", f"draft k = {args.k}", {}, f"{paths['ar']} + {paths['draft']}",
                          lambda p, g: speculative_generate(models["ar"], models["draft"], p, n, args.k,
                                                            args.temperature, generator=g)))
    old = {(r["model"], r["setting"], r["checkpoint"]): r for r in reused}
    rows = []
    for name, label, rule, checkpoint, sample in plans:
        row = old.get((name, label, checkpoint))
        if row is None:
            judged = sample_and_judge(sample, judge, args.samples, args.device, desc=f"{name}, {label}")
            row = {"model": name, "setting": label, "rule": rule, "checkpoint": checkpoint, **judged}
        rows.append(row)
    reference = next(r for r in rows if r["model"] in ("teacher", "student", "ar"))
    y_max = max(quality_y(r, reference) for r in rows)
    for r in rows:
        r["y"] = quality_y(r, reference)
    return rows, reference, y_max


def curve_aups(rows, y_max: float) -> dict:
    """AUP of each curve: a diffusion LM's points of each family from its START (the one-token-per-step
    point of its order); AR alone; AR with its speculative point."""
    out = {}
    for model in ("teacher", "student"):
        for family in FAMILIES:
            points = family_points(rows, model, family)
            if len(points) > 1:
                out[f"{model}, {family}"] = aup([(r["forwards_per_token"] ** -1, r["y"]) for r in points], y_max)
    ar = [r for r in rows if r["model"] == "ar"]
    if ar:
        out["ar"] = aup([(1 / ar[0]["forwards_per_token"], ar[0]["y"])], y_max)
        spec = [r for r in rows if r["model"] == "ar + speculative"]
        if spec:
            out["ar + speculative"] = aup([(1 / r["forwards_per_token"], r["y"]) for r in ar + spec], y_max)
    return out


@torch.no_grad()
def greedy_texts(model, prompts, gen_length: int, block_length: int, rule=None) -> list[list[int]]:
    """What `model` writes after each prompt at temperature 0 with the cached sampler (and `rule`)."""
    return [generate_cached(model, p, gen_length, gen_length, block_length, **(rule or {}))[0] for p in prompts]


def agreement(reference: list[list[int]], texts: list[list[int]]) -> float:
    """The share of positions where `texts` hold the reference's token (greedy_texts of both)."""
    same = sum(a == b for want, got in zip(reference, texts) for a, b in zip(want, got))
    return same / sum(len(want) for want in reference)


def plot_curve(rows, path):
    """Tokens per forward against generative perplexity (95% interval) and against distinct-2."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    families = {}
    for model in ("teacher", "student"):
        for family in FAMILIES:
            points = family_points(rows, model, family)
            if any(r["setting"].startswith(family) for r in points):
                families[f"{model}, {family.split(' ')[0]}"] = points
    for r in rows:
        if r["model"] not in ("teacher", "student"):
            families.setdefault(r["model"], []).append(r)
    for family, points in families.items():
        points = sorted(points, key=lambda r: r["forwards_per_token"], reverse=True)
        x = [1 / r["forwards_per_token"] for r in points]
        y = [r["gen_ppl"] for r in points]
        err = [[r["gen_ppl"] - r["gen_ppl_95"][0] for r in points], [r["gen_ppl_95"][1] - r["gen_ppl"] for r in points]]
        left.errorbar(x, y, yerr=err, marker="o", capsize=3, label=family)
        right.plot(x, [r["distinct_2"] for r in points], marker="o", label=family)
    left.set(xlabel="tokens per forward (target forwards for speculative decoding)", ylabel="generative perplexity",
             xscale="log", yscale="log", title="quality against parallelism (95% bootstrap intervals)")
    right.set(xlabel="tokens per forward", ylabel="distinct-2", xscale="log", title="diversity")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
