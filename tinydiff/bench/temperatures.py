"""The report's section on sampling temperatures: `python -m tinydiff.bench --report DIR --temperatures 0,0.8,1`.

Speculative decoding is lossless at every temperature; its speed is not. A draft trained on the
target's greedy text predicts the target's argmax, and at T = 1 the target samples away from it.
This section decodes the same held-out openings again at each listed temperature with `ar` and every
speculative row of the report (the same models, seed and prompts), and shows alpha, tau, the speed
against `ar` at that temperature, and the acceptance by slot (slot k kept given slots < k were): the
per-position curve DSpark (2026) plots. Its plot draws that curve per method, a line per temperature.
Leaves out: drafters trained per temperature (train.py --draft-temperature makes them; pass them with
the bench's flags), and intervals (one run per point; alpha and tau are counts over every round).
"""
import argparse
import copy

from tinydiff.bench.measure import measure
from tinydiff.bench.methods import METHODS, USES
from tinydiff.checks import TEMPERATURE

SLOTS_SHOWN = 8  # acceptance by slot: the first slots in the table (the plot draws them all)


def parse_temperatures(text: str) -> list[float]:
    """--temperatures "0,0.8,1" -> [0.0, 0.8, 1.0]: each a valid temperature, none twice (argparse's type)."""
    values = [TEMPERATURE(part) for part in text.split(",")]  # its ArgumentTypeError names the bad one
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"lists a temperature twice: {text!r}")
    return values


def sampled_methods(methods: list[str]) -> list[str]:
    """`ar` (the baseline at each temperature) and the speculative rows among `methods`."""
    return ["ar"] + [m for m in methods if USES.get(m) == "target" and m != "ar"]


def measure_temperatures(args, methods: list[str], models: dict, prompts: list, temperatures, bar) -> dict:
    """temperature -> rows ({"method", measure()'s keys, "speedup_vs_ar"}) on the report's prompts; the
    rest of the report's bar is these runs."""
    bar.total = bar.n + len(temperatures) * len(sampled_methods(methods))
    out = {}
    for temperature in temperatures:
        at_t = copy.copy(args)
        at_t.temperature = temperature
        rows = []
        for name in sampled_methods(methods):
            bar.set_description(f"bench {name} at T={temperature:g}")
            rows.append({"method": name, **measure(METHODS[name], models, prompts, at_t)})
            bar.update(1)
        ar_speed = rows[0]["tokens_per_s"]
        for row in rows:
            row["speedup_vs_ar"] = row["tokens_per_s"] / ar_speed
        out[temperature] = rows
    return out


def temperature_section(by_temperature: dict) -> list[str]:
    """Markdown lines: one table row per (method, temperature), the speculative rows only."""
    lines = ["", "### Where users sample: the speculative rows at each temperature", "",
             "| method | T | alpha | tau | speedup vs ar at T | acceptance by slot (1, 2, ...) |", "|---|---|---|---|---|---|"]
    methods = [row["method"] for row in next(iter(by_temperature.values()))[1:]]
    for name in methods:
        for temperature, rows in by_temperature.items():
            row = next(r for r in rows if r["method"] == name)
            alpha = "-" if row.get("alpha") is None else f"{row['alpha']:.2f}"
            slots = " ".join(f"{a:.2f}" for a in row["acceptance_by_slot"][:SLOTS_SHOWN] if a is not None)
            lines.append(f"| {name} | {temperature:g} | {alpha} | {row['tau']:.2f} | {row['speedup_vs_ar']:.2f}x | "
                         f"{slots or '-'} |")
    lines += ["", "Acceptance by slot: of the rounds whose drafts reached slot k with every earlier slot kept, the "
              "share that kept slot k too (for a tree, the accepted path going one deeper); a slot no round "
              "reached is left out. Each temperature decodes the same openings with the same seed."]
    return lines


def plot_acceptance_by_slot(by_temperature: dict, folder, plt) -> str | None:
    """acceptance_by_slot.png: a panel per speculative method, a line per temperature; its name or None."""
    methods = [row["method"] for row in next(iter(by_temperature.values()))[1:]]
    if not methods:
        return None
    cols = min(4, len(methods))
    rows_of_panels = -(-len(methods) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(3.2 * cols, 2.6 * rows_of_panels), squeeze=False)
    for ax, name in zip(axes.flat, methods):
        slots = 1
        for temperature, rows in by_temperature.items():
            curve = next(r for r in rows if r["method"] == name)["acceptance_by_slot"]
            slots = max(slots, len(curve))
            points = [(k + 1, a) for k, a in enumerate(curve) if a is not None]
            ax.plot([k for k, _ in points], [a for _, a in points], "o-", markersize=3, label=f"T={temperature:g}")
        ax.set_title(name, fontsize=9)
        ax.set_ylim(0, 1.05)
        ax.set_xlim(0.5, slots + 0.5)
        ax.set_xlabel("draft slot", fontsize=8)
    axes.flat[0].set_ylabel("kept, given earlier kept", fontsize=8)
    axes.flat[0].legend(fontsize=7)
    for ax in axes.flat[len(methods):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(folder / "acceptance_by_slot.png", dpi=110)
    plt.close(fig)
    return "acceptance_by_slot.png"
