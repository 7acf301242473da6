"""PopTorch's enums, with the values of the Poplar SDK 3.4 release (poptorch ``python/enums.py``).

Values matter: PopTorch stores some of them as plain ints inside ``Options`` (for example
``output_mode``), so code that compares against ``OutputMode.Sum`` must see the same numbers.
"""
import enum


class OutputMode(enum.IntEnum):
    """Which outputs of a run come back to the host (see ``Options.outputMode``)."""
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


# Old name (SDK <= 2.4) kept so older scripts import; same values.
AnchorMode = OutputMode


class ReductionType(enum.IntEnum):
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(enum.IntEnum):
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class ConnectionType(enum.IntEnum):
    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(enum.IntEnum):
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class MatMulSerializationMode(enum.Enum):
    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class Liveness(enum.IntEnum):
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class AutoStage(enum.IntEnum):
    """How stages are assigned to blocks when no explicit stages are given.

    ``SameAsIpu``: stage id = the block's ipu id. ``AutoIncrement``: every new block starts a
    new stage (PopART later merges consecutive stages that sit on the same IPU).
    """
    SameAsIpu = 0
    AutoIncrement = 1


class CommGroupType(enum.IntEnum):
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    OnePerGroup = 0
    AllReplicas = 2
