"""The ``mock`` backend: the IPU code path (``backends/ipu.py``'s ``PopTorchBackend``) on the
IPU-free poptorch stand-in (``ipu/mock_poptorch``).

Identical to the ``ipu`` backend except for the module it passes in. It proves that the
options, pipeline annotations, batching, accumulation/replication and optimizer wiring are
consistent and give the same training step as the cpu backend; it says nothing about IPU
speed, memory or compilation (its cycle counts and memory figures are model estimates). See
docs/ipu.md.
"""
from __future__ import annotations

import ipu.mock_popart as mock_popart
import ipu.mock_poptorch as mock_poptorch
from bert_packed.loop.estimate import host_flops_per_second
from bert_packed.loop.within_step import watch_layers
from backends.ipu import PopTorchBackend
from ipu import options as ipu_options
from ipu.estimates import install_mock_estimators


class MockBackend(PopTorchBackend):
    name = "mock"
    cost_unit = "estimated cycles"
    cost_note = "GC200 cost-model estimate, not a measurement"
    prices_from_shapes = True
    throughput_is_estimated = True

    @staticmethod
    def is_available(config=None) -> bool:
        return True

    def ipus_present(self, num_ipus: int) -> bool:
        return num_ipus <= mock_poptorch.num_available_ipus()

    def missing_ipus_hint(self) -> str:
        return (f"the mock system has {mock_poptorch.num_available_ipus()}; set MOCK_POPTORCH_NUM_IPUS to model a "
                f"larger one")

    def __init__(self) -> None:
        install_mock_estimators(mock_poptorch)
        super().__init__(poptorch=mock_poptorch, popart=mock_popart, popdist=ipu_options.import_popdist())
        self.layer_handles = []

    def prepare(self, model, optimizer, plan, **kwargs) -> None:
        """PopTorch's prepare, then the mock's per-micro-batch report wired to the loop's hook
        (``Backend.micro_batch_done``): a real IPU runs the step in one device call. The mock
        runs the model eagerly on the host, a micro-batch of BERT-Large in minutes: hooks on its
        encoder layers report each layer of it too (``Backend.layer_done``), which a real IPU,
        running a compiled graph, cannot do."""
        super().prepare(model, optimizer, plan, **kwargs)
        for handle in self.layer_handles:
            handle.remove()
        self.layer_handles = []
        if self.training_model is not None:
            self.training_model.set_micro_batch_callback(self.micro_batch_done)
            self.layer_handles = watch_layers(self.model, self.layer_done)

    def layer_done(self, phase: str, index: int, count: int):
        """The executable's first call traces the model before it runs (the mock's compile):
        that forward is reported as "trace"."""
        return super().layer_done(phase if self.training_model.isCompiled() else "trace", index, count)

    def compute_rate(self):
        """The mock computes on this machine's CPU: its measured rate (an IPU's would be no guide)."""
        return host_flops_per_second()
