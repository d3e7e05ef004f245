"""Every entry point's --help names the command as it is typed and shows the default of every flag
that takes a value and has a default."""
import argparse
import importlib

import pytest

import generate
import train
from tinydiff.bench import hf as hf_bench
from tinydiff.bench import quality
from tinydiff.bench import table as bench
from tinydiff.io.cli import stats_line
from tinydiff.tools import eval as pinned_eval
from tinydiff.tools import export


def kernel_bench(argv):  # imported when called: Triton must not load before the kernel tests set its mode
    return importlib.import_module("tinydiff.bench.kernels").main(argv)


ENTRY_POINTS = {"python train.py": train.parse_args, "python generate.py": generate.parse_args,
                "python -m tinydiff.bench": bench.parse_args, "python -m tinydiff.bench.quality": quality.parse_args,
                "python -m tinydiff.bench.kernels": kernel_bench, "python -m tinydiff.tools.export": export.parse_args,
                "python -m tinydiff.bench.hf": hf_bench.parse_args, "python -m tinydiff.tools.eval": pinned_eval.parse_args,
                **{f"python -m tinydiff.extras.{name}": importlib.import_module(f"tinydiff.extras.{name}").main
                   for name in ("self_speculative", "drafted_diffusion", "self_correction", "dflash_reject",
                                "ddtree_sampled", "markov_head")}}


def parser_of(entry_point, monkeypatch) -> argparse.ArgumentParser:
    """The parser the entry point builds, caught as it starts to parse."""
    caught = []

    def catch(self, *args, **kwargs):
        caught.append(self)
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        entry_point([])
    monkeypatch.undo()
    return caught[0]


@pytest.mark.parametrize("prog", ENTRY_POINTS)
def test_help_names_the_command_and_every_default(prog, monkeypatch):
    parser = parser_of(ENTRY_POINTS[prog], monkeypatch)
    assert parser.format_help().startswith(f"usage: {prog} ")
    valued = [a for a in parser._actions if a.option_strings and a.nargs != 0 and a.default is not None]
    assert valued  # every entry point has some
    for action in valued:
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        entry = formatter.format_help()
        assert "default" in entry, entry


def test_generate_prints_stats_that_apply_and_says_what_its_tau_counts():
    line = stats_line({"rounds": 5, "rejected": None, "alpha": None, "tau": 4.8, "forwards": 6})
    assert line == "rounds 5 | tau (tokens per round) 4.8 | forwards 6"  # a tree has no alpha to print
