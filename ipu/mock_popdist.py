"""A stand-in for the Poplar SDK's ``popdist`` (PopRun's view of this host process), for tests.

``configure(...)`` plays the part of ``poprun --num-instances N --num-replicas R``: afterwards
``isPopdistEnvSet()`` is True and ``popdist.poptorch.Options`` gives mock ``poptorch.Options``
with this instance's replicas and process id, as the real one does.
"""
import types

from ipu import mock_poptorch

_DEFAULTS = {"set": False, "num_instances": 1, "instance_index": 0, "num_local_replicas": 1, "ipus_per_replica": 1,
             "init_calls": 0}
_state = dict(_DEFAULTS)


def configure(*, num_instances, instance_index, num_local_replicas, ipus_per_replica):
    _state.update(set=True, num_instances=num_instances, instance_index=instance_index,
                  num_local_replicas=num_local_replicas, ipus_per_replica=ipus_per_replica)


def reset():
    _state.update(_DEFAULTS)
    globals().pop("_packed_bert_initialised", None)


def init():
    """``popdist.init()``: what Graphcore's PopRun examples call first (counted for tests)."""
    _state["init_calls"] += 1


def init_calls():
    return _state["init_calls"]


def isPopdistEnvSet():
    return _state["set"]


def getInstanceIndex():
    return _state["instance_index"]


def getNumInstances():
    return _state["num_instances"]


def getNumLocalReplicas():
    return _state["num_local_replicas"]


def getNumTotalReplicas():
    return _state["num_local_replicas"] * _state["num_instances"]


def getReplicaIndexOffset():
    return _state["instance_index"] * _state["num_local_replicas"]


def getNumIpusPerReplica():
    return _state["ipus_per_replica"]


class _Options(mock_poptorch.Options):
    """``popdist.poptorch.Options``: replicas and process id from PopRun. The IPUs per replica are
    kept in a private attribute for the mock's placement check, not as an option value: every
    option value goes to PopTorch's C++ parser, which knows no ``ipus_per_replica``."""

    def __init__(self, ipus_per_replica=None):
        super().__init__()
        self.replicationFactor(getNumLocalReplicas())
        self.Distributed.configureProcessId(getInstanceIndex(), getNumInstances())
        object.__setattr__(self, "_popdist_ipus_per_replica", int(ipus_per_replica or getNumIpusPerReplica()))


poptorch = types.SimpleNamespace(Options=_Options)
