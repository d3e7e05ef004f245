"""Bad input, refused where it enters: the one exception type for user mistakes, and the validators
every entry point shares.

`UserError` is raised when input is wrong (a missing file, a prompt that does not fit, a number out of
range). Entry points catch it and print its message as one line, without a traceback, so the message
itself must say what to do instead. A number that a user or a checkpoint supplies is checked where it
enters (argparse, a config's construction, a checkpoint's load), before any work.

A `Rule` says what a number may be: an integer or a finite float, a closed or open range, and the
odd values outside the range that are meanings of their own (temperature 0 is greedy). It is an
argparse `type=` (it parses the text and checks it) and checks values that arrive already parsed
(a config field, a checkpoint's number) with `rule.check(name, value)`. Either way a bad number is
one line that names the setting and says what it takes. There is no "0 means the default": a 0
is a meaning the flag's help states, or it is outside the range.
Leaves out: units, cross-field checks (each caller states those, since only it knows them).
"""
import argparse
import math
from dataclasses import dataclass

BIG = 10**9            # no count here means anything past this: a larger one is a typo, and costs memory
SEED_MAX = 2**32 - 1   # seeds are combined with step numbers into torch's 64-bit seeds


class UserError(ValueError):
    """A mistake the user can fix; the message says how."""


def brief_error(error: Exception, limit: int = 160) -> str:
    """An exception's message squeezed onto one short line, cut at a word."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _show(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Rule:
    integer: bool = False   # an int (not a bool, not a float that happens to be whole)
    lo: float | None = None     # value >= lo
    hi: float | None = None     # value <= hi
    above: float | None = None  # value > above (an open lower bound)
    also: tuple = ()            # values outside the range that are meanings of their own

    def describe(self) -> str:
        bounds = [f"> {_show(self.above)}"] if self.above is not None else []
        bounds += [f">= {_show(self.lo)}"] if self.lo is not None else []
        bounds += [f"<= {_show(self.hi)}"] if self.hi is not None else []
        text = ("an integer" if self.integer else "a finite number") + " " + " and ".join(bounds)
        return " or ".join([*map(_show, self.also), text.strip()])

    def accepts(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if value in self.also:
            return True
        try:
            if not self.integer and not math.isfinite(value):
                return False
        except OverflowError:  # an int past float's range
            return False
        return ((self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)
                and (self.above is None or value > self.above))

    def check(self, name: str, value):
        """`value`, if this rule accepts it; else a UserError naming `name`."""
        if not self.accepts(value):
            raise UserError(f"{name} must be {self.describe()}, got {value!r}")
        return value

    def __call__(self, text: str):
        """argparse's type=: the text parsed and checked (argparse prefixes the flag's name)."""
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            value = None
        if value is None or not self.accepts(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        return value


COUNT = Rule(integer=True, lo=1, hi=BIG)        # how many of something, at least one
COUNT_OR_NONE = Rule(integer=True, lo=0, hi=BIG)  # the same where 0 is a stated meaning (none, all)
SEED = Rule(integer=True, lo=0, hi=SEED_MAX)
WEIGHT = Rule(lo=0, hi=1e6)                   # a loss weight, a decay: finite, >= 0
RATE = Rule(above=0, hi=10)                   # a learning rate
PROBABILITY = Rule(lo=0, hi=1)
MASS = Rule(above=0, hi=1)                    # top-p, a coreset's mass: some of it, at most all
# Dividing logits by a temperature far below 0.01 overflows float32; 0 is greedy, written as such.
TEMPERATURE = Rule(lo=0.01, hi=100, also=(0,))
NATS = Rule(lo=0)                             # an entropy bound (a huge one: commit the whole block)
POSITIVE = Rule(above=0, hi=1e6)              # a vote, a scale: finite, > 0
SIZE = Rule(integer=True, lo=1, hi=2**20)     # a model dimension: widths, lengths, layers
BLOCK = Rule(integer=True, lo=2, hi=1024)     # a drafter's block: the last committed token and B-1 drafts
DEPTH = Rule(integer=True, lo=1, hi=64)       # a drafter's own layers, an EAGLE-3 head's unrolled steps


def check_fields(config, rules: dict, what: str):
    """Each named field of a config (a dataclass) checked by its rule; bools must be bools."""
    for name, rule in rules.items():
        value = getattr(config, name)
        if rule is bool:
            if not isinstance(value, bool):
                raise UserError(f"{what} {name} must be true or false, got {value!r}")
        else:
            rule.check(f"{what} {name}", value)


def number_list(rule: Rule):
    """argparse type= for '0.9,0.7,0.5': a comma list whose every item `rule` accepts."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"needs a comma list of numbers, each {rule.describe()}, got {text!r}")
        try:
            return [rule(item) for item in items]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"every item must be {rule.describe()}, got {text!r}") from None
    return parse
