"""Sequence packing for transformer training, without torch.

    from packing import Histogram, pack, assign
    histogram = Histogram.load("wikipedia-512")            # or Histogram.from_lengths(lengths, 512)
    # memory and time grow with the sequences and distinct lengths, not with L (<= 2**53)
    result = pack(histogram, algorithm="lp", max_sequences_per_pack=3)
    print(result.to_dict())                                # packs, efficiency, lp_bound_packs, ...
    packs = assign(result.plan, lengths, seed=0)           # CSR: pack_offsets, sequence_indices

    rows = pack_sequences(token_id_lists, 8192, "lp")      # LLM rows: input_ids, position_ids, cu_seqlens

Command line: ``python -m packing report|bench|plot`` (see ``python -m packing --help``).
"""
from .algorithms import ALGORITHMS, check_algorithm_depth, get_algorithm, pack, residual
from .assign import Assignment, assign
from .bounds import lower_bounds
from .histogram import MAX_SEQUENCE_LENGTH, SHIPPED_HISTOGRAMS, Histogram, LengthCounts, PackingError
from .llm import PackedRows, batch_cu_seqlens, pack_dataset, pack_sequences, pack_stream
from .plan import PackingResult, Plan

__all__ = ["ALGORITHMS", "Assignment", "Histogram", "LengthCounts", "MAX_SEQUENCE_LENGTH", "PackedRows",
           "PackingError", "PackingResult", "Plan", "SHIPPED_HISTOGRAMS", "assign", "batch_cu_seqlens",
           "check_algorithm_depth", "get_algorithm", "lower_bounds", "pack", "pack_dataset", "pack_sequences",
           "pack_stream", "residual"]
