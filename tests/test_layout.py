"""Spec: the core and its wings (docs/DESIGN.md). The core (tinydiff/'s top level and kernels/) imports no
wing, and generate.py on an AR checkpoint loads the core's modules it runs and no wing but io/ (the
checkpoint reader and the command line every entry point shares): never the variants, the fast paths,
training, the tools or the bench. Each import check runs in a fresh interpreter, where nothing is loaded yet.
Also: one statement a line in the project's Python, and no table cell of the README or docs/RESULTS.md runs long
(the history goes to dev/LOG.md)."""
import ast
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted(["tinydiff." + p.stem for p in (ROOT / "tinydiff").glob("*.py") if p.stem != "__init__"] +
              ["tinydiff.kernels." + p.stem for p in (ROOT / "tinydiff" / "kernels").glob("*.py")
               if p.stem != "__init__"] + ["tinydiff.kernels"])
WINGS = sorted(p.name for p in (ROOT / "tinydiff").iterdir() if p.is_dir() and (p / "__init__.py").exists()
               and p.name != "kernels")
PLUMBING = {"tinydiff.io", "tinydiff.io.checkpoint", "tinydiff.io.cli", "tinydiff.io.cpu_memory"}


def fresh(code: str) -> dict:
    """Run `code` in a new interpreter at the repository's root; the JSON it prints last."""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_core_and_the_wings_are_what_the_design_says():
    """One file per concept, in the order the lessons teach (a new top-level file is a design decision)."""
    concepts = ["tokenizer", "model", "sampling", "data", "diffusion", "sampler", "ar", "speculative", "ssd",
                "dflash", "ddtree", "eagle3", "dmoe", "fp4", "checks"]
    kernels = ["kernels", "kernels.masked_attention", "kernels.moe_ffn", "kernels.sampler_step"]
    assert CORE == sorted("tinydiff." + name for name in concepts + kernels)
    assert WINGS == ["bench", "extras", "fast", "io", "tools", "train"]


def test_no_core_module_pulls_in_a_wing():
    """Each core module imported in turn; the project modules each import added. A module's imports run
    once, at its first import, so one interpreter sees every core module's pulls as a fresh one would."""
    pulled = fresh(f"""
import importlib, json, sys
pulled = {{}}
for name in {CORE!r}:
    before = set(sys.modules)
    importlib.import_module(name)
    pulled[name] = sorted(m for m in set(sys.modules) - before if m.startswith("tinydiff."))
print(json.dumps(pulled))""")
    assert set(pulled) == set(CORE)
    wings = {name: [m for m in mods if m.split(".")[1] in WINGS] for name, mods in pulled.items()}
    assert {name: mods for name, mods in wings.items() if mods} == {}
    assert any(pulled.values())  # the record is real: importing the core loads core modules


def test_generate_on_an_ar_checkpoint_loads_the_core_and_io_only(tmp_path):
    """The core modules AR decoding runs, and of the wings only io/'s plumbing."""
    config = ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32, causal=True)
    save_checkpoint(tmp_path / "ar.pt", kind="ar", config=config, model=Transformer(config))
    argv = ["--ckpt", str(tmp_path / "ar.pt"), "--prompt", "Once upon a time", "--max-new-tokens", "4",
            "--seed", "0", "--json"]
    loaded = fresh(f"""
import json, sys
import generate
generate.main({argv!r})
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tinydiff"))))""")
    assert {"tinydiff.ar", "tinydiff.model", "tinydiff.tokenizer", "tinydiff.io.checkpoint"} <= set(loaded)
    assert sorted(m for m in loaded if m not in CORE and m != "tinydiff") == sorted(PLUMBING)
    assert not {"tinydiff.speculative", "tinydiff.dflash", "tinydiff.sampler"} & set(loaded)  # only what AR runs


@pytest.mark.parametrize("kind", ["ar", "mdlm"])
def test_a_training_run_loads_the_method_it_trains_and_no_other(story_file, tmp_path, kind):
    """train.py imports a kind's loss when that kind trains (its LOSSES), and a variant only when the run uses
    it: an AR or MDLM run, in a fresh interpreter, loads neither the drafters, the MoE, FP4 nor any variant."""
    argv = ["--model", kind, "--data", str(story_file), "--out", str(tmp_path / "run"), "--preset", "draft",
            "--context", "16", "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1",
            "--device", "cpu"]
    loaded = set(fresh(f"""
import json, sys
import train
train.main({argv!r})
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tinydiff"))))"""))
    assert {f"tinydiff.{'ar' if kind == 'ar' else 'diffusion'}", "tinydiff.train.fused_loss"} <= loaded
    others = {"tinydiff.dflash", "tinydiff.eagle3", "tinydiff.ddtree", "tinydiff.speculative", "tinydiff.dmoe",
              "tinydiff.fp4", "tinydiff.extras"}
    assert not others & loaded


def test_no_table_cell_runs_long():
    """No table cell of the README or docs/RESULTS.md runs past 200 characters (the history goes to
    dev/LOG.md)."""
    for doc in ("README.md", "docs/RESULTS.md"):
        for line in (ROOT / doc).read_text(encoding="utf-8").splitlines():
            if line.startswith("|"):
                cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
                assert max(map(len, cells)) <= 200, (doc, line[:80])


def test_one_statement_a_line():
    """No line of the project's Python holds two statements or continues one with a backslash: what a line
    says, it says alone (a long expression breaks inside its brackets instead)."""
    crammed = []
    for path in sorted([*(ROOT / "tinydiff").rglob("*.py"), ROOT / "train.py", ROOT / "generate.py"]):
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        for before, token in zip(tokens, tokens[1:]):
            if token.start[0] > before.end[0] and before.type not in (tokenize.NEWLINE, tokenize.NL,
                                                                     tokenize.COMMENT, tokenize.STRING,
                                                                     tokenize.INDENT, tokenize.DEDENT):
                crammed.append(f"{name}:{before.end[0]}: backslash")  # the line ended inside a statement
        for token in tokens:
            if token.type == tokenize.OP and token.string == ";":
                crammed.append(f"{name}:{token.start[0]}: ;")
        for node in ast.walk(ast.parse(source)):
            body = getattr(node, "body", None)
            if isinstance(node, ast.stmt) and isinstance(body, list) and body[0].lineno == node.lineno:
                crammed.append(f"{name}:{node.lineno}: a block on its header's line")
    assert crammed == []
