"""Sequence packing for transformer training, without torch.

    from packing import Histogram, pack, assign
    histogram = Histogram.load("wikipedia-512")            # or Histogram.from_lengths(lengths, 512)
    result = pack(histogram, algorithm="lp", max_sequences_per_pack=3)
    print(result.to_dict())                                # packs, efficiency, lp_bound_packs, ...
    packs = assign(result.plan, lengths, seed=0)           # CSR: pack_offsets, sequence_indices

Command line: ``python -m packing report|bench|plot`` (see ``python -m packing --help``).
"""
from .algorithms import ALGORITHMS, check_algorithm_depth, get_algorithm, pack, residual
from .assign import Assignment, assign
from .histogram import SHIPPED_HISTOGRAMS, Histogram, PackingError
from .plan import PackingResult, Plan

__all__ = ["ALGORITHMS", "Assignment", "Histogram", "PackingError", "PackingResult", "Plan", "SHIPPED_HISTOGRAMS",
           "assign", "check_algorithm_depth", "get_algorithm", "pack", "residual"]
