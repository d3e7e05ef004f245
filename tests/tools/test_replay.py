"""Spec: the replay page (tinydiff/tools/replay.py + replay.html). Recording leaves every method's tokens
alone; the page, rendered by a real headless Chromium, shows the run's own text, one step per recorded
event and at step i the canvas or round recorded at step i; hostile prompts stay text; bad paths are
refused in one line before any work. The bench's --html: each row's page replays the very tokens the row
decoded. The browser tests skip only where no chromium binary exists (.ci/run installs Debian's)."""
import html
import json
import re
import shutil
import subprocess
from dataclasses import replace
from html.parser import HTMLParser

import pytest
import torch
from entry_points import last_line, run_in_process
from stats_helpers import random_drafter, random_model

import generate
from tinydiff import sampler
from tinydiff.bench import methods as bench_methods
from tinydiff.bench import table as bench
from tinydiff.bench.measure import PROMPTS
from tinydiff.ddtree import ddtree_generate
from tinydiff.dflash import dflash_generate
from tinydiff.dmoe import MoETransformer, moe_config, set_routing
from tinydiff.eagle3 import EagleConfig, EagleHead, eagle_generate
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig
from tinydiff.speculative import speculative_generate
from tinydiff.ssd import ssd_generate
from tinydiff.tokenizer import EOT, MASK, Tokenizer
from tinydiff.tools.replay import Recorder, check_page_path, render

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
browser = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium)")
HOSTILE = 'Tom said "hi" & \'bye\' </script><img src=x onerror="document.title=\'pwned\'"> <b>x</b>'


@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


@pytest.fixture(scope="module")
def models():
    """An AR target, an AR draft, a DFlash drafter, an EAGLE-3 head, a diffusion LM and a diffusion MoE."""
    target = random_model(ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    draft = random_model(ModelConfig(context=64, n_layer=1, n_head=2, d_model=32, d_ff=64), seed=1)
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.for_target(target.config), target).eval()
    mdlm = random_model(ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False), seed=3)
    torch.manual_seed(4)
    moe = MoETransformer(moe_config("draft", context=64, n_experts=8, moe_top_k=2, route_block=8,
                                    route_guard=2)).eval()
    return {"target": target, "draft": draft, "drafter": random_drafter(target, seed=5, block_size=4), "head": head,
            "mdlm": mdlm, "moe": moe}


def decode(method, m, prompt, temperature, seed, record=None):
    """(ids, result) of `method` on the fixture's models, `record` passed as the loop's callback."""
    g = torch.Generator().manual_seed(seed)
    loop = dict(generator=g, on_round=record)
    if method in ("diffusion", "diffusion-cached", "dmoe-token", "dmoe-block"):
        model = m["moe"] if method.startswith("dmoe") else m["mdlm"]
        if method.startswith("dmoe"):
            set_routing(model, method[5:])
        sample = sampler.generate if method == "diffusion" else sampler.generate_cached
        return sample(model, prompt, 16, 16, 8, temperature, generator=g, callback=record)
    if method == "spec":
        return speculative_generate(m["target"], m["draft"], prompt, 12, 3, temperature, **loop)
    if method == "ssd":
        return ssd_generate(m["target"], m["draft"], prompt, 12, 3, 2, temperature, **loop)
    if method == "dflash":
        return dflash_generate(m["target"], m["drafter"], prompt, 12, 4, temperature, **loop)
    if method == "ddtree":
        return ddtree_generate(m["target"], m["drafter"], prompt, 12, 4, 6, temperature, **loop)
    return eagle_generate(m["target"], m["head"], prompt, 12, 3, 6 if method == "eagle3-tree" else None, 2,
                          temperature, **loop)


METHODS = ["diffusion", "diffusion-cached", "dmoe-token", "dmoe-block", "spec", "ssd", "dflash", "ddtree",
           "eagle3-chain", "eagle3-tree"]


@pytest.mark.parametrize("method, temperature", [(method, 0.0) for method in METHODS] +
                         [(method, 1.0) for method in ("diffusion", "spec", "ssd", "eagle3-tree")])
def test_recording_leaves_the_tokens_alone_and_keeps_every_step(models, tok, method, temperature):
    prompt = [EOT] + tok.encode("Once upon a time")
    plain, result = decode(method, models, prompt, temperature, seed=7)
    seen = []
    recorder = Recorder(method, tok, prompt, "Once upon a time", models["moe"] if "dmoe" in method else None)
    ids, _ = decode(method, models, prompt, temperature, seed=7, record=lambda e: (seen.append(e), recorder(e)))
    assert ids == plain
    assert len(recorder.steps) == len(seen) == (result.forwards if "diffusion" in method or "dmoe" in method
                                                else result.rounds)
    page = recorder.page()
    if page["kind"] == "diffusion":  # the diffs rebuild every recorded canvas
        canvas = [MASK] * page["length"]
        for step, event in zip(page["steps"], seen):
            for i, token in step["set"]:
                canvas[i] = token
            assert canvas == event["canvas"][len(prompt):].tolist()
    else:
        assert sum((s["tokens"] for s in page["steps"]), []) == ids
    if method == "dmoe-token":  # token routing reads exactly what token routing reads
        assert all(read == token for layers in page["experts"] for read, token in layers)
    if method == "dmoe-block":  # a block reads its coreset's experts: fewer than its tokens' own choices here
        read, token = ([len(layers[0][j]) for layers in page["experts"]] for j in (0, 1))
        assert sum(read) < sum(token)


class Dom(HTMLParser):
    """The rendered DOM as Chromium dumps it: every start tag's attributes, and the text of elements by id."""
    VOID = {"input", "meta", "br", "img", "link", "hr"}

    def __init__(self, text):
        super().__init__()
        self.tags, self.text, self.open = [], {}, []
        self.title = html.unescape(re.search(r"<title>(.*?)</title>", text, re.S)[1])  # the document's, the first
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag not in self.VOID:
            self.open.append(attrs.get("id"))

    def handle_endtag(self, tag):
        if tag not in self.VOID and self.open:
            self.open.pop()

    def handle_data(self, data):
        for name in filter(None, self.open):
            self.text[name] = self.text.get(name, "") + data

    def find(self, **wanted):
        return [attrs for tag, attrs in self.tags if all(attrs.get(k) == v for k, v in wanted.items())]


def render_dom(path, tmp_path, step=None) -> Dom:
    """The page after its script ran, from headless Chromium (root needs --no-sandbox)."""
    url = path.resolve().as_uri() + ("" if step is None else f"#step={step}")
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}/chrome",
                          "--dump-dom", url], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "<main" in res.stdout, res.stderr[-2000:]
    return Dom(res.stdout)


def shown_canvas(dom):
    """The ids of the boxes inside #canvas, in order."""
    out, inside = [], False
    for tag, attrs in dom.tags:
        if attrs.get("id") == "canvas":
            inside = True
        elif inside and tag != "span":
            break
        elif inside:
            out.append(int(attrs["data-id"]))
    return out


@browser
def test_stepping_to_step_i_shows_the_canvas_recorded_at_step_i(models, tok, tmp_path):
    prompt = [EOT] + tok.encode("Once upon a time")
    seen = []
    recorder = Recorder("diffusion", tok, prompt, "Once upon a time")
    ids, result = sampler.generate(models["mdlm"], prompt, 16, 16, 8, callback=lambda e: (seen.append(e), recorder(e)))
    page = tmp_path / "page.html"
    recorder.write(page)
    for step in (0, 5, 16):
        dom = render_dom(page, tmp_path, step)
        replay = dom.find(id="replay")[0]
        assert replay["data-step"] == str(step) and int(dom.find(id="slider")[0]["max"]) == len(seen) == 16
        expected = [MASK] * 16 if step == 0 else seen[step - 1]["canvas"][len(prompt):].tolist()
        assert shown_canvas(dom) == expected
    story = ids[:ids.index(EOT)] if EOT in ids else ids
    assert dom.text["text"] == "Once upon a time" + tok.decode(story)


def sudoku_run():
    """A random Sudoku model solving one held-out puzzle in the margin order, recorded: (recorder, the events,
    the puzzle, the filled board)."""
    from tinydiff.extras.sudoku import Board, held_out, solve, sudoku_model
    board = Board(2, 3)
    torch.manual_seed(0)
    model = sudoku_model(board, causal=False, n_layer=1, d_model=16, d_ff=32).eval()
    puzzle, _ = held_out(board, 1, 27)
    seen = []
    recorder = Recorder("sudoku, top_margin", None, [], "6x6 Sudoku, 27 holes", board=board, puzzle=puzzle[0])
    filled, _ = solve(model, puzzle, "top_margin", callback=lambda e: (seen.append(e), recorder(e)))
    return recorder, seen, puzzle[0], filled[0]


def test_a_sudoku_run_is_recorded_from_its_givens_one_cell_a_step():
    recorder, seen, puzzle, filled = sudoku_run()
    page = recorder.page()
    assert page["board"] == [2, 3] and page["start"] == puzzle.tolist() and len(page["steps"]) == len(seen) == 27
    assert page["pieces"] == {i: str(i + 1) for i in range(6)}
    canvas = list(page["start"])
    for step, event in zip(page["steps"], seen):
        assert len(step["set"]) == 1 and canvas[step["set"][0][0]] == MASK
        canvas[step["set"][0][0]] = step["set"][0][1]
        assert canvas == event["canvas"].tolist()
    assert canvas == filled.tolist()


@browser
def test_the_page_draws_a_sudoku_run_as_its_board(tmp_path):
    """Step i shows the board after i cells: the givens in bold, the cell filled at step i marked, thick lines
    between the boxes (after rows 2 and 4, before column 4 of a 6x6 board)."""
    recorder, seen, puzzle, _ = sudoku_run()
    page = tmp_path / "sudoku.html"
    recorder.write(page)
    for step in (0, 1, 27):
        dom = render_dom(page, tmp_path, step)
        squares = [attrs for tag, attrs in dom.tags if attrs.get("class", "").startswith("sq ")]
        expected = puzzle.tolist() if step == 0 else seen[step - 1]["canvas"].tolist()
        assert [int(a["data-id"]) for a in squares] == expected
        kinds = [a["class"].split()[1] for a in squares]
        assert kinds.count("given") == 9 and kinds.count("mask") == 27 - step and kinds.count("new") == min(step, 1)
        assert sum(" top" in a["class"] for a in squares) == 12 and sum(" left" in a["class"] for a in squares) == 6
    assert "row " in dom.text["info"] and dom.text["where"].endswith("27 / 27")


def run(*args):
    return run_in_process(generate.main, *args)


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpts")
    for name, kind in (("target", "ar"), ("mdlm", "mdlm"), ("drafter", "dflash")):
        save_checkpoint(folder / f"{name}.pt", kind=kind, config=models[name].config, model=models[name])
    block = replace(models["moe"].config, routing="block")  # generate.py decodes with the checkpoint's routing
    save_checkpoint(folder / "moe.pt", kind="mdlm-moe", config=block, model=models["moe"])
    return folder


@browser
@pytest.mark.parametrize("flags", [["--ckpt", "mdlm.pt", "--max-new-tokens", 16, "--block-length", 8],
                                   ["--ckpt", "target.pt", "--method", "ddtree", "--draft", "drafter.pt", "--budget", 6,
                                    "--max-new-tokens", 12, "--temperature", 0],
                                   ["--ckpt", "moe.pt", "--max-new-tokens", 16, "--block-length", 8]])
def test_generate_html_shows_the_run_and_no_prompt_runs_as_code(checkpoints, tmp_path, flags):
    """End to end: generate.py --html; the page's last step shows the text generate.py printed, it counts the
    rounds (or steps) the run made, a prompt of HTML and quotes is shown as text and runs nothing."""
    flags = [checkpoints / f if str(f).endswith(".pt") else f for f in flags]
    page = tmp_path / "run.html"
    res = run(*flags, "--prompt", HOSTILE, "--html", page, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["stats"]["page"] == str(page) and page.stat().st_size < 300_000
    rounds = out["stats"].get("rounds", out["stats"]["forwards"])
    dom = render_dom(page, tmp_path, "end")
    assert dom.text["text"] == out["text"] and dom.text["where"].endswith(f"{rounds} / {rounds}")
    assert [t for t, _ in dom.tags if t in ("img", "b")] == []
    assert dom.title == "tinydiff replay: " + ("ddtree" if "ddtree" in flags else "diffusion")
    assert dom.find(id="text") and HOSTILE in dom.text["text"]
    if "ddtree" in flags:  # every round's tree, drawn with the path the target followed
        events = json.loads(html.unescape(page.read_text().split('id="events">')[1].split("</script>")[0]))
        for i in (1, rounds):
            tree = render_dom(page, tmp_path, i)
            path = events["steps"][i - 1]["path"]
            assert tree.find(id="tree")[0]["data-path"] == ",".join(map(str, path))
            on = [int(a["data-node"]) for a in tree.find(**{"class": "node acc"})]
            assert on == path and len(tree.find(**{"class": "node"})) == len(events["steps"][i - 1]["nodes"]) - len(path)
    if checkpoints / "moe.pt" in flags:  # the experts each layer's block read, one cell per expert
        assert out["stats"]["routing"] == "block" and len(dom.find(**{"class": "cell both"})) >= 2


def test_hostile_text_cannot_end_the_events_script():
    page = render({"prompt": HOSTILE, "steps": []})
    inside = page.split('id="events">')[1].split("</script>")[0]
    assert "<" not in inside and ">" not in inside and "&" not in inside
    assert json.loads(inside)["prompt"] == HOSTILE


@pytest.mark.parametrize("where, message", [("missing/run.html", "does not exist"), (".", "is a folder"),
                                            ("exists.html", "exists; delete it or pass another path")])
def test_a_bad_html_path_is_refused_in_one_line_before_any_work(tmp_path, where, message):
    (tmp_path / "exists.html").write_text("keep me")
    res = run("--ckpt", tmp_path / "no-such.pt", "--prompt", "hi", "--html", tmp_path / where)  # no model read
    assert res.returncode == 1 and message in last_line(res.stderr) and "Traceback" not in res.stderr
    assert (tmp_path / "exists.html").read_text() == "keep me"
    with pytest.raises(Exception, match="exists"):
        check_page_path(tmp_path / "exists.html")
    check_page_path(tmp_path / "exists.html", overwrite=True)


def test_plain_ar_has_nothing_to_replay(checkpoints, tmp_path):
    res = run("--ckpt", checkpoints / "target.pt", "--prompt", "hi", "--html", tmp_path / "ar.html")
    assert res.returncode == 1 and "--html does not apply to --method ar" in last_line(res.stderr)
    assert not (tmp_path / "ar.html").exists()


BENCH_ROWS = ["ar", "spec-k2", "ssd-f1", "dflash-b8", "ddtree-n8", "ddtree-n16-reject", "eagle3-tree", "diffusion-cached",
              "diffusion-distilled-self-spec-k2", "diffusion-distilled-ar-drafted-k4", "dmoe-block"]
LOOPS = ("ar_generate", "speculative_generate", "ssd_generate", "dflash_generate", "ddtree_generate",
         "ddtree_sampled_generate", "eagle_generate", "generate_cached", "self_speculative_generate",
         "ar_drafted_generate")  # every loop the rows above call, by its name in methods.py


def page_events(path) -> dict:
    return json.loads(html.unescape(path.read_text().split('id="events">')[1].split("</script>")[0]))


@pytest.fixture(scope="module")
def bench_pages(models, checkpoints, tmp_path_factory):
    """python -m tinydiff.bench --html DIR, a row of every kind, one prompt, temperature 1, each loop the rows
    call wrapped to keep the ids it returns: (DIR, the run, per row [its warm-up's ids, its timed prompt's])."""
    drafter = random_drafter(models["target"], seed=6, block_size=8)  # blocks of 8: the dflash-b8 row
    save_checkpoint(checkpoints / "drafter8.pt", kind="dflash", config=drafter.config, model=drafter)
    decoded, folder = [], tmp_path_factory.mktemp("pages")

    def keep(loop):
        def run(*args, **kwargs):
            ids, result = loop(*args, **kwargs)
            decoded.append(list(ids))
            return ids, result
        return run
    with pytest.MonkeyPatch.context() as patch:
        for name in LOOPS:
            patch.setattr(bench_methods, name, keep(getattr(bench_methods, name)))
        ck = {name: checkpoints / f"{name}.pt" for name in ("target", "drafter8", "mdlm", "moe")}
        res = run_in_process(bench.main, "--ckpt", ck["target"], "--draft", ck["target"], "--drafter", ck["drafter8"],
                             "--mdlm", ck["mdlm"], "--distilled", ck["mdlm"], "--distilled-draft", ck["target"],
                             "--moe", ck["moe"], "--methods", ",".join(BENCH_ROWS), "--prompts", 1, "--new-tokens", 16,
                             "--temperature", 1, "--html", folder)
    assert res.returncode == 0, res.stderr
    assert len(decoded) == 2 * len(BENCH_ROWS)  # row by row: the untimed warm-up (recorded), the timed prompt
    return folder, res, dict(zip(BENCH_ROWS, zip(decoded[::2], decoded[1::2])))


def test_bench_html_pages_replay_the_tokens_each_row_decoded(bench_pages):
    folder, res, decoded = bench_pages
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{m}.html" for m in BENCH_ROWS if m != "ar")
    assert (f"--html: {len(BENCH_ROWS) - 1} pages in {folder}; none for ar (one token a forward: nothing to replay)"
            in res.stdout.splitlines())
    for method in BENCH_ROWS[1:]:
        recorded, timed = decoded[method]
        assert recorded == timed and len(timed) == 16  # recording changed no token of the row's decode
        page = page_events(folder / f"{method}.html")
        assert page["method"] == method and page["prompt"] == PROMPTS[0]
        kind = ("tree" if method.startswith(("ddtree", "eagle3-tree")) else
                "diffusion" if method.startswith(("diffusion", "dmoe")) else "chain")
        assert page["kind"] == kind and (page["experts"] is not None) == method.startswith("dmoe")
        if kind == "diffusion":  # the page's diffs rebuild the canvas the row decoded
            canvas = [MASK] * page["length"]
            for step in page["steps"]:
                for i, token in step["set"]:
                    canvas[i] = token
            assert canvas == timed and all(len(s["conf"]) == len(s["set"]) for s in page["steps"])
        else:
            assert sum((s["tokens"] for s in page["steps"]), []) == timed
        if method.startswith("ssd"):  # a round with drafts after the first (none looked up yet): did the cache hit
            assert "cached" not in page["steps"][0] and all("cached" in s for s in page["steps"][1:] if s["drafts"])


@browser
def test_a_bench_page_shows_the_rows_text(bench_pages, tok, tmp_path):
    """A self-speculative row's page (its rounds shown as diffusion steps, no confidences to show), in Chromium:
    step 1 shows the canvas after the row's first round, the last step the text the row decoded."""
    folder, _, decoded = bench_pages
    path = folder / "diffusion-distilled-self-spec-k2.html"
    page, timed = page_events(path), decoded["diffusion-distilled-self-spec-k2"][1]
    canvas = [MASK] * 16
    for i, token in page["steps"][0]["set"]:
        canvas[i] = token
    dom = render_dom(path, tmp_path, 1)
    assert shown_canvas(dom) == canvas and "undefined" not in dom.text["info"]
    dom = render_dom(path, tmp_path, "end")
    story = timed[:timed.index(EOT)] if EOT in timed else timed
    n = len(page["steps"])
    assert dom.text["text"] == PROMPTS[0] + tok.decode(story) and dom.text["where"].endswith(f"{n} / {n}")


@pytest.mark.parametrize("where, extra, message", [
    ("missing", [], "missing is missing; pass an existing folder"),
    ("file.txt", [], "file.txt is a file; pass an existing folder"),
    ("pages", [], "spec-k2.html exists; delete it or pass another path"),
    ("pages", ["--report", "report"], "--html writes the pages of one bench run, --report runs several")])
def test_bench_html_refuses_a_bad_folder_in_one_line_before_any_work(tmp_path, where, extra, message):
    (tmp_path / "file.txt").write_text("keep me")
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "spec-k2.html").write_text("keep me")
    extra = [tmp_path / e if e == "report" else e for e in extra]
    res = run_in_process(bench.main, "--ckpt", tmp_path / "no-such.pt", "--methods", "ar,spec-k2", "--html",
                         tmp_path / where, *extra)  # no model read
    assert res.returncode == 1 and message in last_line(res.stderr) and "Traceback" not in res.stderr
    assert (tmp_path / "file.txt").read_text() == (tmp_path / "pages" / "spec-k2.html").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "pages"]
