"""An IPU-free stand-in for ``poptorch`` (Graphcore PopTorch, Poplar SDK 3.4 API).

``--backend mock`` and the tests import this instead of the real ``poptorch`` so that the IPU
code path (options, pipeline annotations, batching, accumulation, replication, output modes,
LAMB) runs and is checked on any machine. Behaviours reproduced, with PopTorch's messages, are
listed in ``docs/ipu.md``. Numerics are eager PyTorch on the CPU. ``cycleCount()`` returns a
cost-model *estimate* of GC200 cycles; nothing from this module is an IPU measurement.
"""
from . import optim  # noqa: F401  (poptorch.optim)
from .enums import *  # noqa: F401,F403  (PopTorch re-exports its enums at top level)
from .errors import Error, RecoverableError, UnrecoverableError  # noqa: F401
from .executor import (DataLoader, PoplarExecutor, inferenceModel, num_available_ipus,  # noqa: F401
                       set_cycle_estimator, set_memory_estimator, trainingModel)
from .ops import (BeginBlock, Block, BlockFunction, identity_loss, ipu_print_tensor,  # noqa: F401
                  isRunningOnIpu, nop, recomputationCheckpoint, removeBlocks, serializedMatMul,
                  set_available_memory)
from .options import (Options, PipelinedExecution, ShardedExecution, Stage,  # noqa: F401
                      TensorLocationSettings)

__version__ = "3.4.0+mock"
IS_MOCK = True  # real poptorch has no such attribute; code may check getattr(poptorch, "IS_MOCK", False)


def ipuHardwareIsAvailable(num_ipus=1):
    return False


def ipuHardwareVersion():
    raise Error("No IPU hardware: this is the IPU-free mock of poptorch")


def setLogLevel(level):
    pass
