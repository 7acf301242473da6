"""Extract PopTorch's PopART session-option tables into ``session_options.json`` for the mock.

The mock's option checks are not written case by case: they are read from the sources that
make the real checks, and this script is how (re)build the data file from them:

    python ipu/mock_popart/extract_session_options.py \\
        --poptorch <poptorch git dir or checkout> --popart <popart git dir or checkout> \\
        [--poptorch-ref sdk-release-3.4] [--popart-ref sdk-release-3.4] [--output ipu/mock_popart/session_options.json]

A git directory (e.g. a bare clone of github.com/graphcore/poptorch) is read at ``--*-ref``
with ``git show``; the resolved commit goes into the file. What is read, and from where:

* graphcore/poptorch ``popart_compiler/source/SessionOptions.cpp``: the tables PopTorch's
  ``SessionOptionsParser`` dispatches every option to by its Python value type (bool ->
  ``bool_options``, float -> ``double_options``, int -> ``uint64_options``, str ->
  ``string_options``, list/set/tuple or dict -> ``container_options``); a name missing from the
  table of its value's type is ``Unknown <type> option <name>``. The range checks of the enum
  valued ones (``ADD_POPART_ENUM_OPTION``: ``value >= Enum::N``; hand-written ones such as
  ``value > AccumulateOuterFragmentSchedule::OverlapMemoryOptimized``) and their messages; the
  PopART field each one sets; the tensor-location keys (``setTensorLocation``); the highest
  patterns level (``setPatternsLevel``).
* enum definitions: graphcore/popart ``willow/include/popart/{sessionoptions,op,devicemanager,
  commgroup}.hpp``, ``patterns/patterns.hpp``; graphcore/poptorch
  ``popart_compiler/source/include/popart_compiler/CompilerOptions.hpp`` and
  ``popart_compiler/types/include/popart_compiler/PopartEnums.hpp``.
* graphcore/popart ``willow/src/patterns/*.cpp``: every ``PatternCreator<...> x("Name", ...)``
  (the pre-alias pattern registry ``Patterns::enablePattern`` looks names up in) and
  ``patterns.cpp``'s ``enablePattern(const std::string&, bool)`` for the names it handles
  itself (``InPlace``, ``UpdateInplacePrioritiesForIpu``); any other name is ``Unknown pattern X.``
* graphcore/popart ``willow/src/sessionoptions.cpp``: ``std::hash<popart::SessionOptions>``,
  the session options PopART hashes into the executable-cache key (with the IR, the data flow,
  the optimizer's constants, the device and the patterns: ``ir.cpp`` ``std::hash<IrBundle>``).

Plain-text parsing with regular expressions (no C++ parser is needed for these regular,
macro-generated tables); the script fails loudly when a table it expects is not found.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

POPTORCH_SESSION_OPTIONS = "popart_compiler/source/SessionOptions.cpp"
POPTORCH_ENUM_HEADERS = ("popart_compiler/source/include/popart_compiler/CompilerOptions.hpp",
                         "popart_compiler/types/include/popart_compiler/PopartEnums.hpp")
POPART_ENUM_HEADERS = ("willow/include/popart/sessionoptions.hpp", "willow/include/popart/op.hpp",
                       "willow/include/popart/devicemanager.hpp", "willow/include/popart/commgroup.hpp",
                       "willow/include/popart/patterns/patterns.hpp")
POPART_PATTERNS_DIR = "willow/src/patterns"
POPART_PATTERNS_CPP = "willow/src/patterns/patterns.cpp"
POPART_SESSION_OPTIONS_CPP = "willow/src/sessionoptions.cpp"
TABLES = ("bool", "uint64", "double", "string", "container")


# -- reading the sources --------------------------------------------------------------------

class Source:
    """Files of one repository: a git directory read at ``ref``, or a plain checkout."""

    def __init__(self, path: str, ref: str, repository: str):
        self.path, self.ref, self.repository = path, ref, repository
        self.is_git = os.path.isfile(os.path.join(path, "HEAD")) or os.path.isdir(os.path.join(path, ".git"))
        self.git_dir = os.path.join(path, ".git") if os.path.isdir(os.path.join(path, ".git")) else path
        self.files: List[str] = []

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", self.git_dir, *args], check=True, capture_output=True,
                              text=True).stdout

    def commit(self) -> Optional[str]:
        return self._git("rev-parse", f"{self.ref}^{{commit}}").strip() if self.is_git else None

    def read(self, relpath: str) -> str:
        self.files.append(relpath)
        if self.is_git:
            return self._git("show", f"{self.ref}:{relpath}")
        with open(os.path.join(self.path, relpath), encoding="utf-8") as f:
            return f.read()

    def list_dir(self, relpath: str) -> List[str]:
        if self.is_git:
            names = self._git("ls-tree", "--name-only", f"{self.ref}:{relpath}").split()
        else:
            names = os.listdir(os.path.join(self.path, relpath))
        return sorted(f"{relpath}/{name}" for name in names)


# -- C++ text helpers -------------------------------------------------------------------------

def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def strip_defines(text: str) -> str:
    """Drop ``#define`` lines and their backslash continuations (the macros' own text)."""
    out, in_define = [], False
    for line in text.splitlines():
        if in_define or line.lstrip().startswith("#define"):
            in_define = line.rstrip().endswith("\\")
            continue
        out.append(line)
    return "\n".join(out)


def call_arguments(text: str, open_paren: int) -> Tuple[str, int]:
    """The text between the parenthesis at ``open_paren`` and its match, and the index after it."""
    depth = 0
    for i in range(open_paren, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[open_paren + 1:i], i + 1
    raise ValueError("unbalanced parentheses")


def function_body(text: str, signature_regex: str) -> str:
    match = re.search(signature_regex, text)
    if not match:
        raise ValueError(f"not found: {signature_regex}")
    start = text.index("{", match.end() - 1)
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    raise ValueError("unbalanced braces")


def parse_enums(text: str) -> Dict[str, Dict[str, int]]:
    """``enum class Name [: type] { A = 0, B, ... }`` -> {Name: {member: value}}."""
    enums = {}
    for match in re.finditer(r"enum\s+class\s+(\w+)\s*(?::\s*[\w:]+\s*)?\{([^{}]*)\}", strip_comments(text)):
        members, value = {}, -1
        for item in match.group(2).split(","):
            item = item.strip()
            if not item:
                continue
            name, _, expr = item.partition("=")
            value = int(expr.strip(), 0) if expr.strip() else value + 1
            members[name.strip()] = value
        enums[match.group(1)] = members
    return enums


def enum_value(enums: Dict[str, Dict[str, int]], path: str) -> int:
    """``popart::SyntheticDataMode::N`` / ``detail::ExecutionMode::N`` -> the member's value."""
    parts = path.split("::")
    return enums[parts[-2]][parts[-1]]


# -- PopTorch's SessionOptions.cpp ------------------------------------------------------------

_RANGE_CHECK = re.compile(r"ERROR_ON_MSG\(\s*value\s*(>=|>)\s*static_cast<[^>]*>\(\s*([\w:\s]+?)\s*\)\s*,\s*(.*?)\);",
                          re.S)


def _message(expression: str, enum_type: Optional[str] = None) -> str:
    """A C++ ``"a" << #EnumType << "b"`` message expression as text."""
    pieces = []
    for token in re.findall(r'"((?:[^"\\]|\\.)*)"|#(\w+)|<<\s*(\w+)', expression):
        literal, stringised, variable = token
        if literal:
            pieces.append(literal)
        elif stringised:
            pieces.append(enum_type or stringised)
    return "".join(pieces)


def _range(body: str, enums, enum_type: Optional[str] = None) -> Optional[Dict[str, object]]:
    check = _RANGE_CHECK.search(body)
    if not check:
        return None
    comparator, member, message = check.groups()
    member = re.sub(r"\s+", "", member)  # clang-format may break "A::\n    B"
    limit = enum_value(enums, member.replace("EnumType", enum_type) if enum_type else member)
    enum_name = enum_type or member.split("::")[-2]
    return {"enum": enum_name, "max": limit - 1 if comparator == ">=" else limit,
            "message": _message(message, enum_type)}


def parse_poptorch_tables(text: str, enums) -> Dict[str, Dict[str, Dict[str, object]]]:
    """{table: {option name: {"popart_field": ..., "range": {...}}}} of SessionOptionsImpl()."""
    code = strip_defines(strip_comments(text))
    constructor = function_body(code, r"SessionOptionsImpl::SessionOptionsImpl\(\)\s*\{")
    tables: Dict[str, Dict[str, Dict[str, object]]] = {name: {} for name in TABLES}

    for match in re.finditer(r"registerSetter\(", constructor):
        arguments, _ = call_arguments(constructor, match.end() - 1)
        head = re.match(r"\s*(\w+)_options\s*,\s*\"([^\"]+)\"\s*,", arguments)
        if not head:
            raise ValueError(f"unexpected registerSetter call: {arguments[:80]}")
        table, name = head.groups()
        field = re.search(r"popart_options\s*\.\s*([\w.]+?)\s*(?:=|\(|\.push_back|\.insert|\.emplace)", arguments)
        tables[table][name] = {"popart_field": field.group(1) if field else None,
                               "range": _range(arguments, enums)}

    for match in re.finditer(r"(\w+)_options\[\"([^\"]+)\"\]\s*=", constructor):  # string_options["logDir"] = ...
        tables[match.group(1)].setdefault(match.group(2), {"popart_field": None, "range": None})

    macro = re.compile(r"ADD_POPART_(ENUM|BOOL|UINT64|DOUBLE|STRING)_OPTION\(\s*([\w.]+)\s*(?:,\s*(\w+)\s*)?\)")
    kinds = {"ENUM": "uint64", "BOOL": "bool", "UINT64": "uint64", "DOUBLE": "double", "STRING": "string"}
    for kind, name, enum_type in macro.findall(constructor):
        entry = {"popart_field": name, "range": None}
        if kind == "ENUM":
            entry["range"] = {"enum": enum_type, "max": enums[enum_type]["N"] - 1,
                              "message": f"Value for {enum_type} out of range"}
        tables[kinds[kind]][name] = entry
    if not tables["bool"] or not tables["uint64"] or not tables["double"]:
        raise ValueError("SessionOptionsImpl tables not found (did the source layout change?)")
    return tables


def parse_tensor_locations(text: str) -> Dict[str, object]:
    code = strip_comments(text)
    body = function_body(code, r"void\s+SessionOptions::setTensorLocation\([^)]*\)\s*\{")
    groups = dict(re.findall(r"location_tensor\s*==\s*\"(location_\w+)\"\s*\)\s*\{\s*settings\s*=\s*"
                             r"&_impl->popart_options\.(\w+)", body))
    keys = re.findall(r"opt\s*==\s*\"(\w+)\"", body)
    if not groups or not keys:
        raise ValueError("setTensorLocation not found")
    return {"groups": groups, "keys": keys}


def parse_patterns_level(text: str, enums) -> int:
    body = function_body(strip_comments(text), r"void\s+SessionOptions::setPatternsLevel\([^)]*\)\s*\{")
    member = re.search(r"level\s*>\s*static_cast<[^>]*>\(\s*([\w:\s]+?)\s*\)", body)
    return enum_value(enums, re.sub(r"\s+", "", member.group(1)))


# -- PopART: patterns and the executable-cache hash --------------------------------------------

def parse_pattern_names(files: Dict[str, str]) -> List[str]:
    names = set()
    for text in files.values():
        for match in re.finditer(r"PatternCreator<.*?>\s*\w+\s*\(\s*\"(\w+)\"", strip_comments(text), flags=re.S):
            names.add(match.group(1))
    return sorted(names)


def parse_special_pattern_names(patterns_cpp: str) -> List[str]:
    body = function_body(strip_comments(patterns_cpp),
                         r"Patterns\s*&\s*Patterns::enablePattern\(const std::string\s*&\s*\w+\s*,\s*bool\s+\w+\)\s*\{")
    return sorted(set(re.findall(r"==\s*\"(\w+)\"", body)))


def parse_hashed_fields(sessionoptions_cpp: str) -> List[str]:
    body = function_body(strip_comments(sessionoptions_cpp),
                         r"hash<popart::SessionOptions>::operator\(\)\([^)]*\)\s*const\s*\{")
    fields = set()
    for path in re.findall(r"\bso\s*\.\s*([A-Za-z_]\w*(?:\s*\.\s*[A-Za-z_]\w*)*)", body):
        parts = re.sub(r"\s+", "", path).split(".")  # clang-format may break "a\n    .b"
        while parts and parts[-1] in ("hash", "begin", "end", "serialize", "location"):
            parts.pop()
        fields.add(".".join(parts))
    return sorted(fields)


# -- main ---------------------------------------------------------------------------------------

def extract(poptorch: Source, popart: Source) -> Dict[str, object]:
    enums: Dict[str, Dict[str, int]] = {}
    for header in POPART_ENUM_HEADERS:
        enums.update(parse_enums(popart.read(header)))
    for header in POPTORCH_ENUM_HEADERS:
        enums.update(parse_enums(poptorch.read(header)))
    session_options = poptorch.read(POPTORCH_SESSION_OPTIONS)
    pattern_files = {path: popart.read(path) for path in popart.list_dir(POPART_PATTERNS_DIR)
                     if path.endswith(".cpp")}
    patterns = sorted(set(parse_pattern_names(pattern_files))
                      | set(parse_special_pattern_names(pattern_files[POPART_PATTERNS_CPP])))
    return {
        "generated_by": "ipu/mock_popart/extract_session_options.py",
        "sources": {
            "poptorch": {"repository": poptorch.repository, "ref": poptorch.ref, "commit": poptorch.commit(),
                         "files": sorted(set(poptorch.files))},
            "popart": {"repository": popart.repository, "ref": popart.ref, "commit": popart.commit(),
                       "files": sorted(set(popart.files) - set(pattern_files)) + [POPART_PATTERNS_DIR + "/*.cpp"]},
        },
        "tables": parse_poptorch_tables(session_options, enums),
        "tensor_locations": parse_tensor_locations(session_options),
        "max_patterns_level": parse_patterns_level(session_options, enums),
        "patterns": patterns,
        "hashed_session_fields": parse_hashed_fields(popart.read(POPART_SESSION_OPTIONS_CPP)),
    }


def main(argv=None, *, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--poptorch", required=True, help="graphcore/poptorch: a git directory or a checkout")
    parser.add_argument("--popart", required=True, help="graphcore/popart: a git directory or a checkout")
    parser.add_argument("--poptorch-ref", default="sdk-release-3.4")
    parser.add_argument("--popart-ref", default="sdk-release-3.4")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "session_options.json"))
    args = parser.parse_args(argv)
    data = extract(Source(args.poptorch, args.poptorch_ref, "graphcore/poptorch"),
                   Source(args.popart, args.popart_ref, "graphcore/popart"))
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    counts = ", ".join(f"{len(data['tables'][t])} {t}" for t in TABLES)
    out(f"wrote {args.output}: {counts} options, {len(data['patterns'])} patterns, "
        f"{len(data['hashed_session_fields'])} hashed session fields")
    return 0


if __name__ == "__main__":
    sys.exit(main())
