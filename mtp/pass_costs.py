"""What a decoding pass costs, learnt as a server runs: serve.py's load-aware rule reads it.

A pass's cost is modelled as load x shape(N), N the positions it feeds in all. The shape says how
passes compare; the load, how busy the machine is now. Splitting the two keeps a point timed in
a quiet spell from looking cheap in a busy one: with one last-seen time per point, the rule would
take extra positions that no longer pay.
"""

from mtp.engine import time_passes


class PassCosts:
    """C(N): seconds of a pass that feeds N positions in all (every row's pending tokens, drafts
    and masks), as the product of two things learnt from the passes the server runs:

        shape(N)  what a pass costs relative to others: piecewise linear in N between points at
                  N = 1, 2, 4, 8, ..., first timed at start-up on an idle server;
        load      how much slower than its shape every pass runs now (the HTTP side, the
                  clients, whatever else shares the machine).

    The rule compares k's at one moment, so load cancels from its choice: a busy spell moves
    load, not the shape, and a point timed in a quiet spell does not look cheap later. N is what
    a pass costs by, whatever the rows: the projections and the MLP run on the N positions
    packed, and attention is small at these lengths, so the passes at one load teach the rule
    at every other. To keep the shape near the rule's choice current, one pass in `every`
    computes a k next to it."""

    def __init__(self, points: dict, every=10):
        # N -> [shape, weight of the passes seen there lately]
        self.points = {n: [s, 0.5] for n, s in sorted(points.items())}
        self.load = 1.0
        self.every = every
        self.passes = 0
        # whether the next pass is one explore() chose
        self.exploring = False

    @classmethod
    def timed(cls, model, k_top: int, max_rows: int) -> "PassCosts":
        """Start-up timings: N up to the most a pass may feed (every row a full block of
        pending tokens and k_top - 1 masks), as B = min(N, max_rows) rows of N / B positions."""
        sizes = [2 ** i for i in range((max_rows * 2 * k_top - 1).bit_length() + 1)]
        shapes = [(-(-n // min(n, max_rows)), min(n, max_rows)) for n in sizes]
        return cls({k * b: s for (k, b), s in time_passes(model, shapes).items()})

    def __call__(self, n: int) -> float:
        return self.load * self.shape(n)

    def bracket(self, n: int):
        """The two points around n and the share of the upper one (beyond the last: the last
        two, extrapolated)."""
        ns = list(self.points)
        hi = next((m for m in ns[1:] if m >= n), ns[-1])
        lo = ns[ns.index(hi) - 1]
        return lo, hi, (n - lo) / (hi - lo)

    def shape(self, n: int) -> float:
        if len(self.points) == 1:
            return next(iter(self.points.values()))[0]
        lo, hi, w = self.bracket(n)
        s_lo, s_hi = self.points[lo][0], self.points[hi][0]
        # more positions never cost less (a timing that says so is noise)
        return max(s_lo, s_lo + w * (s_hi - s_lo))

    def observe(self, n: int, seconds: float):
        """A pass the server ran: N positions in `seconds`."""
        if len(self.points) > 1:
            # The two points around N move toward this pass at the current load, each by its
            # share over its weight: the passes seen there lately (each weighs 2% less with
            # every pass the server runs). A point the rule runs all the time moves by a
            # fiftieth, so a busy spell goes to the load; one it runs now and then, by most of
            # the way.
            lo, hi, w = self.bracket(n)
            error = seconds / self.load - self.shape(n)
            for point in self.points.values():
                point[1] *= 0.98
            for m, share in ((lo, 1 - min(w, 1)), (hi, min(w, 1))):
                point = self.points[m]
                point[1] += share
                point[0] = max(1e-6, point[0] + error * share / point[1])
        if not self.exploring:
            # the passes of the rule's own choice set the load; an explored one, timed against
            # them, teaches only the shape
            self.load += (seconds / self.shape(n) - self.load) / 2
        self.exploring = False
        self.passes += 1

    def explore(self, best: int, top: int) -> int:
        """The k to compute in this pass: mostly `best`, the rule's choice; one pass in
        `every` the k above it, the next such pass the k below (where they exist)."""
        if (self.passes + 1) % self.every:
            return best
        up = self.passes // self.every % 2 == 0
        near = [k for k in ((best + 1, best - 1) if up else (best - 1, best + 1))
                if 1 <= k <= top]
        self.exploring = bool(near)
        return near[0] if near else best
