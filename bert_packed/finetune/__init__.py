"""The fine-tuning command line, ``python -m bert_packed.finetune {export,predict,fortunes}``:
the Hugging Face export of a run's checkpoint, predictions from an exported model, and the
fortunes example data (``fortunes``).

The fine-tuning tasks themselves are packages of ``bert_packed.tasks`` (classification, squad,
token_classification), trained by ``run.py`` through the one training loop.
"""
