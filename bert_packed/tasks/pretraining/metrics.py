"""Pre-training's metrics: the held-out evaluation, count-weighted means over micro-batches."""
from __future__ import annotations

from typing import Dict, Iterable

__all__ = ["evaluation_metrics"]


def evaluation_metrics(step_metrics: Iterable[Dict[str, float]]) -> Dict[str, float]:
    """``eval_*`` means over the micro-batches' ``eval_step`` metrics: the MLM loss and accuracy
    weighted by each micro-batch's masked tokens, NSP's by its sequences (what one pass over all
    of them computes)."""
    totals = {"mlm": 0.0, "nsp": 0.0, "mlm_acc": 0.0, "nsp_acc": 0.0, "tokens": 0.0, "sequences": 0.0}
    for m in step_metrics:
        totals["mlm"] += m["mlm_loss"] * m["num_mlm_tokens"]
        totals["mlm_acc"] += m["mlm_accuracy"] * m["num_mlm_tokens"]
        totals["nsp"] += m["nsp_loss"] * m["num_sequences"]
        totals["nsp_acc"] += m["nsp_accuracy"] * m["num_sequences"]
        totals["tokens"] += m["num_mlm_tokens"]
        totals["sequences"] += m["num_sequences"]
    tokens, sequences = max(totals["tokens"], 1.0), max(totals["sequences"], 1.0)
    out = {"eval_mlm_loss": totals["mlm"] / tokens, "eval_nsp_loss": totals["nsp"] / sequences,
           "eval_mlm_accuracy": totals["mlm_acc"] / tokens, "eval_nsp_accuracy": totals["nsp_acc"] / sequences}
    out["eval_loss"] = out["eval_mlm_loss"] + out["eval_nsp_loss"]
    return out

