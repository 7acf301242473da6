"""The offline data tools: what writes the files the training sources read
(``python -m bert_packed.data``, whose command line is ``bert_packed/data/__main__.py``).

- ``create`` (``create_shards``, ``create_file``, ``create``): a corpus -> unpacked pre-training
  samples (tokenising, masking, NSP pairs), one HDF5 file or a directory of shards, on local
  processes or a Dask cluster (``engine``);
- ``pack`` (``pack``, ``pack_shards``): unpacked samples -> packed rows, with the ``packing``
  library, checked against the input (``--verify``);
- ``vocab``: a WordPiece vocabulary from a corpus; ``kjv``: the KJV corpus from Debian's
  ``bible-kjv``; ``synthetic``: synthetic unpacked files for tests and benchmarks;
- ``formats/``: the input formats of ``create`` and ``vocab``, one module each.

Training never imports this package (``tests/test_structure.py``); the tools use the readers'
file layer (``bert_packed.data.h5io``, ``bert_packed.data.shards``).
"""
