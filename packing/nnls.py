"""Non-negative least squares histogram packing (NNLSHP) and its extended variant (ENNLSHP).

Both solve for a mixture ``x >= 0`` of all strategies that sum *exactly* to L (the paper's
"packing matrix" A, one column per strategy, rows = lengths 1..L), round it to integers,
and put the sequences the rounded mixture leaves out into packs of their own. Lengths the
mixture over-subscribes become padding (the paper's "explicit padding"), which
:func:`packing.plan.exact_plan` turns into shorter strategies.

The strategy count grows like L^2/12 at depth 3 and L^3/144 at depth 4, which is why
the papers (and we) define these two for depth <= 3 only; use ``lp`` beyond that.
"""
import numpy as np

from .histogram import dense_counts

MAX_NNLS_DEPTH = 3


def exact_sum_strategies(max_sequence_length, depth):
    """All ascending tuples of 1..depth lengths that sum exactly to L, as a dense
    np.int64 [num_strategies, depth] array padded with zeros on the left."""
    L = max_sequence_length
    rows = [np.array([[0] * (depth - 1) + [L]], dtype=np.int64)]
    if depth >= 2:
        a = np.arange(1, L // 2 + 1)
        pairs = np.zeros((a.size, depth), dtype=np.int64)
        pairs[:, -2], pairs[:, -1] = a, L - a
        rows.append(pairs)
    if depth >= 3:
        a, b = np.meshgrid(np.arange(1, L // 3 + 1), np.arange(1, L // 2 + 1), indexing="ij")
        a, b = a.ravel(), b.ravel()
        c = L - a - b
        keep = (a <= b) & (b <= c)
        triples = np.zeros((int(keep.sum()), depth), dtype=np.int64)
        triples[:, -3], triples[:, -2], triples[:, -1] = a[keep], b[keep], c[keep]
        rows.append(triples)
    return np.concatenate(rows)


def packing_matrix(strategies, max_sequence_length):
    """Dense float64 A [L, num_strategies]: A[l-1, s] = how often length l occurs in s."""
    num_strategies = strategies.shape[0]
    A = np.zeros((max_sequence_length + 1, num_strategies))
    columns = np.broadcast_to(np.arange(num_strategies)[:, None], strategies.shape)
    np.add.at(A, (strategies.ravel(), columns.ravel()), 1.0)
    return A[1:]


def _round_and_complete(x, A, strategies, counts, depth):
    """Round the mixture, then pack the sequences the rounded mixture misses with LPFHP (the
    papers' left-over step; one pack each would give 2x the optimum when the lengths never
    sum exactly to L, e.g. all sequences of 171 tokens at L = 512)."""
    from .heuristics import pack_lpfhp

    repeats = np.rint(x).astype(np.int64)
    residual = counts - A.astype(np.int64) @ repeats
    result_strategies = [tuple(int(v) for v in row if v) for row in strategies]
    result_repeats = repeats.tolist()
    if np.any(residual > 0):
        left_strategies, left_repeats = pack_lpfhp(np.maximum(residual, 0), counts.size, depth)
        result_strategies += list(left_strategies)
        result_repeats += list(left_repeats)
    # Where no mixture of exact-sum strategies fits the data (all lengths 171 at L = 512:
    # the mixture pairs each 171 with a 341 that does not exist, leaving one per pack), the
    # least-squares fit is poor; LPFHP on the whole histogram is then kept instead.
    from .plan import exact_plan

    fallback = pack_lpfhp(counts, counts.size, depth)
    if exact_plan(*fallback, counts, counts.size).num_packs < \
            exact_plan(result_strategies, result_repeats, counts, counts.size).num_packs:
        return list(fallback[0]), list(fallback[1])
    return result_strategies, result_repeats


# The dense matrices these methods build, beyond which they refuse (with advice) instead
# of being killed for memory: 1 GiB. L = 1,024 at depth 3 needs 0.7 GiB, 2,048 needs 5.7.
MAX_DENSE_BYTES = 2**30


def num_exact_sum_strategies(max_sequence_length, depth):
    """How many rows :func:`exact_sum_strategies` has, without building them (closed form,
    O(1) whatever L is)."""
    L = int(max_sequence_length)
    total = 1 + (L // 2 if depth >= 2 else 0)
    if depth >= 3:
        # triples a <= b <= c = L - a - b: for each a in 1..L//3, b in [a, (L - a) // 2], which
        # is never empty there; sum over a of ((L - a) // 2 - a + 1), in integers.
        A = L // 3
        odd = A // 2 if L % 2 else (A + 1) // 2  # how many a make L - a odd
        halves = (A * L - A * (A + 1) // 2 - odd) // 2  # sum of (L - a) // 2
        total += halves - A * (A + 1) // 2 + A
    return total


def _dense_shape(name, max_sequence_length, depth):
    """(rows, columns) of ``name``'s dense matrix."""
    L = int(max_sequence_length)
    columns = num_exact_sum_strategies(L, depth)
    if name == "ennlshp":
        return 2 * L, columns + L
    return L, columns


def fits_dense(name, max_sequence_length, depth, max_bytes=MAX_DENSE_BYTES):
    """Whether ``name``'s dense matrix at this length and depth stays within ``max_bytes``."""
    rows, columns = _dense_shape(name, max_sequence_length, depth)
    return 8 * rows * columns <= max_bytes


def check_dense_size(name, max_sequence_length, depth, max_bytes=MAX_DENSE_BYTES):
    """Raise PackingError (naming the algorithm to use instead) if ``name``'s dense matrix
    at this length and depth would exceed ``max_bytes``."""
    from .histogram import PackingError

    L = int(max_sequence_length)
    rows, columns = _dense_shape(name, L, depth)
    needed = 8 * rows * columns
    if needed > max_bytes:
        raise PackingError(
            f"{name} at max_sequence_length {L}, depth {depth} needs a dense {rows:,} x {columns:,} matrix "
            f"({needed / 2**30:,.1f} GiB, limit {max_bytes / 2**30:,.1f} GiB); use lp (the same problem, solved "
            f"exactly with column generation) or lpfhp instead")


def _nnls_mixture(counts, max_sequence_length, depth, short_length, short_weight):
    check_dense_size("nnlshp", max_sequence_length, depth)
    counts = dense_counts(counts, max_sequence_length)  # dense by nature; small L only (checked above)
    strategies = exact_sum_strategies(max_sequence_length, depth)
    A = packing_matrix(strategies, max_sequence_length)
    weights = np.ones(max_sequence_length)
    weights[:short_length] = short_weight
    from scipy import optimize  # imported here: the command line starts faster without scipy

    x, _ = optimize.nnls(weights[:, None] * A, weights * counts, maxiter=50 * A.shape[1])
    return x, A, strategies


def pack_nnlshp(counts, max_sequence_length, depth, short_length=8, short_weight=0.09):
    """NNLSHP (Krell et al., section 3.1.2 / F.4): ``min ||w (A x - b)||^2, x >= 0``.

    The weight is ``short_weight`` (0.09) for lengths <= ``short_length`` (8) and 1
    elsewhere, so a deficit of very short sequences (cheap padding) is penalised less.
    """
    x, A, strategies = _nnls_mixture(counts, max_sequence_length, depth, short_length, short_weight)
    return _round_and_complete(x, A, strategies, dense_counts(counts, max_sequence_length), depth)


def nnls_residual(counts, max_sequence_length, depth, short_length=8, short_weight=0.09):
    """np.int64 [L]: ``b - A rint(x)`` of NNLSHP before left-overs are handled (the
    papers' Figures 7/8): positive = sequences left out, negative = padding slots."""
    x, A, _ = _nnls_mixture(counts, max_sequence_length, depth, short_length, short_weight)
    return dense_counts(counts, max_sequence_length) - A.astype(np.int64) @ np.rint(x).astype(np.int64)


def pack_ennlshp(counts, max_sequence_length, depth, penalty=1e6):
    """Extended NNLSHP (Krell et al., appendix "padding token weighting").

    Minimises the padding-token-weighted residual ``||diag(1..L) (A x - b)||^2`` while a
    ``penalty``-weighted block with slack ``r >= 0`` enforces ``A x - b = r >= 0`` (no
    sequence left out before rounding):
    ``A_bar = [[w A, 0], [p A, -p I]]``, ``b_bar = [w b, p b]``, unknowns ``[x, r]``.
    """
    check_dense_size("ennlshp", max_sequence_length, depth)
    counts = dense_counts(counts, max_sequence_length)  # dense by nature; small L only (checked above)
    strategies = exact_sum_strategies(max_sequence_length, depth)
    A = packing_matrix(strategies, max_sequence_length)
    L, num_strategies = A.shape
    weights = np.arange(1, L + 1, dtype=np.float64)
    A_bar = np.zeros((2 * L, num_strategies + L))
    A_bar[:L, :num_strategies] = weights[:, None] * A
    A_bar[L:, :num_strategies] = penalty * A
    A_bar[L:, num_strategies:] = -penalty * np.eye(L)
    b_bar = np.concatenate([weights * counts, penalty * counts.astype(np.float64)])
    from scipy import optimize

    solution, _ = optimize.nnls(A_bar, b_bar, maxiter=50 * A_bar.shape[1])
    return _round_and_complete(solution[:num_strategies], A, strategies, counts, depth)
