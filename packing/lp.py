"""``lp``: depth-limited packing as a linear program over strategies, with a certificate.

Formulation (the cutting-stock / Gilmore-Gomory model over the histogram). Let
``l_1 < ... < l_n`` be the lengths that occur, ``b_k`` their counts. A *strategy* is a
multiset of those lengths with sum <= L and at most ``depth`` members; ``x_s >= 0`` is how
often it is used. A slot of length ``l_k`` may also hold any shorter sequence (the rest of
it becomes padding), which the LP expresses with transfer variables ``z_k >= 0`` that
move slots from length ``l_k`` down to ``l_{k-1}``::

    minimise   sum_s x_s
    subject to sum_s A[k, s] x_s + z_{k+1} - z_k >= b_k      for every length k
               x >= 0, z >= 0

This is exactly the packing problem once x is integral, so its optimum (the LP bound)
is a lower bound on the number of packs of *every* plan with that depth.

Column generation: the LP starts from every non-dominated strategy of up to three
members (enumerated, about L^2/12 of them; at depth <= 3 that is the complete set, so
one solve suffices) plus the strategies of a heuristic plan, and is solved with HiGHS
(scipy.optimize.linprog). Its duals ``y_k`` (non-negative, non-decreasing in the length,
by the transfer columns) price a strategy at ``1 - sum of y over its members``; the most
negative one is a knapsack with a cardinality limit, solved exactly by dynamic
programming over (members, capacity) in O(depth * L * levels) (O(L * levels) for
unlimited depth), where ``levels`` is the number of distinct dual values. So the column
set is never enumerated beyond depth 3: L = 4096 and depth > 3 work.

Certificate (what ``lp_bound_packs`` certifies): no assignment of these sequences, kept
whole, to packs of at most L tokens and at most ``depth`` sequences uses fewer packs.
Proof: for any duals ``y >= 0`` (non-decreasing) and ``V = max(1, best knapsack value)``,
``y / V`` is dual feasible for the LP over *all* strategies, so ``b . y / V`` (Farley's
bound) bounds that LP's optimum, which bounds every integer plan. ``lp_bound_packs`` is
its ceiling (less a float round-off margin), and ``details["lp_duals"]`` are the scaled
duals, so anyone can re-check it. It is valid even if generation stops early (round or
time limit; then it is weaker); when pricing finds no improving column it equals the
ceiling of the LP optimum.

Integer plan: floor the LP solution, fill its slots with sequences (longest sequences
into the shortest slot that holds them), re-solve the LP on what is left a few times,
and pack the last few hundred sequences with the best heuristic. On small datasets
(<= 10,000 sequences, where a few packs matter), a time-limited MILP over the columns in
use comes first: it keeps the floor of the LP solution and decides only the sequences the
floor leaves (a few per column, so HiGHS settles it in a fraction of a second); when its
plan meets the bound, the repair rounds are skipped, else the better plan is kept.
"""
import math
import time

import numpy as np

from .heuristics import pack_bfd, pack_lpfhp, pack_spfhp
from .histogram import LengthCounts, as_length_counts

_PRICE_TOLERANCE = 1e-9
_DP_CHUNK_ELEMENTS = 2_000_000  # items x capacities evaluated per numpy step in the DP
_MAX_BOUND_CELLS = 2**16  # the certificate's pricing grid, at most (see _Pricer)


def _scipy():
    """scipy.optimize and scipy.sparse, imported on first use (a faster command line)."""
    from scipy import optimize, sparse
    return optimize, sparse


class _Columns:
    """The restricted master problem's strategies as tuples of item indices (ascending).

    The strategy block is cached and extended with only the columns added since the last call,
    so wide masters are not rebuilt from Python lists every round.
    """

    def __init__(self):
        self.items = []
        self.known = set()
        self._built = None  # (num_items, num_columns, csc matrix of the strategy columns)
        self._flat = (np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))  # CSR (members, offsets)

    def values(self, duals):
        """np.float64 [num_columns]: each strategy's value (sum of its members' duals), numpy only."""
        members, offsets = self._flat
        done = offsets.size - 1
        if done < len(self.items):
            new = self.items[done:]
            sizes = np.fromiter((len(items) for items in new), dtype=np.int64, count=len(new))
            members = np.concatenate([members, np.fromiter((k for items in new for k in items), dtype=np.int64,
                                                           count=int(sizes.sum()))])
            offsets = np.concatenate([offsets, offsets[-1] + np.cumsum(sizes)])
            self._flat = (members, offsets)
        sums = np.concatenate([[0.0], np.cumsum(duals[members])])
        return sums[offsets[1:]] - sums[offsets[:-1]]

    def add(self, items):
        key = tuple(sorted(items))
        if key and key not in self.known:
            self.known.add(key)
            self.items.append(key)
            return True
        return False

    def _strategy_block(self, start, num_items):
        _, sparse = _scipy()
        new = self.items[start:]
        sizes = np.fromiter((len(items) for items in new), dtype=np.int64, count=len(new))
        rows = np.fromiter((k for items in new for k in items), dtype=np.int64, count=int(sizes.sum()))
        cols = np.repeat(np.arange(len(new)), sizes)
        return sparse.csc_matrix((np.ones(rows.size), (rows, cols)), shape=(num_items, len(new)))

    def strategy_matrix(self, num_items):
        """Sparse [num_items, num_columns]: how often each strategy holds each item."""
        _, sparse = _scipy()
        built = self._built
        if built is None or built[0] != num_items or built[1] > len(self.items):
            block = self._strategy_block(0, num_items)
        elif built[1] < len(self.items):
            block = sparse.hstack([built[2], self._strategy_block(built[1], num_items)], format="csc")
        else:
            block = built[2]
        self._built = (num_items, len(self.items), block)
        return block

    def matrix(self, num_items):
        """Sparse [num_items, num_columns + num_items - 1]: strategies, then transfers
        (z_k moves one slot of item k down to item k - 1: +1 in row k-1, -1 in row k)."""
        _, sparse = _scipy()
        k = np.arange(1, num_items)
        transfers = sparse.csc_matrix(
            (np.concatenate([np.ones(k.size), -np.ones(k.size)]), (np.concatenate([k - 1, k]), np.tile(k - 1, 2))),
            shape=(num_items, max(0, num_items - 1)))
        return sparse.hstack([self.strategy_matrix(num_items), transfers], format="csc")


def _master_problem(columns, num_items):
    """(matrix, cost, num_columns) of the master: one pack per strategy, transfers free."""
    matrix = columns.matrix(num_items)
    num_columns = len(columns.items)
    cost = np.zeros(matrix.shape[1])
    cost[:num_columns] = 1.0
    return matrix, cost, num_columns


def _solve_master(columns, demand):
    """The master LP with scipy's HiGHS, from scratch (``master="scipy"``: kept to measure
    the warm-started :class:`_HighsMaster` against)."""
    optimize, _ = _scipy()
    matrix, cost, num_columns = _master_problem(columns, demand.size)
    # Interior point (with crossover) is the faster HiGHS solver on the wide masters that
    # enumeration produces; dual simplex wins on the narrow ones of later rounds.
    method = "highs-ipm" if num_columns > 15000 else "highs-ds"
    result = optimize.linprog(cost, A_ub=-matrix, b_ub=-demand, bounds=(0, None), method=method)
    if result.status != 0:
        raise RuntimeError(f"HiGHS failed on the packing LP: {result.message}")
    duals = -np.asarray(result.ineqlin.marginals)
    return float(result.fun), result.x[:num_columns], duals


class _OutOfTime(Exception):
    """The call's deadline passed inside a solve or a pricing step."""


def _check(deadline):
    if deadline is not None and time.perf_counter() > deadline:
        raise _OutOfTime


_HIGHSPY = []


def _new_highs():
    """A silent ``highspy.Highs``. The first one prints a banner on the C-level stdout, which
    would corrupt ``--json`` output, so that one is built with file descriptor 1 pointed at
    /dev/null."""
    if not _HIGHSPY:
        import os
        import sys

        import highspy
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 1)
                highs = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _HIGHSPY.append(highspy)
    else:
        highs = _HIGHSPY[0].Highs()
    highs.setOptionValue("output_flag", False)
    return highs


class _HighsMaster:
    """The restricted master LP, kept in one HiGHS instance across column-generation rounds:
    new columns are appended and HiGHS re-optimises from the previous basis (a few simplex
    iterations) instead of solving from scratch every round."""

    def __init__(self, demand, columns):
        self.highs = highs = _new_highs()
        highspy = _HIGHSPY[0]
        self.inf = highspy.kHighsInf
        self.optimal = highspy.HighsModelStatus.kOptimal
        n = demand.size
        self.num_items = n
        highs.addRows(n, demand.astype(np.float64), np.full(n, self.inf), 0, np.zeros(n, dtype=np.int32),
                      np.zeros(0, dtype=np.int32), np.zeros(0))
        k = np.arange(1, n, dtype=np.int32)  # transfer z_k: +1 in row k-1, -1 in row k
        if k.size:
            indices = np.stack([k - 1, k], axis=1).ravel().astype(np.int32)
            values = np.tile([1.0, -1.0], k.size)
            highs.addCols(k.size, np.zeros(k.size), np.zeros(k.size), np.full(k.size, self.inf), indices.size,
                          (2 * np.arange(k.size)).astype(np.int32), indices, values)
        self.offset = max(0, n - 1)
        self.rounds = 0
        self.columns = _Columns()
        self.add(columns.items)

    def add(self, candidates):
        """Append the strategies (item index tuples) not in the master yet; returns how many."""
        new = []
        for items in candidates:
            if self.columns.add(items):
                new.append(self.columns.items[-1])
        if not new:
            return 0
        sizes = np.fromiter((len(items) for items in new), dtype=np.int64, count=len(new))
        rows = np.fromiter((k for items in new for k in items), dtype=np.int64, count=int(sizes.sum()))
        owner = np.repeat(np.arange(len(new)), sizes)
        keys, multiplicity = np.unique(owner * self.num_items + rows, return_counts=True)
        column, row = np.divmod(keys, self.num_items)
        starts = np.searchsorted(column, np.arange(len(new))).astype(np.int32)
        count = len(new)
        self.highs.addCols(count, np.ones(count), np.zeros(count), np.full(count, self.inf), keys.size, starts,
                           row.astype(np.int32), multiplicity.astype(np.float64))
        return count

    def solve(self, deadline):
        """(objective, x over the strategies, row duals), or None if the deadline came first."""
        highs = self.highs
        # Interior point (with crossover to a basis) is the faster HiGHS solver on the wide
        # first master that enumeration produces; simplex from the kept basis afterwards.
        first_wide = self.rounds == 0 and len(self.columns.items) > 15000
        highs.setOptionValue("solver", "ipm" if first_wide else "simplex")
        # added columns keep the basis primal feasible: primal simplex goes on from there
        highs.setOptionValue("simplex_strategy", 4 if self.rounds else 1)
        self.rounds += 1
        if deadline is not None:
            highs.setOptionValue("time_limit", highs.getRunTime() + max(1e-3, deadline - time.perf_counter()))
        highs.run()
        status = highs.getModelStatus()
        if status != self.optimal:
            if deadline is not None and time.perf_counter() >= deadline - 1e-3:
                return None
            raise RuntimeError(f"HiGHS failed on the packing LP: {highs.modelStatusToString(status)}")
        solution = highs.getSolution()
        x = np.asarray(solution.col_value)[self.offset:]
        return float(highs.getInfo().objective_function_value), x, np.asarray(solution.row_dual)

    def drop(self, keep):
        """Delete the strategy columns whose ``keep`` entry is False (they can be priced back in)."""
        gone = np.flatnonzero(~keep)
        if gone.size == 0:
            return
        self.highs.deleteCols(gone.size, (gone + self.offset).astype(np.int32))
        kept = _Columns()
        for index in np.flatnonzero(keep).tolist():
            kept.add(self.columns.items[index])
        self.columns = kept


class _ScipyMaster:
    """The same interface over scipy.optimize.linprog, re-solved from scratch every round."""

    def __init__(self, demand, columns):
        self.demand = demand.astype(np.float64)
        self.columns = _Columns()
        self.add(columns.items)

    def add(self, candidates):
        return sum(self.columns.add(items) for items in candidates)

    def solve(self, deadline):
        _check(deadline)
        return _solve_master(self.columns, self.demand)

    def drop(self, keep):
        kept = _Columns()
        for index in np.flatnonzero(keep).tolist():
            kept.add(self.columns.items[index])
        self.columns = kept


def dominant_columns(weights, max_sequence_length, depth, max_pairs=4_000_000, max_triples=40_000):
    """Every strategy of at most min(depth, 3) items that no other strategy of that depth
    dominates (a slot may hold a shorter sequence, so only the longest third item that
    still fits matters): singles, (a, longest fitting b), and (a, b, longest fitting c).
    At depth <= 3 this is the complete column set up to domination, about L^2/12
    strategies for L = 512, so the LP needs no generation rounds at all. The triples are
    skipped (column generation finds the useful ones) when there would be more than
    ``max_triples`` of them (or ``max_pairs`` pairs to look at): a master that wide costs
    more per solve than the generation rounds it saves."""
    num_items = weights.size
    capacity = max_sequence_length

    def longest_fitting(room):  # the longest item that fits in ``room`` tokens (-1: none)
        return np.searchsorted(weights, room, side="right") - 1

    found = [np.arange(num_items)[:, None]]
    if depth is None or depth >= 2:
        b = longest_fitting(capacity - weights)
        a = np.flatnonzero(b >= np.arange(num_items))
        found.append(np.stack([a, b[a]], axis=1))
    if (depth is None or depth >= 3) and num_items * num_items <= max_pairs:
        a, b = np.triu_indices(num_items)
        room = capacity - weights[a] - weights[b]
        fits = room >= 0
        a, b, room = a[fits], b[fits], room[fits]
        c = longest_fitting(room)
        triple = c >= b
        if np.count_nonzero(triple) <= max_triples:
            found.append(np.stack([a[triple], b[triple], c[triple]], axis=1))
    return found


class _Pricer:
    """Knapsack pricing: the most valuable strategy (sum of its items' values) that fits.

    The dynamic program runs on a capacity grid of ``quantum`` tokens (``capacity`` =
    floor(L / quantum) cells), which makes it ``quantum`` times cheaper at long L.
    ``rounding="up"`` (generation): each weight is rounded up to the grid, so every
    strategy found fits in L for real (a few tight ones are missed). ``rounding="down"``
    (certification): each weight is rounded down, so every real strategy still fits on the
    grid and the value found is at least the true best: Farley's bound stays valid.
    The certification grid is made fine enough that every weight is at least one cell,
    unless that takes more than ``_MAX_BOUND_CELLS`` cells (short items at a huge L: 3
    tokens at L = 10**8 would be 3.3e7 cells); then it has that many cells and the items
    shorter than one cell weigh nothing on it (*light* items): at a finite depth the
    cardinality limit still holds them, at unlimited depth :meth:`best_value` bounds them by
    their value per token. Memory and time stay O(cells), never O(L).
    """

    def __init__(self, weights, max_sequence_length, depth, quantum=1, rounding="up"):
        quantum = max(1, int(quantum))
        if rounding == "down":
            fine = min(quantum, int(weights[0]))  # every weight >= 1 cell
            quantum = fine if max_sequence_length // fine <= _MAX_BOUND_CELLS else \
                -(-max_sequence_length // _MAX_BOUND_CELLS)
            self.grid = weights // quantum
        else:
            self.grid = -(-weights // quantum)
        self.weights, self.quantum, self.max_sequence_length = weights, quantum, max_sequence_length
        self.capacity = max_sequence_length // quantum
        self.num_light = int(np.count_nonzero(self.grid == 0))  # a prefix: weights ascend
        # Depth only binds if that many of the shortest item can share a pack.
        binding = depth is not None and (self.num_light > 0 or depth < self.capacity // int(self.grid[0]))
        self.depth = depth if binding else None

    def best_value(self, values, deadline=None):
        """An upper bound on the value of every strategy that fits in L (the best value of
        :meth:`candidates` when no item is light or the depth is finite). With light items
        at unlimited depth: a strategy whose other items take c cells (so at least
        c * quantum tokens) holds at most L - c * quantum tokens of light items, worth at
        most that times their best value per token, so the bound is
        max_c (best value of the others in c cells + rate * (L - c * quantum))."""
        if not self.num_light or self.depth is not None:
            return self.candidates(values, deadline)[0]
        light = self.num_light
        rate = float(np.max(values[:light] / self.weights[:light]))
        heavy = values[light:]
        levels = light + np.flatnonzero(heavy > np.concatenate([[0.0], heavy[:-1]]))
        levels = levels[self.grid[levels] <= self.capacity]
        if levels.size:
            table, _ = self._unbounded(self.grid[levels], values[levels], deadline)
        else:
            table = np.zeros(self.capacity + 1)
        room = self.max_sequence_length - self.quantum * np.arange(self.capacity + 1, dtype=np.float64)
        return float(np.max(table + rate * room))

    def candidates(self, values, deadline=None):
        """Best value V over all strategies, and for each item k the best strategy that
        contains k (as (value, items)), best first. ``values`` must be non-decreasing.
        Raises _OutOfTime if ``deadline`` passes during the dynamic program. Not for light
        items at unlimited depth (see :meth:`best_value`)."""
        assert not (self.num_light and self.depth is None), "light items at unlimited depth: use best_value"
        # With values non-decreasing in length, an item is as good as the shortest item of
        # equal value (same value, less room), so the DP needs only the first item of
        # each value level; LP duals have few levels, which makes pricing much cheaper.
        capacity = self.capacity
        levels = np.flatnonzero(values > np.concatenate([[0.0], values[:-1]]))
        levels = levels[self.grid[levels] <= capacity]
        weights, level_values = self.grid[levels], values[levels]
        if levels.size == 0:
            rest = np.zeros(capacity + 1)
            completion = lambda c: []  # noqa: E731
        elif self.depth is None:
            rest, choice = self._unbounded(weights, level_values, deadline)
            completion = lambda c: [int(levels[k]) for k in self._trace_unbounded(weights, choice, c)]  # noqa: E731
        else:
            tables, choices = self._bounded(weights, level_values, deadline)
            rest = tables[self.depth - 1]
            completion = lambda c: [  # noqa: E731
                int(levels[k]) for k in self._trace_bounded(weights, choices, self.depth - 1, c)]
        room = capacity - self.grid
        fits = room >= 0
        item_values = values + np.where(fits, rest[np.maximum(room, 0)], 0.0)
        order = np.argsort(-item_values, kind="stable")
        best = float(item_values[order[0]])
        return best, ((float(item_values[k]), [int(k)] + (completion(int(room[k])) if fits[k] else []))
                      for k in order)

    def _unbounded(self, weights, values, deadline):
        """Complete knapsack, one vectorised pass per item: along each residue class of
        its weight w, best[c] = max over copies t of table[c - t w] + t v, a running
        maximum of table[c - t w] - (c - t w) / w * v."""
        capacity = self.capacity
        table = np.zeros(capacity + 1)
        choice = np.full(capacity + 1, -1, dtype=np.int32)
        for k, (w, v) in enumerate(zip(weights.tolist(), values.tolist())):
            if k % 16 == 0:
                _check(deadline)
            rows = -(-(capacity + 1) // w)
            padded = np.full(rows * w, -np.inf)
            padded[:capacity + 1] = table
            steps = (np.arange(rows, dtype=np.float64) * v)[:, None]
            # at least one copy: the running maximum up to the row before, plus this row's steps
            running = np.maximum.accumulate(padded.reshape(rows, w) - steps, axis=0)
            best = np.concatenate([np.full(w, -np.inf), (running[:-1] + steps[1:]).ravel()])[:capacity + 1]
            better = best > table
            table[better] = best[better]
            choice[better] = k
        return table, choice

    @staticmethod
    def _trace_unbounded(weights, choice, c):
        items = []
        while c > 0 and choice[c] >= 0:
            k = int(choice[c])
            items.append(k)
            c -= int(weights[k])
        return items

    def _bounded(self, weights, values, deadline):
        """tables[j, c]: best value of at most j items in c cells; one vectorised pass per
        (j, item). Stops early once another item no longer helps anywhere."""
        capacity, depth = self.capacity, self.depth
        tables = np.zeros((depth + 1, capacity + 1))
        choices = np.full((depth + 1, capacity + 1), -1, dtype=np.int32)
        pairs = list(zip(weights.tolist(), values.tolist()))
        for j in range(1, depth + 1):
            _check(deadline)
            previous, current, choice = tables[j - 1], tables[j], choices[j]
            current[:] = previous
            for k, (w, v) in enumerate(pairs):
                candidate = previous[:capacity + 1 - w] + v
                better = np.flatnonzero(candidate > current[w:])
                current[better + w] = candidate[better]
                choice[better + w] = k
            if np.array_equal(current, previous):
                tables[j + 1:] = current  # deeper tables equal this one (choices stay -1: no item)
                break
        return tables, choices

    @staticmethod
    def _trace_bounded(weights, choices, j, c):
        items = []
        while j > 0 and c > 0:
            k = int(choices[j, c])
            if k >= 0:
                items.append(k)
                c -= int(weights[k])
            j -= 1
        return items


def _fill_slots(columns, repeats, weights, demand):
    """Put sequences into the slots of an integer plan, longest sequences first, each into
    the shortest free slot that holds it. Returns (strategies as length tuples, repeats,
    left-over counts per item). A strategy whose copies receive different lengths is split
    into runs, so the result is exact (slots == sequences placed)."""
    num_items = demand.size
    # slot groups per item level: [column, position, count, next free copy]
    runs = {}  # (column, position) -> list of (count, item or -1)
    by_item = [[] for _ in range(num_items)]
    for column, (items, repeat) in enumerate(zip(columns, repeats)):
        if repeat > 0:
            for position, item in enumerate(items):
                by_item[item].append([column, position, int(repeat)])
                runs[(column, position)] = []
    free = []  # stack of slot groups whose length is >= the current item
    leftover = demand.astype(np.int64).copy()
    for item in range(num_items - 1, -1, -1):
        free.extend(by_item[item])
        need = int(leftover[item])
        while need and free:
            group = free[-1]
            take = min(need, group[2])
            runs[(group[0], group[1])].append((take, item))
            group[2] -= take
            need -= take
            if group[2] == 0:
                free.pop()
        leftover[item] = need
    for group in free:  # slots nobody needed: padding
        runs[(group[0], group[1])].append((group[2], -1))
    strategies, counts = [], []
    for column, (items, repeat) in enumerate(zip(columns, repeats)):
        if repeat <= 0:
            continue
        # Merge the positions' runs (each sums to ``repeat``): one segment per change of
        # any position's content, O(runs x members) per column.
        position_runs = [runs[(column, position)] for position in range(len(items))]
        index = [0] * len(items)
        left = [r[0][0] for r in position_runs]
        remaining = int(repeat)
        while remaining > 0:
            step = min(left)
            members = tuple(int(weights[r[i][1]]) for r, i in zip(position_runs, index) if r[i][1] >= 0)
            if members:
                strategies.append(members)
                counts.append(step)
            remaining -= step
            for position, r in enumerate(position_runs):
                left[position] -= step
                if left[position] == 0 and index[position] + 1 < len(r):
                    index[position] += 1
                    left[position] = r[index[position]][0]
    return strategies, counts, leftover


class LPSolution:
    """Column generation outcome: the columns, the LP solution and the certified bound."""

    def __init__(self, columns, x, lp_value, bound, bound_duals, duals, num_rounds, converged, timed_out=False):
        self.columns, self.x, self.lp_value, self.bound = columns, x, lp_value, bound
        self.bound_duals = bound_duals  # scaled: dual feasible for every strategy
        self.duals, self.num_rounds, self.converged = duals, num_rounds, converged
        self.timed_out = timed_out


def _prune(columns, x, duals, keep_reduced_cost, max_kept=None):
    """Keep the columns in use and the cheapest others (reduced cost below
    ``keep_reduced_cost``, at most ``max_kept`` of them), so re-solves stay small; dropped
    columns can be generated again, so nothing is lost for the bound."""
    reduced = 1.0 - columns.values(duals)
    in_use = x > 1e-9
    cheap = np.flatnonzero(~in_use & (reduced < keep_reduced_cost))
    if max_kept is not None and cheap.size > max_kept:
        cheap = cheap[np.argsort(reduced[cheap], kind="stable")[:max_kept]]
    kept = _Columns()
    for index in np.concatenate([np.flatnonzero(in_use), np.sort(cheap)]).tolist():
        kept.add(columns.items[index])
    return kept


MASTERS = {"highs": _HighsMaster, "scipy": _ScipyMaster}


def solve_lp(demand, weights, max_sequence_length, depth, columns=None, max_rounds=1000, deadline=None,
             max_new_columns=None, max_master_columns=None, bound_weights=None, master="highs", target_gap=0.0,
             quantum=1, smoothing=None):
    """Column generation for the packing LP on ``demand`` (counts per item, items of
    ascending ``weights``). Returns an LPSolution whose ``bound`` is a certified lower
    bound on the LP optimum over *all* strategies of the depth.

    ``bound_weights`` (default ``weights``): the lengths the certificate is priced at. An
    aggregated problem (items = groups of lengths, ``weights`` = each group's longest,
    ``bound_weights`` = its shortest) gets a bound valid for the original lengths: a
    strategy of real lengths, each replaced by its group's shortest, still fits.
    ``deadline`` (a perf_counter time): stop there with what has been found (``timed_out``).
    ``quantum`` (tokens): the pricing DP's capacity grid (see :class:`_Pricer`): generation
    rounds weights up (columns stay feasible), the certificate rounds them down (it stays
    valid, a little weaker).
    """
    num_items = demand.size
    if columns is None:
        columns = _Columns()
    for k in range(num_items):  # singletons keep the master feasible
        columns.add([k])
    model = MASTERS[master](demand, columns)
    pricer = _Pricer(weights, max_sequence_length, depth, quantum, "up")
    bound_weights = weights if bound_weights is None else bound_weights
    bound_pricer = pricer if quantum == 1 and np.array_equal(bound_weights, weights) else \
        _Pricer(bound_weights, max_sequence_length, depth, quantum, "down")
    max_new_columns = max_new_columns or max(100, num_items // 4)
    max_master_columns = max_master_columns or 4 * max(100, num_items)
    bound, bound_duals, converged, rounds, timed_out = 0.0, None, False, 0, False
    lp_value, x, duals = math.inf, None, None
    demand_float = demand.astype(np.float64)
    center, center_value = None, -math.inf  # stabilisation centre: the duals with the best Farley value so far
    smoothing = _SMOOTHING if smoothing is None else smoothing
    while True:
        solved = model.solve(deadline)
        if solved is None:
            timed_out = True
            break
        rounds += 1
        lp_value, x, duals = solved
        # Any y >= 0, non-decreasing in length, scaled by the best knapsack value is dual
        # feasible for the full LP; clean the solver's duals into that set first.
        duals = np.maximum.accumulate(np.maximum(duals, 0.0))
        try:
            new_columns, converged, bound_info = _price(pricer, bound_pricer, duals, center, smoothing, rounds,
                                                        demand_float, max_new_columns, deadline)
        except _OutOfTime:
            timed_out = True
            break
        if bound_info["value"] > center_value:
            center, center_value = bound_info["point"], bound_info["value"]
        if bound_info["bound"] >= bound and bound_info["bound_duals"] is not None:
            bound, bound_duals = bound_info["bound"], bound_info["bound_duals"]
        if converged:
            break
        if _ceil_bound(bound) >= math.ceil(lp_value - 1e-6):
            break  # the certificate cannot get any tighter in whole packs
        if target_gap and lp_value <= bound * (1.0 + target_gap / 2):
            break  # close enough: rounding costs the other half
        if rounds >= max_rounds or (deadline is not None and time.perf_counter() > deadline):
            timed_out = rounds < max_rounds
            break
        if len(model.columns.items) > max_master_columns:
            reduced = 1.0 - model.columns.values(duals)
            keep = (x > 1e-9) | (reduced < 0.02)
            model.drop(keep)
            x = x[keep]  # still the LP solution: every column in use is kept
        if model.add(new_columns) == 0:
            converged = True
            break
    if x is not None and x.size < len(model.columns.items):  # columns added after the last solve
        x = np.concatenate([x, np.zeros(len(model.columns.items) - x.size)])
    return LPSolution(model.columns, x, lp_value, bound, bound_duals, duals, rounds, converged, timed_out)


_PRICE_LEVELS = 256
_EXACT_EVERY = 5
_SMOOTHING = 0.5
_MAX_MISPRICINGS = 3


def _price(pricer, bound_pricer, duals, center, smoothing, rounds, demand, max_new_columns, deadline):
    """One pricing step with Wentges dual smoothing. Prices at ``smoothing * center +
    (1 - smoothing) * duals`` (the smoothed point oscillates less than the master's duals,
    which cuts the rounds of column generation); keeps the columns that improve the
    master at its own ``duals``. If none do (a mispricing), the point moves towards
    ``duals`` and pricing repeats; at ``duals`` itself, no improving column means the LP
    is solved (on the pricing grid).

    Returns (columns to add, converged, info) where info has this step's Farley values:
    ``point``/``value`` (generation pricer, to pick the next centre) and
    ``bound``/``bound_duals`` (certification pricer, on exact steps; else 0 / None)."""
    point = duals if center is None or not smoothing else smoothing * center + (1.0 - smoothing) * duals
    info = {"point": None, "value": -math.inf, "bound": 0.0, "bound_duals": None}
    for attempt in range(_MAX_MISPRICINGS + 1):
        at_duals = point is duals
        # Generation prices duals rounded down to at most _PRICE_LEVELS values (the DP costs
        # one pass per distinct value); only an exact pass can end generation or certify.
        coarse = _coarsen(point)
        best_value, candidates = pricer.candidates(coarse, deadline)
        exact = coarse is point or (at_duals and best_value <= 1.0 + _PRICE_TOLERANCE) or rounds % _EXACT_EVERY == 0
        if exact and coarse is not point:
            best_value, candidates = pricer.candidates(point, deadline)
        priced = point if exact else coarse
        value = float(demand @ priced) / max(1.0, best_value)
        if value > info["value"]:
            info["point"], info["value"] = priced, value
        if exact:
            bound_value = best_value if bound_pricer is pricer else bound_pricer.best_value(point, deadline)
            bound = float(demand @ point) / max(1.0, bound_value)
            if bound > info["bound"]:
                info["bound"], info["bound_duals"] = bound, point / max(1.0, bound_value)
        if at_duals and exact and best_value <= 1.0 + _PRICE_TOLERANCE:
            return [], True, info
        found = []
        for _, items in _take(candidates, max_new_columns):
            if float(duals[items].sum()) > 1.0 + _PRICE_TOLERANCE:  # improves the master as it is
                found.append(items)
        if found:
            return found, False, info
        # mispricing: move the point halfway to the master's duals (at the end, onto them)
        point = duals if attempt + 1 >= _MAX_MISPRICINGS else 0.5 * (point + duals)
    return [], False, info


def _coarsen(duals):
    """``duals`` rounded down to a grid of at most _PRICE_LEVELS steps (still >= 0 and
    non-decreasing), or ``duals`` itself when it has no more distinct values than that."""
    if np.count_nonzero(np.diff(duals)) < _PRICE_LEVELS or duals[-1] <= 0:
        return duals
    step = duals[-1] / _PRICE_LEVELS
    return np.floor(duals / step) * step


def _take(candidates, limit):
    """The first ``limit`` improving candidates (value > 1)."""
    taken = 0
    for value, items in candidates:
        if value <= 1.0 + _PRICE_TOLERANCE or taken >= limit:
            return
        taken += 1
        yield value, items


def _ceil_bound(bound):
    """Whole packs certified by a float bound, with a margin for summation round-off."""
    return int(math.ceil(bound * (1.0 - 1e-12) - 1e-6))


def _milp(columns, demand, time_limit, lower_bound=0, node_limit=None, cutoff=None):
    """Integer program over the given columns (transfers stay continuous: an integral x
    always admits integral transfers), solved by HiGHS through highspy (no scipy import).
    Returns (columns, integer repeats) or None. It stops as soon as its plan is less than
    one pack above ``lower_bound`` (then it is optimal), at ``time_limit`` seconds (None: no
    clock) or after ``node_limit`` branch-and-bound nodes (None: no limit). HiGHS's search is
    deterministic, so only a clock can make two runs differ. ``cutoff`` (packs): only plans of
    at most that many are looked for (None when it proves there is none)."""
    model = _HighsMaster(demand, columns)
    highs, highspy = model.highs, _HIGHSPY[0]
    count = len(model.columns.items)
    highs.changeColsIntegrality(count, np.arange(model.offset, model.offset + count, dtype=np.int32),
                                np.full(count, highspy.HighsVarType.kInteger))
    if time_limit is not None:
        highs.setOptionValue("time_limit", highs.getRunTime() + float(time_limit))
    if node_limit is not None:
        highs.setOptionValue("mip_max_nodes", int(node_limit))
    highs.setOptionValue("mip_rel_gap", 0.999 / max(1.0, float(lower_bound) + 1.0))
    if cutoff is not None:
        highs.setOptionValue("objective_bound", float(cutoff) + 0.5)
    highs.run()
    solution = highs.getSolution()
    if not solution.value_valid:
        return None
    return model.columns, np.round(np.asarray(solution.col_value)[model.offset:]).astype(np.int64)


def _best_heuristic(counts, max_sequence_length, depth):
    options = [pack_lpfhp(counts, max_sequence_length, depth), pack_spfhp(counts, max_sequence_length, depth)]
    if counts.lengths.size <= 2048:
        options.append(pack_bfd(counts, max_sequence_length, depth))
    return min(options, key=lambda option: sum(option[1]))


def _groups(weights, demand, max_items):
    """Split the items (ascending lengths) into at most ``max_items`` contiguous groups:
    np.int64 [num_items] group of each item. Boundaries: half at equal shares of the
    sequences, half at equal steps of length, so both the common and the long lengths
    get fine groups."""
    n = weights.size
    if n <= max_items:
        return np.arange(n)
    share = np.cumsum(demand) / demand.sum()
    by_count = np.searchsorted(share, np.linspace(0, 1, max_items // 2 + 1)[1:-1], side="left")
    by_length = np.searchsorted(weights, np.linspace(weights[0], weights[-1], max_items // 2 + 1)[1:-1],
                                side="left")
    starts = np.unique(np.concatenate([[0], by_count + 1, by_length]))
    starts = starts[(starts > 0) & (starts < n)]
    group = np.zeros(n, dtype=np.int64)
    group[starts] = 1
    return np.cumsum(group)


_REFINE_LEVELS = (64, 256)
_SEQUENCES_PER_ROW = 80


def _nested_groups(weights, demand, sizes):
    """:func:`_groups` for each size (ascending), each grouping a refinement of the one
    before (its boundaries include the coarser ones')."""
    starts = np.zeros(weights.size, dtype=bool)
    found = []
    for size in sizes:
        group = _groups(weights, demand, size)
        starts[1:] |= np.diff(group) > 0
        found.append(np.cumsum(starts))
    return found


def _plan_packs(repeats):
    return int(sum(int(r) for r in repeats))


def _solve_coarse_to_fine(weights, demand, best_strategies, max_sequence_length, depth, *, max_lp_items,
                          lp_deadline, master, target_gap, quantum):
    """The LP of :func:`pack_lp`, coarse to fine (only when lengths are grouped anyway): the LP
    is solved on a few groups first (a handful of rounds), and each finer grouping starts from
    the coarser one's columns, so its column generation starts near the optimum instead of from
    the heuristic plan (mixture-8192 at depth 8, 10 s: 0.73 % -> 0.66 % over the bound).

    Returns (the finest level's solution, the best certificate (bound, duals per length), the
    group of each length, the longest length's index of each group)."""
    if weights.size > max_lp_items:
        # Lengths are grouped anyway; few sequences per group make the LP pointlessly wide: at
        # most one row per _SEQUENCES_PER_ROW sequences (2,000 LLM sequences at depth 8: 64
        # rows plan 306 packs in 0.9 s, 1,024 rows 325 packs in 10 s).
        max_lp_items = min(max_lp_items, max(_REFINE_LEVELS[0], int(demand.sum()) // _SEQUENCES_PER_ROW))
    levels = [size for size in _REFINE_LEVELS if size < max_lp_items < weights.size] + [max_lp_items]
    groupings = _nested_groups(weights, demand, levels)
    previous, certificate = None, (0.0, None)
    for level, group in enumerate(groupings):
        num_groups = int(group[-1]) + 1
        first_item = np.searchsorted(group, np.arange(num_groups))
        top_item = np.append(first_item[1:], weights.size) - 1
        group_demand = np.bincount(group, weights=demand, minlength=num_groups).astype(np.int64)
        top, bottom = weights[top_item], weights[first_item]
        columns = _Columns()
        if previous is None:
            # A wide enumerated start pays on big data (Wikipedia: one solve, no generation); on
            # small data a few cheap generation rounds beat one wide solve.
            for block in dominant_columns(top, max_sequence_length, depth,
                                          max_triples=min(40_000, int(demand.sum()))):
                for items in block.tolist():
                    columns.add(items)
            for strategy in best_strategies:
                members = group[np.searchsorted(weights, np.asarray(strategy))]  # item of each length
                if top[members].sum() <= max_sequence_length:  # with each length raised to its group's longest
                    columns.add(members.tolist())
        else:
            coarse_columns, coarse_top_item = previous
            for items in coarse_columns.items:  # a coarse slot is its top length, a fine group's top
                columns.add([int(group[coarse_top_item[g]]) for g in items])
        last = level == len(groupings) - 1
        level_deadline = lp_deadline if last or lp_deadline is None else \
            time.perf_counter() + 0.25 * (lp_deadline - time.perf_counter())
        solution = solve_lp(group_demand, top, max_sequence_length, depth, columns, deadline=level_deadline,
                            bound_weights=bottom, master=master, target_gap=target_gap if last else 0.0,
                            quantum=quantum)
        if solution.bound_duals is not None and solution.bound > certificate[0]:
            certificate = (solution.bound, solution.bound_duals[group])
        previous = (solution.columns, top_item)
    return solution, certificate, group, top_item


def _round_solution(solution, group, top_item, weights, demand, max_sequence_length, depth, *, max_repair_rounds,
                    deadline, master, quantum):
    """Rounding of the LP's ``solution``: floor, fill the slots (a group's slot has its longest
    length) with the real sequences, re-solve the LP on the left-overs, and pack the last few
    with the heuristics. Returns (strategies, repeats, whether the deadline cut it short)."""
    num_groups, top = int(group[-1]) + 1, weights[top_item]
    strategies, repeats, timed_out = [], [], False
    remaining, current, rounds_used = demand.copy(), solution, 0
    while True:
        floor = np.floor(current.x + 1e-9).astype(np.int64)
        slots = [tuple(int(top_item[g]) for g in items) for items in current.columns.items]
        placed, placed_counts, remaining = _fill_slots(slots, floor, weights, remaining)
        strategies += placed
        repeats += placed_counts
        rounds_used += 1
        if not remaining.any() or not floor.any() or rounds_used > max_repair_rounds:
            break
        if deadline is not None and time.perf_counter() > deadline:
            timed_out = True
            break
        cheap = _prune(current.columns, current.x, current.duals, keep_reduced_cost=0.01,
                       max_kept=4 * num_groups)
        left = np.bincount(group, weights=remaining, minlength=num_groups).astype(np.int64)
        current = solve_lp(left, top, max_sequence_length, depth, cheap, max_rounds=20, deadline=deadline,
                           master=master, quantum=quantum)
        if current.x is None:
            timed_out = True
            break
    if remaining.any():
        left = remaining > 0
        left_counts = LengthCounts(weights[left], remaining[left])
        extra_strategies, extra_repeats = pack_lpfhp(left_counts, max_sequence_length, depth)
        strategies += list(extra_strategies)
        repeats += list(extra_repeats)
    return strategies, repeats, timed_out


def _milp_plan(solution, weights, demand, num_groups, bound, best_packs, *, milp_time_limit, milp_node_limit,
               max_milp_sequences, max_milp_columns, deadline):
    """The MILP's plan (strategies, repeats) on the LP's support, where it pays (see
    :func:`pack_lp`) and beats ``best_packs`` with every sequence placed; else None.

    The MILP decides only the LP's fractional part: the floor of the LP solution is fixed (its
    slots filled as in rounding) and the integer program covers the sequences left over, with
    the same columns. Its integers are then a few per column instead of up to the demand, and
    HiGHS settles it within a fraction of a second where the whole MILP spent its time limit at
    the root (2,000 SQuAD-shaped sequences at depth 3: 988 packs after 2 s -> 986, the bound,
    in 0.5 s). It looks only for plans better than ``best_packs``."""
    gap = best_packs - bound
    used = np.flatnonzero(solution.x > 1e-9)
    support = [solution.columns.items[s] for s in used]
    remaining_time = None if deadline is None else deadline - time.perf_counter()
    if not (gap > 0 and (milp_time_limit or milp_node_limit is not None) and demand.sum() <= max_milp_sequences
            and num_groups == weights.size
            and 0 < len(support) <= max_milp_columns and (remaining_time is None or remaining_time > 0.05)):
        return None
    floor = np.floor(solution.x[used] + 1e-9).astype(np.int64)
    placed, placed_counts, left = _fill_slots(support, floor, weights, demand)
    fixed = _plan_packs(placed_counts)
    if not left.any():
        return (placed, placed_counts) if fixed < best_packs else None
    milp_columns = _Columns()
    for items in support:
        milp_columns.add(items)
    for k in range(weights.size):
        milp_columns.add([k])
    limit = None if milp_node_limit is not None else milp_time_limit
    if remaining_time is not None:
        limit = remaining_time if limit is None else min(limit, remaining_time)
    found = _milp(milp_columns, left, limit, bound - fixed, milp_node_limit, cutoff=best_packs - fixed - 1)
    if found is not None and fixed + found[1].sum() < best_packs:
        extra, extra_counts, unplaced = _fill_slots(found[0].items, found[1], weights, left)
        if not unplaced.any():
            return placed + extra, placed_counts + extra_counts
    return None


def pack_lp(counts, max_sequence_length, depth, max_repair_rounds=3, milp_time_limit=2.0, max_milp_sequences=10_000,
            max_milp_columns=3000, time_limit=None, max_lp_items=1024, master="highs", target_gap=1e-4,
            pricing_cells=2048, milp_node_limit=None):
    """Plan with the LP. Returns (strategies, repeats, details) where details has
    ``lp_bound_packs`` (certified lower bound on the packs of any plan at this depth),
    ``lp_value``, ``num_columns``, ``num_rounds``, ``converged``, ``rounding`` and
    ``time_limit_reached``.

    A heuristic plan (the best of lpfhp, spfhp and, with few lengths, bfd) comes first; if
    it already meets the simple bounds (tokens, depth, Martello-Toth L2) it is optimal and
    the LP is skipped. Otherwise the LP runs on at most ``max_lp_items`` rows: with more
    distinct lengths than that, neighbouring lengths are grouped; the plan then uses each
    group's longest length as its slot size (so any sequence of the group fits) and the
    certificate each group's shortest (so it stays valid for the real lengths).

    ``target_gap`` (a fraction, default 1e-4 = 0.01 %): stop as soon as the plan is
    certified within it of optimal; the heuristic plan alone may already be (then the LP
    is skipped, as it is when the heuristic plan is within one pack of the simple bounds:
    ``details["lp_skipped"]`` says why). 0 = keep going until the LP cannot improve the
    plan or the bound.

    ``time_limit`` (seconds) bounds the whole call: when it runs out, the best plan found so
    far (at worst the heuristic one) is returned with the best bound so far, and
    ``details["time_limit_reached"]`` is True.

    The MILP is tried only where it pays: rounding left the plan above the bound, the
    dataset is small (<= ``max_milp_sequences``, where a few packs are a visible fraction;
    on Wikipedia rounding is already within 0.0002 % and HiGHS rarely improves on it within
    minutes) and the LP uses at most ``max_milp_columns`` strategies.

    ``milp_node_limit`` (an int) bounds the MILP by branch-and-bound nodes instead of by
    ``milp_time_limit``: no clock, so the plan is the same on any machine under any load (what
    sharded `pack` needs for byte-identical output); ``time_limit`` still bounds the call.
    """
    from .bounds import lower_bounds

    started = time.perf_counter()
    deadline = None if time_limit is None else started + float(time_limit)
    counts = as_length_counts(counts)
    weights, demand = counts  # the lengths that occur (ascending) and their counts: no per-L array

    best_strategies, best_repeats = _best_heuristic(counts, max_sequence_length, depth)
    best_strategies, best_repeats = list(best_strategies), list(best_repeats)
    simple_bound = max(lower_bounds(counts, max_sequence_length, depth).values())
    details = {"lp_value": None, "num_columns": 0, "num_rounds": 0, "converged": False, "rounding": "heuristic",
               "num_lp_items": 0, "time_limit_reached": False, "lp_item_lengths": None, "lp_duals": None,
               "lp_skipped": None}
    if _plan_packs(best_repeats) <= simple_bound * (1.0 + target_gap):
        details["converged"] = True  # nothing left for the LP to do: within target_gap of a bound
        details["lp_skipped"] = "the heuristic plan is within target_gap of the simple bounds"
        return best_strategies, best_repeats, details
    if target_gap and _plan_packs(best_repeats) <= simple_bound + 1:
        # One pack from the bound (a small input: on a big one that is within target_gap):
        # the LP could only prove that last pack necessary or find a perfect packing, an
        # exact search that can take the whole time limit (2,000-20,000 LLM sequences: 10 s
        # for nothing, where lpfhp takes 0.02-0.1 s). target_gap=0 asks for that search.
        details["lp_skipped"] = "the heuristic plan is within one pack of the simple bounds"
        return best_strategies, best_repeats, details

    lp_deadline = None if deadline is None else started + 0.8 * float(time_limit)
    quantum = max(1, max_sequence_length // int(pricing_cells))
    solution, certificate, group, top_item = _solve_coarse_to_fine(
        weights, demand, best_strategies, max_sequence_length, depth, max_lp_items=max_lp_items,
        lp_deadline=lp_deadline, master=master, target_gap=target_gap, quantum=quantum)
    num_groups = int(group[-1]) + 1
    details["num_lp_items"] = num_groups
    lp_bound = _ceil_bound(certificate[0])
    timed_out = solution.timed_out
    details.update({"lp_value": None if solution.x is None else solution.lp_value,
                    "num_columns": len(solution.columns.items), "num_rounds": solution.num_rounds,
                    "converged": solution.converged})
    if certificate[1] is not None:
        # the certificate: lp_bound_packs = ceil(demand . lp_duals), with lp_duals >= 0,
        # non-decreasing, and no strategy worth more than 1 under them
        details["lp_item_lengths"] = weights.tolist()
        details["lp_duals"] = certificate[1].tolist()
        details["lp_bound_packs"] = lp_bound

    if solution.x is not None:
        # The MILP first (on small inputs it usually reaches the bound, and then the repair
        # rounds' LP re-solves are not needed), then floor + repair where it did not.
        bound = max(lp_bound, simple_bound)
        found = _milp_plan(solution, weights, demand, num_groups, bound, _plan_packs(best_repeats),
                           milp_time_limit=milp_time_limit, milp_node_limit=milp_node_limit,
                           max_milp_sequences=max_milp_sequences, max_milp_columns=max_milp_columns,
                           deadline=deadline)
        if found is not None:
            best_strategies, best_repeats, details["rounding"] = found[0], found[1], "milp"
        if _plan_packs(best_repeats) > bound:
            strategies, repeats, rounding_timed_out = _round_solution(
                solution, group, top_item, weights, demand, max_sequence_length, depth,
                max_repair_rounds=max_repair_rounds, deadline=deadline, master=master, quantum=quantum)
            timed_out = timed_out or rounding_timed_out
            if _plan_packs(repeats) < _plan_packs(best_repeats):
                best_strategies, best_repeats, details["rounding"] = strategies, repeats, "floor+repair"
    details["time_limit_reached"] = bool(timed_out)
    return best_strategies, best_repeats, details
