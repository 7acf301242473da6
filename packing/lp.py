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
use is tried too, and the better plan is kept.
"""
import math
import time

import numpy as np

from .heuristics import pack_bfd, pack_lpfhp

_PRICE_TOLERANCE = 1e-9
_DP_CHUNK_ELEMENTS = 2_000_000  # items x capacities evaluated per numpy step in the DP


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
    longest_fitting = np.searchsorted(weights, np.arange(capacity + 1), side="right") - 1
    found = [np.arange(num_items)[:, None]]
    if depth is None or depth >= 2:
        b = longest_fitting[capacity - weights]
        a = np.flatnonzero(b >= np.arange(num_items))
        found.append(np.stack([a, b[a]], axis=1))
    if (depth is None or depth >= 3) and num_items * num_items <= max_pairs:
        a, b = np.triu_indices(num_items)
        room = capacity - weights[a] - weights[b]
        fits = room >= 0
        a, b, room = a[fits], b[fits], room[fits]
        c = longest_fitting[room]
        triple = c >= b
        if np.count_nonzero(triple) <= max_triples:
            found.append(np.stack([a[triple], b[triple], c[triple]], axis=1))
    return found


class _Pricer:
    """Exact knapsack pricing: most valuable strategy (sum of item values) that fits."""

    def __init__(self, weights, max_sequence_length, depth):
        self.weights = weights
        self.capacity = max_sequence_length
        # Depth only binds if that many of the shortest item can share a pack.
        binding = depth is not None and depth < max_sequence_length // int(weights[0])
        self.depth = depth if binding else None

    def candidates(self, values):
        """Best value V over all strategies, and for each item k the best strategy that
        contains k (as (value, items)), best first. ``values`` must be non-decreasing."""
        # With values non-decreasing in length, an item is as good as the shortest item of
        # equal value (same value, less room), so the DP needs only the first item of
        # each value level; LP duals have few levels, which makes pricing much cheaper.
        levels = np.flatnonzero(values > np.concatenate([[0.0], values[:-1]]))
        weights, level_values = self.weights[levels], values[levels]
        if levels.size == 0:
            rest = np.zeros(self.capacity + 1)
            completion = lambda c: []  # noqa: E731
        elif self.depth is None:
            rest, choice = self._unbounded(weights, level_values)
            completion = lambda c: [int(levels[k]) for k in self._trace_unbounded(weights, choice, c)]  # noqa: E731
        else:
            tables, choices = self._bounded(weights, level_values)
            rest = tables[self.depth - 1]
            completion = lambda c: [  # noqa: E731
                int(levels[k]) for k in self._trace_bounded(weights, choices, self.depth - 1, c)]
        item_values = values + rest[self.capacity - self.weights]
        order = np.argsort(-item_values, kind="stable")
        best = float(item_values[order[0]])
        return best, ((float(item_values[k]), [int(k)] + completion(self.capacity - int(self.weights[k])))
                      for k in order)

    def _unbounded(self, weights, values):
        capacity = self.capacity
        table = np.zeros(capacity + 1)
        choice = np.full(capacity + 1, -1, dtype=np.int64)
        num_fitting = np.searchsorted(weights, np.arange(capacity + 1), side="right")
        for c in range(1, capacity + 1):
            table[c], k = table[c - 1], num_fitting[c]
            if k:
                options = table[c - weights[:k]] + values[:k]
                best = int(np.argmax(options))
                if options[best] > table[c]:
                    table[c], choice[c] = options[best], best
        return table, choice

    @staticmethod
    def _trace_unbounded(weights, choice, c):
        items = []
        while c > 0:
            k = int(choice[c])
            if k < 0:
                c -= 1
            else:
                items.append(k)
                c -= int(weights[k])
        return items

    def _bounded(self, weights, values):
        capacity, depth = self.capacity, self.depth
        capacities = np.arange(capacity + 1)
        tables = np.zeros((depth + 1, capacity + 1))
        choices = np.full((depth + 1, capacity + 1), -1, dtype=np.int64)
        chunk = max(1, _DP_CHUNK_ELEMENTS // (capacity + 1))
        for j in range(1, depth + 1):
            previous, current, choice = tables[j - 1], tables[j], choices[j]
            current[:] = previous
            for start in range(0, weights.size, chunk):
                w = weights[start:start + chunk]
                source = capacities[None, :] - w[:, None]
                options = np.where(source >= 0, previous[np.maximum(source, 0)] + values[start:start + chunk, None],
                                   -np.inf)
                best = np.argmax(options, axis=0)
                best_value = options[best, capacities]
                better = best_value > current
                current[better] = best_value[better]
                choice[better] = best[better] + start
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
        position_runs = [runs[(column, position)] for position in range(len(items))]
        cuts = sorted({0, int(repeat)} | {total for r in position_runs for total in np.cumsum([c for c, _ in r])})
        for start, stop in zip(cuts[:-1], cuts[1:]):
            members = []
            for r in position_runs:
                position_total = 0
                for count, item in r:
                    if position_total <= start < position_total + count:
                        if item >= 0:
                            members.append(int(weights[item]))
                        break
                    position_total += count
            if members:
                strategies.append(tuple(members))
                counts.append(stop - start)
    return strategies, counts, leftover


class LPSolution:
    """Column generation outcome: the columns, the LP solution and the certified bound."""

    def __init__(self, columns, x, lp_value, bound, bound_duals, duals, num_rounds, converged):
        self.columns, self.x, self.lp_value, self.bound = columns, x, lp_value, bound
        self.bound_duals = bound_duals  # scaled: dual feasible for every strategy
        self.duals, self.num_rounds, self.converged = duals, num_rounds, converged


def _prune(columns, x, duals, keep_reduced_cost, max_kept=None):
    """Keep the columns in use and the cheapest others (reduced cost below
    ``keep_reduced_cost``, at most ``max_kept`` of them), so re-solves stay small; dropped
    columns can be generated again, so nothing is lost for the bound."""
    reduced = 1.0 - columns.strategy_matrix(duals.size).T @ duals
    in_use = x > 1e-9
    cheap = np.flatnonzero(~in_use & (reduced < keep_reduced_cost))
    if max_kept is not None and cheap.size > max_kept:
        cheap = cheap[np.argsort(reduced[cheap], kind="stable")[:max_kept]]
    kept = _Columns()
    for index in np.concatenate([np.flatnonzero(in_use), np.sort(cheap)]).tolist():
        kept.add(columns.items[index])
    return kept


def solve_lp(demand, weights, max_sequence_length, depth, columns=None, max_rounds=1000, time_limit=None,
             max_new_columns=None, max_master_columns=None):
    """Column generation for the packing LP on ``demand`` (counts per item, items of
    ascending ``weights``). Returns an LPSolution whose ``bound`` is a certified lower
    bound on the LP optimum over *all* strategies of the depth."""
    started = time.perf_counter()
    num_items = demand.size
    if columns is None:
        columns = _Columns()
    for k in range(num_items):  # singletons keep the master feasible
        columns.add([k])
    pricer = _Pricer(weights, max_sequence_length, depth)
    max_new_columns = max_new_columns or max(100, num_items // 4)
    max_master_columns = max_master_columns or 4 * max(100, num_items)
    bound, bound_duals, converged, rounds = 0.0, None, False, 0
    demand_float = demand.astype(np.float64)
    while True:
        rounds += 1
        lp_value, x, duals = _solve_master(columns, demand_float)
        # Any y >= 0, non-decreasing in length, scaled by the best knapsack value is dual
        # feasible for the full LP; clean the solver's duals into that set first.
        duals = np.maximum.accumulate(np.maximum(duals, 0.0))
        best_value, candidates = pricer.candidates(duals)
        round_bound = float(demand_float @ duals) / max(1.0, best_value)
        if round_bound >= bound:
            bound, bound_duals = round_bound, duals / max(1.0, best_value)
        if best_value <= 1.0 + _PRICE_TOLERANCE:
            converged = True
            break
        if _ceil_bound(bound) >= math.ceil(lp_value - 1e-6):
            break  # the certificate cannot get any tighter in whole packs
        if rounds >= max_rounds or (time_limit is not None and time.perf_counter() - started > time_limit):
            break
        if len(columns.items) > max_master_columns:
            columns = _prune(columns, x, duals, keep_reduced_cost=0.02)
            x = None
        added = 0
        for value, items in candidates:
            if value <= 1.0 + _PRICE_TOLERANCE or added >= max_new_columns:
                break
            added += columns.add(items)
        if added == 0:
            converged = True
            break
    if x is None:  # pruned on the last round: re-solve
        lp_value, x, _ = _solve_master(columns, demand_float)
    return LPSolution(columns, x, lp_value, bound, bound_duals, duals, rounds, converged)


def _ceil_bound(bound):
    """Whole packs certified by a float bound, with a margin for summation round-off."""
    return int(math.ceil(bound * (1.0 - 1e-12) - 1e-6))


def _milp(columns, demand, time_limit):
    """Integer program over the given columns (transfers stay continuous: an integral x
    always admits integral transfers). Returns integer repeats or None."""
    optimize, _ = _scipy()
    matrix, cost, num_columns = _master_problem(columns, demand.size)
    integrality = np.zeros(matrix.shape[1])
    integrality[:num_columns] = 1
    result = optimize.milp(cost, constraints=optimize.LinearConstraint(matrix, lb=demand.astype(np.float64)),
                           integrality=integrality, bounds=optimize.Bounds(0, np.inf),
                           options={"time_limit": time_limit, "disp": False})
    if result.x is None:
        return None
    return np.round(result.x[:num_columns]).astype(np.int64)


def _best_heuristic(counts, max_sequence_length, depth):
    options = [pack_lpfhp(counts, max_sequence_length, depth), pack_bfd(counts, max_sequence_length, depth)]
    return min(options, key=lambda option: sum(option[1]))


def pack_lp(counts, max_sequence_length, depth, max_repair_rounds=3, milp_time_limit=5.0, max_milp_sequences=10_000,
            max_milp_columns=3000, time_limit=None):
    """Plan with the LP. Returns (strategies, repeats, details) where details has
    ``lp_bound_packs`` (certified lower bound on the packs of any plan at this depth),
    ``lp_value``, ``num_columns``, ``num_rounds``, ``converged`` and ``rounding``.

    The MILP is tried only where it pays: rounding left the plan above the bound, the
    dataset is small (<= ``max_milp_sequences``, where a few packs are a visible fraction;
    on Wikipedia rounding is already within 0.0002 % and HiGHS rarely improves on it within
    minutes) and the LP uses at most ``max_milp_columns`` strategies.
    """
    counts = np.asarray(counts, dtype=np.int64)
    weights = np.flatnonzero(counts) + 1
    demand = counts[weights - 1]
    item_of_length = np.full(max_sequence_length + 1, -1, dtype=np.int64)
    item_of_length[weights] = np.arange(weights.size)

    columns = _Columns()
    for block in dominant_columns(weights, max_sequence_length, depth):
        for items in block.tolist():
            columns.add(items)
    start_strategies, _ = _best_heuristic(counts, max_sequence_length, depth)
    for strategy in start_strategies:
        columns.add([int(item_of_length[length]) for length in strategy])
    solution = solve_lp(demand, weights, max_sequence_length, depth, columns, time_limit=time_limit)
    lp_bound = _ceil_bound(solution.bound)

    # Rounding: floor, fill the slots, re-solve on the left-overs with the cheap columns,
    # and pack the last few sequences with the best heuristic.
    strategies, repeats = [], []
    remaining, current, rounds_used = demand.copy(), solution, 0
    while True:
        floor = np.floor(current.x + 1e-9).astype(np.int64)
        placed, placed_counts, remaining = _fill_slots(current.columns.items, floor, weights, remaining)
        strategies += placed
        repeats += placed_counts
        rounds_used += 1
        if not remaining.any() or not floor.any() or rounds_used > max_repair_rounds:
            break
        cheap = _prune(current.columns, current.x, current.duals, keep_reduced_cost=0.01, max_kept=4 * weights.size)
        current = solve_lp(remaining, weights, max_sequence_length, depth, cheap, max_rounds=20,
                           time_limit=time_limit)
    if remaining.any():
        left_counts = np.zeros(max_sequence_length, dtype=np.int64)
        left_counts[weights - 1] = remaining
        extra_strategies, extra_repeats = _best_heuristic(left_counts, max_sequence_length, depth)
        strategies += list(extra_strategies)
        repeats += list(extra_repeats)
    rounding = "floor+repair"

    gap = sum(repeats) - lp_bound
    support = [solution.columns.items[s] for s in np.flatnonzero(solution.x > 1e-9)]
    if (gap > 0 and milp_time_limit and demand.sum() <= max_milp_sequences
            and 0 < len(support) <= max_milp_columns):
        milp_columns = _Columns()
        for items in support:
            milp_columns.add(items)
        for k in range(weights.size):
            milp_columns.add([k])
        integer_x = _milp(milp_columns, demand, milp_time_limit)
        if integer_x is not None and integer_x.sum() < sum(repeats):
            placed, placed_counts, left = _fill_slots(milp_columns.items, integer_x, weights, demand)
            if not left.any():
                strategies, repeats, rounding = placed, placed_counts, "milp"
    details = {"lp_bound_packs": lp_bound, "lp_value": solution.lp_value, "num_columns": len(solution.columns.items),
               "num_rounds": solution.num_rounds, "converged": solution.converged, "rounding": rounding,
               # the certificate: lp_bound_packs = ceil(demand . lp_duals), with lp_duals >= 0,
               # non-decreasing, and no strategy worth more than 1 under them
               "lp_item_lengths": weights.tolist(), "lp_duals": solution.bound_duals.tolist()}
    return strategies, repeats, details
