"""What a decode loop counts, and the typed result it returns beside its tokens.

Every decoder returns (new ids, result). `Decoded` is what all of them report: AR decoding and the
diffusion samplers. `Speculated` adds what a draft -> verify -> commit loop counts (speculative,
DFlash, DDTree, EAGLE-3): `accepted` is gpt-fast's accept_counts, and tau and alpha are derived
from the counts, never stored beside them. `SsdDecoded` adds what SSD's run-ahead counts, and
`SelfSpeculated` the canvases a batched verify ran (self_speculative.py). A loop counts with
`Tally.add`, one call per round, and `Tally.result` makes its result. `row()` is the flat dict of
a result for JSON and the stats line, derived numbers included.
"""
import time
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True, kw_only=True)
class Decoded:
    new_tokens: int
    forwards: int  # forwards of the model whose distribution is sampled (a speculative loop's target)
    seconds: float  # wall time, after waiting for the GPU
    DERIVED = ("tokens_per_s", "tokens_per_forward")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forwards

    def row(self) -> dict:
        return {**{name: getattr(self, name) for name in self.DERIVED}, **asdict(self)}  # the headline first


@dataclass(frozen=True, kw_only=True)
class Speculated(Decoded):
    accepted: list  # accepted[n]: rounds that accepted n drafts, n = 0..k (forwards = rounds + a prefill)
    proposed: int  # drafts (tree nodes) proposed over all rounds
    rejected: int | None  # rounds that rejected a draft (at most one each); None for trees
    draft_forwards: int
    slot_judged: list  # slot_judged[j]: rounds that offered slot j+1 (a draft at depth j+1) with slots 1..j kept
    slot_kept: list  # slot_kept[j]: those of them that kept it
    draft_seconds: float | None = None  # the chain loops (speculative, DFlash, DDTree): time drafting, and verifying
    verify_seconds: float | None = None
    graph_seconds: float | None = None  # the fused loops (a round one compiled graph): its calls to read-back
    DERIVED = Decoded.DERIVED + ("rounds", "tau", "alpha", "nodes_per_round", "acceptance_by_slot")

    @property
    def rounds(self) -> int:
        return sum(self.accepted)

    @property
    def tau(self) -> float:
        """New tokens per round (per verifying forward), the bonus/corrected token included: 1..k+1."""
        return self.new_tokens / self.rounds

    @property
    def alpha(self) -> float | None:
        """Leviathan's acceptance rate: the share of the drafts the target judged that it kept. Drafts
        after a rejection are never judged; counting them would make alpha fall with k for the same
        draft. None for trees (no single rate) and where nothing was judged."""
        kept = sum(n * count for n, count in enumerate(self.accepted))
        judged = kept + (self.rejected or 0)
        return kept / judged if self.rejected is not None and judged else None

    @property
    def acceptance_by_slot(self) -> list:
        """Slot k's acceptance given slots < k were accepted, k = 1..K (DSpark's per-position curve): for a
        tree, the chance that the accepted path goes one deeper. None where no round judged the slot."""
        return acceptance_by_slot(self.slot_kept, self.slot_judged)

    @property
    def nodes_per_round(self) -> float | None:
        """A tree's proposed nodes per round (None for chains)."""
        return self.proposed / self.rounds if self.rejected is None else None


@dataclass(frozen=True, kw_only=True)
class SsdDecoded(Speculated):
    """draft_forwards = jit_forwards + ahead_forwards (a batched run-ahead forward counts once)."""
    hits: list  # speculation-cache lookups that hit, per accepted count (a lookup follows every round
    lookups: list  # that a round with drafts follows)
    jit_forwards: int  # draft forwards run just in time (a miss, or the first round)
    ahead_forwards: int  # run-ahead forwards
    branches: int  # speculations pre-drafted
    seconds_jit: float
    seconds_waiting: float  # the main thread waiting for the run-ahead after verification
    draft_forward_seconds: float  # the per-forward costs the modelled times price
    target_forward_seconds: float
    modelled_seconds_ssd: float
    threaded: bool
    DERIVED = Speculated.DERIVED + ("hit_rate", "seconds_jit_avoided", "seconds_hidden", "modelled_seconds_sd",
                                    "modelled_speedup")

    @property
    def hit_rate(self) -> float | None:
        return sum(self.hits) / sum(self.lookups) if sum(self.lookups) else None

    @property
    def seconds_jit_avoided(self) -> float:
        """The drafts not drafted just in time (hits) times the measured seconds per such forward."""
        per_forward = self.seconds_jit / self.jit_forwards if self.jit_forwards else self.draft_forward_seconds
        return per_forward * (self.proposed - self.jit_forwards)

    @property
    def modelled_seconds_sd(self) -> float:
        """Plain speculative decoding's time at the same forward costs: a target forward per round, a
        draft forward per draft."""
        return self.rounds * self.target_forward_seconds + self.proposed * self.draft_forward_seconds

    @property
    def seconds_hidden(self) -> float:
        """Negative when the run-ahead outlasts verification."""
        return self.seconds_jit_avoided - self.seconds_waiting

    @property
    def modelled_speedup(self) -> float | None:
        return self.modelled_seconds_sd / self.modelled_seconds_ssd if self.modelled_seconds_ssd else None


@dataclass(frozen=True, kw_only=True)
class SelfSpeculated(Speculated):
    """self_speculative.py's loop: a batched verify forward counts once in `forwards`, its canvases here."""
    canvases: int  # the canvases its forwards ran: a forward of S canvases costs a CPU about S
    DERIVED = Speculated.DERIVED + ("canvases_per_token",)

    @property
    def canvases_per_token(self) -> float:
        return self.canvases / self.new_tokens


def acceptance_by_slot(kept: list, judged: list) -> list:
    """kept / judged per slot, None where no round judged it (Speculated's, and the bench's sums)."""
    return [k / n if n else None for k, n in zip(kept, judged)]


def split_time(device) -> float:
    """time.perf_counter() after waiting for the GPU, so the work queued before is billed before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def elapsed(start: float, device) -> float:
    """Seconds since `start`, after waiting for the GPU, so they are the wall time of real work."""
    return split_time(device) - start


def per_call_us(fn, calls: int, device) -> float:
    """Microseconds per call of fn over `calls` back-to-back calls (after 3 untimed ones), the GPU waited for
    at both ends: on CUDA the host's time per call where it is slower than the device, else the device's."""
    for _ in range(3):
        fn()
    start = split_time(device)
    for _ in range(calls):
        fn()
    return 1e6 * elapsed(start, device) / calls


def device_us(fn, calls: int) -> float:
    """Microseconds of the device's own time per call of fn (CUDA events around `calls` calls)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * begin.elapsed_time(end) / calls


@dataclass
class Tally:
    """What every draft/verify loop counts, one `add` per round. A loop that verifies trees passes
    chain=False: a tree has no single acceptance rate. `start` is when the loop's clock started."""
    k: int  # the most drafts a round can accept
    chain: bool = True
    prefill: int = 0  # 1 when a separate target forward read the prompt before the first round
    proposed: int = 0
    rejected: int = 0
    draft_forwards: int = 0
    hist: list = field(init=False)
    judged: list = field(init=False)  # per slot, see Speculated.slot_judged / slot_kept
    kept: list = field(init=False)
    start: float = field(init=False)
    draft_seconds: float | None = None  # summed by `clock` where a loop times its rounds' stages
    verify_seconds: float | None = None

    def __post_init__(self):
        self.hist, self.start = [0] * (self.k + 1), time.perf_counter()
        self.judged, self.kept = [0] * self.k, [0] * self.k

    def add(self, accepted: int, proposed: int, draft_forwards: int, depth: int | None = None):
        """One round: `accepted` drafts kept of `proposed` drafts (tree nodes), the drafts `depth` deep
        (a chain's depth is its length, the default; a tree passes its own)."""
        depth = proposed if depth is None else depth
        self.hist[accepted] += 1
        self.proposed += proposed
        self.rejected += self.chain and accepted < proposed
        self.draft_forwards += draft_forwards
        for j in range(min(accepted + 1, depth)):  # slot j+1 was judged: slots 1..j were kept
            self.judged[j] += 1
            self.kept[j] += j < accepted

    def clock(self, round_start: float, drafted: float, verified: float):
        """One round's stages, from split_time()s: drafting from round_start to drafted, verifying (the
        target's forward and the acceptance rule) from drafted to verified. The rest is the loop's own."""
        self.draft_seconds = (self.draft_seconds or 0.0) + drafted - round_start
        self.verify_seconds = (self.verify_seconds or 0.0) + verified - drafted

    def result(self, out, device, kind=Speculated, **more) -> Speculated:
        return kind(new_tokens=len(out), forwards=sum(self.hist) + self.prefill, seconds=elapsed(self.start, device),
                    accepted=list(self.hist), proposed=self.proposed, rejected=self.rejected if self.chain else None,
                    draft_forwards=self.draft_forwards, slot_judged=list(self.judged), slot_kept=list(self.kept),
                    draft_seconds=self.draft_seconds, verify_seconds=self.verify_seconds, **more)
