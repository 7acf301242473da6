"""The model: the encoder and pre-training heads (``modeling``), the attention
implementations (``attention``: a registry and one module per implementation),
the per-sequence losses, dropout and building a model from the configuration."""
