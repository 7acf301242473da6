"""The model every task builds on: the encoder, ``BertModel`` (``modeling``), the attention
implementations (``attention``: a registry and one module per implementation), the
per-sequence losses, dropout, and the ``BertConfig`` and optimizer from the configuration
(``build``). The tasks' heads live in their packages (``bert_packed.tasks.<task>.model``)."""
