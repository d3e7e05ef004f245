"""Every lesson runs to the end as lessons/README.md says, from a folder without trained checkpoints
(what a fresh clone has): a lesson that breaks fails CI.

The index's own command is run, its optional [...] flags left out, and where a lesson states a
result, the test checks it in the lesson's output.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def index_commands() -> dict:
    """lesson file name -> the command in the index's `run` column, optional flags dropped."""
    commands = {}
    for line in (ROOT / "lessons" / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[3].startswith("`python lessons/"):
            command = re.sub(r"\s*\[[^]]*\]", "", cells[3].strip("`"))
            commands[command.split()[1].split("/")[1]] = command
    return commands


def test_lessons_have_distinct_numbers_in_reading_order_and_an_index_row_each():
    numbers = [int(p.name[:2]) for p in LESSONS]
    assert numbers[:2] == [1, 2] and len(set(numbers)) == len(numbers)
    assert sorted(index_commands()) == [p.name for p in LESSONS]


def test_every_file_a_lesson_quotes_exists_with_the_lines_it_says_and_no_lesson_imports_the_bench():
    quoted = re.compile(r"\b((?:tinydiff|tests|lessons|docs|scripts)/[\w/.-]*\w|(?:train|generate)\.py)"
                        r"(?: \(([\d,]+) lines\))?")
    for lesson in [*LESSONS, ROOT / "lessons" / "README.md"]:
        text = lesson.read_text()
        for path, lines in quoted.findall(text):
            assert (ROOT / path).exists(), f"{lesson.name} quotes {path}, which does not exist"
            if lines:
                assert len((ROOT / path).read_text().splitlines()) == int(lines.replace(",", "")), (lesson.name, path)
        assert not re.search(r"^\s*(from|import) tinydiff\.bench", text, re.M), f"{lesson.name} imports the bench"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.name for p in LESSONS])
def test_lesson_runs_as_the_index_says_without_checkpoints(lesson, tmp_path):
    argv = index_commands()[lesson.name].split()[2:]
    res = subprocess.run([sys.executable, str(lesson), *argv], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # no out/ here: the lesson takes its path for a fresh clone
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stdout.count("\n") > 5  # it narrated, to the end
    if lesson.name in ("09_dflash.py", "10_ddtree.py"):  # the claim: the loops write greedy ar's tokens
        verdicts = re.findall(r"same as ar: (\w+)", res.stdout)
        assert len(verdicts) >= 2 and set(verdicts) == {"True"}
    if lesson.name == "10_ddtree.py":  # and at T = 1, sampled children judged by rejection keep more than top-k ones
        kept = [(float(a), float(b)) for a, b in re.findall(r"kept if p's sample is one: ([\d.]+) \| .* rejection: ([\d.]+)",
                                                             res.stdout)]
        assert len(kept) == 2 and all(by_rejection > top_k for top_k, by_rejection in kept)
        assert kept[1][1] >= kept[0][1]
    if lesson.name == "07_speculative.py":  # the same claim, for every k of the table
        verdicts = re.findall(r"^\s+\d+\s+(True|False)\s", res.stdout, re.M)
        assert len(verdicts) >= 4 and set(verdicts) == {"True"}
    if lesson.name == "04_train_mdlm.py":  # the claim: the bound falls
        bounds = [float(b) for b in re.findall(r"held-out bound ([\d.]+)", res.stdout)]
        assert len(bounds) >= 5 and bounds[-1] < bounds[0] - 3
    if lesson.name == "11_eagle3.py":  # the claim: only the head that practised on its own features keeps drafting
        heads = re.findall(r"K = (\d): step accuracy ([\d. ]+?) \| tau ([\d.]+) .*output == greedy target: (\w+)",
                           res.stdout)
        assert [k for k, *_ in heads] == ["1", "3"] and {same for *_, same in heads} == {"True"}
        (_, once, tau_once, _), (_, unrolled, tau_unrolled, _) = heads
        once, unrolled = [float(a) for a in once.split()], [float(a) for a in unrolled.split()]
        assert once[0] > 0.9 and max(once[1:]) < 0.5 and min(unrolled) > 0.9
        assert float(tau_unrolled) > float(tau_once) + 1
    if lesson.name == "06_parallel_decoding.py":  # the claim: distillation makes it sure of the block
        confidences = dict(re.findall(r"^   (teacher|student) ((?:[\d.]+ ?){8})$", res.stdout, re.M))
        teacher, student = ([float(c) for c in confidences[name].split()] for name in ("teacher", "student"))
        assert teacher[0] > 2 * max(teacher[1:]) and min(student) > 0.8
        rows = re.findall(r"^   (teacher|student) ([a-z].+?)\s+([\d.]+)\s+([\d.]+)$", res.stdout, re.M)
        best = {name: max(float(fwd) for n, _, fwd, _ in rows if n == name) for name in ("teacher", "student")}
        assert len(rows) == 8 and best["teacher"] < 1.5 and best["student"] >= 4
        assert all(float(agree) >= 0.85 for n, _, fwd, agree in rows if n == "student" and float(fwd) >= 4)
        modes = dict(re.findall(r"^   (low_confidence|low_entropy)\s+([\d.]+)$", res.stdout, re.M))
        assert float(modes["low_confidence"]) > 0.9 and abs(float(modes["low_entropy"]) - 0.7) < 0.05  # fair: p 0.7
    if lesson.name == "13_fp4_experts.py":  # the claims: OCP's scale of the block, 4.25 bits, MXFP4 worse than bf16
        x, code = re.search(r"X = floor\(log2 amax\) - 2 = (-?\d+).*\n.*E8M0 byte (\d+)", res.stdout).groups()
        assert int(code) == int(x) + 127 and "MXFP4 reads 7.53x fewer expert bytes than fp32" in res.stdout
        errors = dict(re.findall(r"^\s+(bf16|mxfp4|nvfp4)\s.*\|\s+([\d.]+)%$", res.stdout, re.M))
        assert float(errors["bf16"]) < float(errors["nvfp4"]) < float(errors["mxfp4"])
    if lesson.name == "15_compiled_decoding.py":  # the claims: fixed shapes change no logit, compiling no token
        differences = [float(d) for d in re.findall(r"logits differ by ([\d.e+-]+)", res.stdout)]
        assert len(differences) == 2 and max(differences) < 1e-10
        verdicts = re.findall(r"same tokens as eager \(greedy\): (\w+)", res.stdout)
        assert verdicts == ["True", "True"]
    if lesson.name == "16_sudoku.py":  # the claims: a planned order solves what random order and the AR model cannot,
        best, random_order, ar = (float(x) for x in re.search(  # and threshold rules keep it in fewer forwards
            r"best order: \w+ ([\d.]+)% \| random: ([\d.]+)% \| ar: ([\d.]+)%", res.stdout).groups())
        assert best >= 40 and best >= 2 * random_order and best >= 2 * ar
        rules = {what: (float(rate), float(per_hole)) for what, rate, per_hole in
                 re.findall(r"^   top_margin, (.+?)\s+([\d.]+)%\s+[\d.]+\s+([\d.]+)$", res.stdout, re.M)}
        (one, _), (waiting, per_hole) = rules["cells per step 1"], rules["threshold 0.99"]
        assert len(rules) == 9 and waiting >= one - 2 and per_hole < 1
    assert not list(tmp_path.iterdir())  # and wrote nothing where it was run
