"""The parts the training loop (``bert_packed.loop.train``) is made of, in the manner of torchtitan's
components: the step plan (``plan``), the checkpointer (``checkpointer``), the metrics logger
with its progress output and throughput counters (``logger``), the divergence guard
(``guard``), stop signals and the ways a run ends early (``stops``), and the process group
(``distributed``). Each owns one concern; ``bert_packed.loop.train`` wires them around
``backend.train_step``."""
