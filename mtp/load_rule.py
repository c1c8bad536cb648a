"""What serve.py's load-aware rule measures as the server runs: the tokens a pass keeps
(Acceptance) and what a pass costs (PassCosts).

A pass's cost is modelled as load x shape_B(N), N the positions it feeds to B rows. The shape
says how passes compare; the load, how busy the machine is now. Splitting the two keeps a point
timed in a quiet spell from looking cheap in a busy one: with one last-seen time per point, the
rule would take extra positions that no longer pay.
"""

import statistics
import time
from collections import Counter

import torch

from mtp.engine import synchronize, time_passes


class Acceptance:
    """E(k) for one rule: the tokens a row keeps from a pass of k positions. From every pass:
    how often the j-th prediction is kept when the (j-1)-th was (starting from 1 in 2)."""

    def __init__(self):
        self.tried = Counter()
        self.kept = Counter()

    def observe(self, k: int, n: int):
        # the j-th of k predictions was tried if the first j-1 were kept
        for j in range(2, k + 1):
            if n >= j - 1:
                self.tried[j] += 1
                self.kept[j] += n >= j

    def curve(self, top: int) -> tuple[list[float], list[float]]:
        """E = [0, E(1), ..., E(top)] and every = [1, 1, P(first 2 kept), ..., P(all top kept)]."""
        e = [0.0, 1.0]
        every = [1.0, 1.0]
        for j in range(2, top + 1):
            every.append(every[-1] * (self.kept[j] + 1) / (self.tried[j] + 2))
            e.append(e[-1] + every[-1])
        return e, every


class PassCosts:
    """C(N, B): seconds of a pass that feeds N positions in all (every row's pending tokens, drafts
    and masks) to B rows, as the product of two things learnt from the passes the server runs:

        shape_B(N)  what a pass costs relative to others: for each B = 1, 2, 4, ... max_rows (a B
                    in between takes the next larger one's), piecewise linear in N between points
                    at N = B, 2B, 4B, ..., first timed at start-up on an idle server; where
                    the matrix kernels take positions in tiles (`tile`, measured at start-up),
                    N beyond the first tile is rounded up to a whole one;
        load        how much slower than its shape every pass runs now (the HTTP side, the
                    clients, whatever else shares the machine).

    The rule compares k's at one moment, so load cancels from its choice: a busy spell moves
    load, not the shapes, and a point timed in a quiet spell does not look cheap later. N and B
    both count: the projections and the MLP run on the N positions packed, but each row's
    attention reads its own cache. To keep the shape near the rule's choice and at greedy's
    current, one pass in `every` computes a k next to it or k = 1 (`explore`)."""

    def __init__(self, points: dict, every=10, tile=1):
        # {B: {N: [shape, weight of the passes seen there lately]}}
        self.curves = {b: {n: [s, 0.5] for n, s in sorted(ps.items())}
                       for b, ps in sorted(points.items())}
        self.tile = tile
        self.load = 1.0
        self.every = every
        self.passes = 0
        # whether the next pass is one explore() chose
        self.exploring = False
        # an explored k still held, and for how many more passes
        self.held = None

    @classmethod
    def timed(cls, model, k_top: int, max_rows: int) -> "PassCosts":
        """Start-up timings: B rows of k = 1, 2, 4, ... positions, up to what a row may feed (a
        full block of pending tokens and k_top - 1 masks)."""
        sizes = sorted({min(2 ** i, max_rows) for i in range(max_rows.bit_length() + 1)})
        ks = [2 ** i for i in range((2 * k_top - 2).bit_length() + 1)]
        points = {}
        for (k, b), s in time_passes(model, [(k, b) for b in sizes for k in ks]).items():
            points.setdefault(b, {})[k * b] = s
        return cls(points, tile=measure_tile(model))

    def __call__(self, n: float, B: int) -> float:
        return self.load * shape(self.curve(B), n, self.tile)

    def curve(self, B: int) -> dict:
        return self.curves[min((b for b in self.curves if b >= B), default=max(self.curves))]

    def observe(self, n: float, B: int, seconds: float | None):
        """A pass the server ran: N positions over B rows in `seconds` (None: a pass that also
        fed a joining row's prompt; it costs what a prompt does, and teaches nothing of k)."""
        if seconds is not None:
            self.learn(n, B, seconds)
        self.exploring = False
        self.passes += 1

    def learn(self, n: float, B: int, seconds: float):
        points = self.curve(B)
        if len(points) > 1:
            # The two points around N move toward this pass at the current load, each by its
            # share over its weight: the passes seen there lately (each weighs 2% less with
            # every pass the server runs). A point the rule runs all the time moves by a
            # fiftieth, so a busy spell goes to the load; one it runs now and then, by most of
            # the way.
            lo, hi, w = bracket(points, n, self.tile)
            error = seconds / self.load - shape(points, n, self.tile)
            for curve in self.curves.values():
                for point in curve.values():
                    point[1] *= 0.98
            w = min(max(w, 0.0), 1.0)
            for m, share in ((lo, 1 - w), (hi, w)):
                point = points[m]
                point[1] += share
                point[0] = max(1e-6, point[0] + error * share / point[1])
        if not self.exploring:
            # the passes of the rule's own choice set the load; an explored one, timed against
            # them, teaches only the shape
            self.load += (seconds / shape(points, n, self.tile) - self.load) / 2

    def explore(self, best: int, top: int, span: int = 1, near_pays: bool = True) -> int:
        """The k to compute in this pass: mostly `best`, the rule's choice; one pass in
        `every` the k above it, the next such pass the k below, then k = 1, in turn (where
        they exist): greedy's price, the one the rule must never do worse than, stays current
        however far the rule's choice is from it. From k = 1, where extra positions did not
        pay, a third as often, and only while the prices say k = 2 nearly pays (`near_pays`):
        at many rows a try costs up to half a pass more than greedy's, and a price that far
        off is not worth checking. An explored k above 1 holds for `span` passes: a lossless
        row's masks only draft, and the pass after verifies the drafts (tried for one pass
        from k = 1, they would be dropped unread)."""
        if self.held:
            k, left = self.held
            self.held = (k, left - 1) if left > 1 else None
            self.exploring = True
            return k
        if (self.passes + 1) % (self.every * (3 if best == 1 else 1)):
            return best
        if best == 1 and not near_pays:
            return best
        near = [k for k in dict.fromkeys((best + 1, best - 1, 1)) if 1 <= k <= top and k != best]
        self.exploring = bool(near)
        turn = (self.passes + 1) // self.every - 1
        k = near[turn % len(near)] if near else best
        if k > 1 and span > 1:
            self.held = (k, span - 1)
        return k


def measure_tile(model, repeats=5) -> int:
    """16 where the matrix kernels take a matrix's rows (here: positions) 16 at a time, as
    oneDNN's AMX kernels do: there 17 positions cost about what 32 do, and 33 what 48 do (within
    the first tile a pass's cost grows only with its attention and pointwise work). Else 1: on
    AVX-512 without AMX the cost grows smoothly with the positions. Timed on the model's own
    MLP weights, each layer's in turn so that they come from memory, as in a pass."""
    weights = [layer.mlp.up.weight for layer in model.layers]
    times = {m: [] for m in (16, 17, 32)}
    with torch.inference_mode():
        for _ in range(repeats):
            for m in times:
                x = torch.zeros(m, weights[0].shape[1], dtype=weights[0].dtype,
                                device=weights[0].device)
                start = time.perf_counter()
                for w in weights:
                    torch.nn.functional.linear(x, w)
                synchronize(x.device)
                times[m].append(time.perf_counter() - start)
    t16, t17, t32 = (statistics.median(times[m]) for m in (16, 17, 32))
    return 16 if t17 - t16 > (t32 - t16) / 2 else 1


def bracket(points: dict, n: float, tile=1):
    """The two points around n, beyond the first tile rounded up to a whole one, and the share
    of the upper one: beyond the last, the last two and a share above 1; below the first, the
    first two and a share below 0 (both extrapolated), or 0 where the kernels take tiles (a few
    positions fewer than a tile cost about the same)."""
    ns = list(points)
    if tile > 1 and n > tile:
        n = -(-n // tile) * tile
    hi = next((m for m in ns[1:] if m >= n), ns[-1])
    lo = ns[ns.index(hi) - 1]
    w = (n - lo) / (hi - lo)
    return lo, hi, w if tile == 1 else max(0.0, w)


def shape(points: dict, n: float, tile=1) -> float:
    """A curve's shape at n, linear between its points (beyond the first tile, at whole
    tiles), and below the first: 9 rows, priced on the 16-row curve, feed 9 positions at k = 1,
    not 16 (at 16's price, k = 1 looks dear and k = 2 cheap beside it)."""
    if len(points) == 1:
        return next(iter(points.values()))[0]
    lo, hi, w = bracket(points, n, tile)
    s_lo, s_hi = points[lo][0], points[hi][0]
    # more positions never cost less (a timing that says so is noise); B rows take the curve of
    # the next size up, so n >= lo / 2 (w >= -1/2): at least half the first point
    return max(s_lo / 2, s_lo + w * max(0.0, s_hi - s_lo))
