"""PopTorch's session-option parser, replayed on the tables of ``session_options.json``.

When PopTorch compiles, ``Options.toDict()`` (the execution strategy's backend options, the
``_Popart`` options, then the ``Options``, ``Training``, ``Distributed`` and ``TensorLocations``
values) goes through ``SessionOptionsParser`` (poptorch ``poptorch/source/SessionOptionsParser.cpp``):
each value is dispatched by its Python type (bool, then float, then int, then str, then
list/set/tuple, then dict) to one table of ``SessionOptionsImpl``, and a name missing from that
table is an error: ``Unknown bool option X``, ``Unknown uint64 option X``, ``Unknown floating
point option X``, ``Unknown string option X``, ``Unknown set / vector option X``, ``Unknown map
option X``. Enum-valued options check their range; pattern names go to PopART's registry. The
tables are generated from the real sources by ``extract_session_options.py`` (the file records
the commits); nothing here lists an option by hand.

``parse`` raises what PopTorch raises (through the ``error`` factory the caller passes, the mock's
``poptorch.Error``) and returns what PopART receives; ``cache_view`` keeps the part PopART hashes
into the executable-cache key (``std::hash<popart::SessionOptions>``, plus the patterns).
"""
import json
import os
from typing import Any, Callable, Dict

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "session_options.json")

# Handled by PopTorch before the tables (SessionOptionsParser.cpp): skipped or special.
_SKIPPED = ("patterns_level", "anchored_tensors", "compilation_progress_bar_fn")
_TYPE_NAMES = {"bool": "bool", "uint64": "uint64", "double": "floating point", "string": "string"}
_MAPS_HASHED = ("engineOptions", "convolutionOptions", "lstmOptions", "matmulOptions", "gclOptions")

_tables = None


def tables() -> Dict[str, Any]:
    global _tables
    if _tables is None:
        with open(DATA_FILE, encoding="utf-8") as f:
            _tables = json.load(f)
    return _tables


def _entry(table: str, name: str, type_name: str, error):
    entry = tables()["tables"][table].get(name)
    if entry is None:
        raise error(f"Unknown {type_name} option {name}", type="poptorch_cpp_error")
    return entry


def _check_range(entry, name: str, value: int, error) -> None:
    limit = entry.get("range")
    if limit is not None and int(value) > limit["max"]:
        raise error(limit["message"], type="poptorch_cpp_error")


def _check_patterns(options: Dict[str, Any], patterns, error) -> Dict[str, Any]:
    data = tables()
    if "patterns_level" not in options:
        raise error("PopART option 'patterns' should not be set without first setting 'patterns_level'.",
                    type="poptorch_cpp_error")
    level = options["patterns_level"]
    if int(level) > data["max_patterns_level"]:
        raise error("level > static_cast<std::uint64_t>(popart::PatternsLevel::All)", type="poptorch_cpp_error")
    known = set(data["patterns"])
    for name, enabled in patterns.items():
        if str(name) not in known:
            # popart::PreAliasPatternManager::getTypeIndex (patterns.hpp), a popart::error
            raise error(f"Unknown pattern {name}.", type="popart_exception")
        if not isinstance(enabled, bool):
            raise error(f"Unable to cast Python instance of type {type(enabled)} to C++ type 'bool'",
                        type="std::exception")
    return {"level": int(level), "settings": {str(k): bool(v) for k, v in sorted(patterns.items())}}


def parse(options: Dict[str, Any], *, error: Callable[..., Exception]) -> Dict[str, Any]:
    """Replay ``SessionOptionsParser`` on PopTorch's merged options dict (in its order).

    Returns ``{"session": {popart field: value}, "poptorch": {option: value}, "patterns": ...,
    "locations": {popart field: {key: value}}, "memory_proportions": {ipu: proportion}}``.
    """
    data = tables()
    session, poptorch_only, locations, proportions, patterns = {}, {}, {}, {}, None
    for name, value in options.items():
        if name in _SKIPPED:
            continue
        if isinstance(value, bool):
            table = "bool"
        elif isinstance(value, float):
            table = "double"
        elif isinstance(value, int):
            table = "uint64"
        elif isinstance(value, str):
            table = "string"
        elif isinstance(value, (set, list, tuple)):
            entry = _entry("container", name, "set / vector", error)
            if entry.get("range"):  # hardwareInstrumentations: each element an enum value
                for item in value:
                    _check_range(entry, name, int(item), error)
            target = session if entry["popart_field"] else poptorch_only
            target[entry["popart_field"] or name] = [str(item) for item in value]
            continue
        elif isinstance(value, dict):
            if name == "available_memory_proportion":
                for ipu, proportion in value.items():
                    if float(proportion) > 3.4028234663852886e38:
                        raise error(f"{proportion} is too high for a Popart float attribute.",
                                    type="poptorch_cpp_error")
                    proportions[int(ipu)] = float(proportion)
            elif name == "patterns":
                patterns = _check_patterns(options, value, error)
            elif name.startswith("location_"):
                groups, keys = data["tensor_locations"]["groups"], data["tensor_locations"]["keys"]
                if value and name not in groups:
                    raise error(f"Unknown tensor location {name}", type="poptorch_cpp_error")
                for key, setting in value.items():
                    if key not in keys:
                        raise error(f"Unknown option '{key}' for tensor location {name}", type="poptorch_cpp_error")
                    locations.setdefault(groups[name], {})[key] = int(setting)
            else:
                entry = _entry("container", name, "map", error)
                target = session if entry["popart_field"] else poptorch_only
                target.setdefault(entry["popart_field"] or name, {}).update(
                    {str(k): str(v) for k, v in value.items()})
            continue
        else:
            raise error(f"Unknown value type {type(value).__name__} for option {name}", type="poptorch_cpp_error")
        entry = _entry(table, name, _TYPE_NAMES[table], error)
        if table == "uint64":
            _check_range(entry, name, value, error)
            value = int(value)
        if entry["popart_field"]:
            session[entry["popart_field"]] = value
        else:
            poptorch_only[name] = value
    return {"session": session, "poptorch": poptorch_only, "patterns": patterns, "locations": locations,
            "memory_proportions": proportions}


def is_hashed(field: str) -> bool:
    """Whether PopART's ``std::hash<SessionOptions>`` covers ``field`` (or the struct holding it)."""
    hashed = tables()["hashed_session_fields"]
    return any(field == h or field.startswith(h + ".") for h in hashed)


def cache_view(parsed: Dict[str, Any]) -> Dict[str, Any]:
    """The session options and patterns PopART hashes into the executable-cache key."""
    session = {k: v for k, v in sorted(parsed["session"].items()) if is_hashed(k)}
    for name in _MAPS_HASHED:  # every key and value of these maps
        value = parsed["session"].get(name)
        if value is not None:  # (a list is inserted as keys without values, as PopTorch does)
            session[name] = sorted(value) if isinstance(value, list) else dict(sorted(value.items()))
    locations = {k: dict(sorted(v.items())) for k, v in sorted(parsed["locations"].items()) if is_hashed(k)}
    return {"session": session, "tensor_locations": locations, "patterns": parsed["patterns"]}
