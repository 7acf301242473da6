"""The small part of ``popart`` that PopTorch BERT options touch: enums passed to
``opts._Popart.set(...)`` as ints. Values from PopART SDK 3.4 (``sessionoptions.hpp``).

There is an unrelated ``popart`` package on PyPI (population-based training); never install it.
"""
import enum


class SyntheticDataMode(enum.IntEnum):
    Off = 0
    Zeros = 1
    RandomNormal = 2
    RandomUniform = 3


class AccumulateOuterFragmentSchedule(enum.IntEnum):
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(enum.IntEnum):
    OnEnterAndExit = 0
    JustInTime = 1


class Instrumentation(enum.IntEnum):
    Outer = 0
    Inner = 1


IS_MOCK = True
