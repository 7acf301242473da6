"""Fine-tuning tasks for the one training loop (see ``bert_packed.task`` for the interface).

- ``classification``: packed sequence classification / regression (``ClassificationTask``);
- ``data``: reading CSV/TSV/JSONL, tokenising with the checkpoint's tokenizer, packing;
- ``metrics``: evaluation metrics (scikit-learn, SciPy);
- ``python -m bert_packed.finetune {export,predict,fortunes}``: Hugging Face export of a
  run's checkpoint, predictions from an exported model, the fortunes example data.
"""
