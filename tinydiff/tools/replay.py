"""See it happen: one run of any decoding method recorded, and written as ONE self-contained web page
that replays it step by step (replay.html beside this file: inline CSS and JavaScript, no network);
and `CanvasView`, generate.py's live diffusion canvas on a terminal.

    python generate.py --ckpt out/tour-mdlm/ckpt.pt --prompt "Tom had a dog" --html out/replay.html
    python -m tinydiff.bench --methods spec-k4,ddtree-n32,diffusion --html out/pages  # a page per row

Recording rides on the callbacks the loops already take, so no loop changes and an unrecorded run pays
nothing (the loops skip a callback that is None): the diffusion samplers call `callback(event)` after
every step (sampler.py's Trace: the canvas, the positions committed, their confidences), every
speculative loop calls `on_round(info)` after every round (speculative.py, ssd.py, dflash.py, ddtree.py,
eagle3.py: the drafts or the tree, what was accepted, what was committed). A `Recorder` is both: pass
it as either, it keeps a compact copy of each event. On a mixture-of-experts model it also reads, at
every step, the routing each MoE layer kept from that step's forward (`layer.last`): the experts the
decoding block's tokens read, and those token routing would have read from the same router scores.

The page gets only data: the events as JSON inside a <script type="application/json"> with <, > and &
escaped (so no text, a prompt's "</script>" included, can end the script), and its JavaScript writes
text with textContent, never as HTML. Each token travels as its bytes (a string of chars 0-255): the
page decodes them as UTF-8 itself, so the text it shows is the tokens', not a copy of the run's.
A Sudoku run (tinydiff/extras/sudoku.py's solve, lessons/16_sudoku.py) is a diffusion run whose canvas starts with
the puzzle's givens: the page draws it as the board, boxes outlined, givens in bold.
Leaves out: batches, plain AR decoding (one token a forward: nothing to see), live streaming to the page.
"""
import json
import os
import shutil
import sys
from pathlib import Path

from tinydiff.checks import UserError
from tinydiff.io.files import check_output, write_atomic
from tinydiff.tokenizer import EOT, MASK

TEMPLATE = Path(__file__).with_name("replay.html")
TREES = ("ddtree", "eagle3")  # methods whose rounds may be trees


def check_page_path(path, what: str = "--html", overwrite: bool = False):
    """Before any work: the page can be written to `path` (a file in an existing, writable folder), and
    nothing is there already unless `overwrite`."""
    check_output(path, what)
    if not overwrite and os.path.lexists(path):
        raise UserError(f"{what} {path} exists; delete it or pass another path")


class Recorder:
    """Callable as a diffusion sampler's callback and as a speculative loop's on_round: keeps each event."""

    def __init__(self, method: str, tokenizer, prompt: list[int], prompt_text: str, model=None, board=None,
                 puzzle=None):
        """board, puzzle: a Sudoku run's board (extras.sudoku.Board) and puzzle (its cells' ids, HOLE where empty);
        the tokenizer is then not read, the prompt is empty and the canvas starts as the puzzle."""
        self.method, self.tokenizer, self.prompt, self.prompt_text = method, tokenizer, prompt, prompt_text
        self.steps, self.seq = [], list(prompt)
        self.board, self.start = board, None if puzzle is None else [int(i) for i in puzzle]
        self.canvas = self.start
        self.layers = [m for m in model.modules() if hasattr(m, "router")] if model is not None else []
        self.routing = []  # per diffusion step: per MoE layer (experts (T, k), token routing's (T, k))

    def __call__(self, event: dict):
        (self.step if "canvas" in event else self.round)(event)

    def step(self, event):
        """A diffusion step: the positions that changed (committed, or re-masked by a variant), their
        confidences (the remasking rule's score), the block."""
        canvas = event["canvas"][len(self.prompt):].tolist()  # the answer's positions
        before = self.canvas or [MASK] * len(canvas)
        changed = [i for i, (a, b) in enumerate(zip(before, canvas)) if a != b]
        confidences = event.get("confidences")  # the sampler's live tensor: read it now
        scores = ([None] * len(changed) if confidences is None  # a sampler that scores nothing (self-speculation)
                  else confidences[[len(self.prompt) + i for i in changed]].tolist())
        self.steps.append({"block": event["block"], "set": [[i, canvas[i]] for i in changed],
                           "conf": [float(f"{c:.3g}") if c is not None and abs(c) < 1e9 else None for c in scores]})
        self.canvas = canvas
        if self.layers:  # the routing of this step's forward, what each layer kept of it
            self.routing.append([(layer.last["experts"][0], layer.last["scores"][0].topk(layer.top_k).indices)
                                 for layer in self.layers])

    def round(self, info):
        """A speculative round: its drafts (chain) or tree, how many were accepted, the tokens committed."""
        root, tokens = self.seq[-1], info["tokens"]
        self.seq += tokens
        entry = {"n": info["accepted"], "tokens": tokens}
        if "tree" in info:
            tree = info["tree"]
            entry["nodes"] = [[t, d, p, round(s, 2)] for t, d, p, s in zip(
                tree.tokens.tolist(), tree.depths.tolist(), tree.parents.tolist(), tree.scores.tolist())][1:]
            entry["path"], entry["root"] = [int(i) for i in info["path"]], root
        else:
            entry["drafts"] = list(info["drafts"])
        if info.get("cached") is not None:  # SSD: this round's drafts came from the speculation cache, or not
            entry["cached"] = bool(info["cached"])
        self.steps.append(entry)

    def block_length(self) -> int:
        """A diffusion run's block: its canvas over its blocks (the events count them)."""
        return len(self.canvas) // (1 + max(step["block"] for step in self.steps)) if self.canvas else 0

    def experts(self):
        """Per step, per MoE layer, [experts the decoding block read, experts token routing would read]:
        the block's rows are its positions in a whole-canvas forward, else the forward's last rows."""
        if not self.routing:
            return None
        P, n, block_length, out = len(self.prompt), len(self.canvas), self.block_length(), []
        for step, layers in zip(self.steps, self.routing):
            lo = P + step["block"] * block_length
            rows = [(slice(lo, lo + block_length) if len(read) == P + n else slice(len(read) - block_length, None))
                    for read, _ in layers]
            out.append([[sorted(set(read[r].flatten().tolist())), sorted(set(token[r].flatten().tolist()))]
                        for (read, token), r in zip(layers, rows)])
        return out

    def page(self) -> dict:
        """What the page replays: the method, the prompt's text, every event, each token's bytes."""
        ids = set(self.prompt[-1:]) | {i for step in self.steps for _, i in step.get("set", [])}
        for step in self.steps:
            ids |= {*step.get("tokens", []), *step.get("drafts", []), *(node[0] for node in step.get("nodes", []))}
        if self.board is not None:  # a Sudoku board's ids are its digits 1..n
            pieces = {i: str(i + 1) for i in range(self.board.n)}
        else:  # bytes 0-255 as chars 0-255: JSON carries them, the page decodes UTF-8
            pieces = {i: self.tokenizer.bpe.decode_single_token_bytes(i).decode("latin-1") for i in sorted(ids)
                      if i not in (MASK, EOT)}
        kind = "diffusion" if self.canvas is not None else "tree" if any("nodes" in s for s in self.steps) else "chain"
        board = None if self.board is None else [self.board.box_rows, self.board.box_cols]
        return {"method": self.method, "kind": kind, "prompt": self.prompt_text, "length": len(self.canvas or []),
                "block": self.block_length(), "mask": MASK, "eot": EOT, "pieces": pieces, "steps": self.steps,
                "experts": self.experts(), "board": board, "start": self.start}

    def write(self, path, overwrite: bool = False) -> str:
        """The page, written atomically to `path`; returns the path."""
        if not self.steps:
            raise UserError("nothing was recorded: pass the Recorder as the loop's callback or on_round")
        check_page_path(path, "the page", overwrite)
        html = render(self.page())
        write_atomic(path, lambda f: f.write(html.encode("utf-8")))
        return str(path)


def render(data: dict) -> str:
    """The template with `data` inside as JSON that no text can break out of (<, >, & as \\u escapes)."""
    payload = json.dumps(data, separators=(",", ":"))  # ASCII: every other character is a \\u escape too
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    template = TEMPLATE.read_text(encoding="utf-8")
    if template.count("__EVENTS__") != 1:
        raise UserError(f"{TEMPLATE} must hold __EVENTS__ exactly once")
    return template.replace("__EVENTS__", payload)


class CanvasView:
    """Redraws the canvas in place as the sampler commits tokens (masks show as placeholders)."""

    def __init__(self, tokenizer, prompt_text: str, prompt_len: int):
        self.tokenizer, self.prompt_text, self.prompt_len = tokenizer, prompt_text, prompt_len
        self.width, self.lines = shutil.get_terminal_size().columns, 0

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
