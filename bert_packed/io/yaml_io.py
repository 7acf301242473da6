"""YAML in, with the three checks ``yaml.safe_load`` does not make.

``load_yaml(path)`` / ``loads_yaml(text, where)`` read YAML with a ``yaml.SafeLoader``
subclass (no Python objects, as ``safe_load``) that also refuses, with one-line
``YamlError`` messages naming the file:

- **a key twice in one mapping** (``safe_load`` silently keeps the last value): the message
  names the key and both lines. Keys a merge (``<<: *base``) brings in may be overridden:
  that is what a merge is for;
- **alias expansion beyond ``MAX_NODES`` values**: an alias is a reference, so PyYAML builds
  a "billion laughs" document (each level nine aliases of the one before) in a moment, but
  whatever walks the result (printing the resolved config, ``json.dumps``, a checkpoint's
  copy of the config) expands it to billions of values. The document's expanded size is
  counted on its node graph before anything is built (memoised, so linear in the document,
  whatever it expands to), and a recursive alias is refused. Anchors and aliases themselves
  are fine: a config sharing a section between two places is a few hundred values;
- **bytes that are not UTF-8**: the message names the file, line, byte offset and column
  (a UTF-8 byte-order mark is fine). YAML syntax errors name the file, line and column
  (``YamlSyntaxError``, a ``YamlError``).

This module imports nothing of the project's but ``bert_packed.io.files`` (no torch, no config), so the
config loader can use it.
"""
from __future__ import annotations

from typing import Any, Dict

import yaml

from bert_packed.io.files import read_utf8

__all__ = ["YamlError", "YamlSyntaxError", "load_yaml", "loads_yaml", "MAX_NODES"]

# Values (scalars, lists, mappings) one document may expand to. The largest shipped config is
# a few hundred; a limit far above any real config and far below what hurts.
MAX_NODES = 100_000


class YamlError(ValueError):
    """A YAML file that cannot be read as meant; the message is one line naming the file."""


class YamlSyntaxError(YamlError):
    """Text that is not YAML at all (a caller may fall back to the raw string, as ``--set``
    values do; a duplicate key or an alias bomb is a ``YamlError`` that is not this)."""


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that refuses duplicate keys and bounds the expanded size (see the module)."""

    where = "YAML"
    max_nodes = MAX_NODES

    def construct_document(self, node):
        _check_size(node, self.max_nodes, self.where)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self._refuse_duplicates(node)
        return super().construct_mapping(node, deep=deep)

    def _refuse_duplicates(self, node: yaml.MappingNode) -> None:
        seen: Dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": merged keys may be overridden
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                continue  # a complex key: safe_load refuses unhashable ones itself
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                raise YamlError(f"{self.where}: line {line}: key {key!r} is already set on line {seen[key]} of the "
                                f"same mapping; which value is meant is ambiguous: keep one")
            seen[key] = line


def _check_size(root, limit: int, where: str) -> None:
    """``YamlError`` when the node graph under ``root`` expands to more than ``limit`` values
    or refers to itself; memoised, so the cost is linear in the document, not its expansion."""
    sizes: Dict[int, int] = {}
    active = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            line = node.start_mark.line + 1
            raise YamlError(f"{where}: line {line}: an alias refers to a collection that contains it (a recursive "
                            f"alias); it would expand forever")
        total = 1
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            active.add(key)
            children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
            for child in children:
                total += size(child)
                if total > limit:
                    break
            active.discard(key)
        sizes[key] = total = min(total, limit + 1)
        return total

    if size(root) > limit:
        raise YamlError(f"{where}: the document expands to more than {limit:,} values (aliases of aliases: a "
                        f"\"billion laughs\" document?); a config is far smaller: write it out without the nesting")


def loads_yaml(text: str, where: str = "YAML", *, max_nodes: int = MAX_NODES) -> Any:
    """The one YAML document in ``text`` (``where`` names it in messages), checked as above."""
    loader = _Loader(text[1:] if text.startswith("\ufeff") else text)
    loader.where, loader.max_nodes = where, max_nodes
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(filter(None, (exc.context, exc.problem))) or str(exc).splitlines()[0]
        raise YamlSyntaxError(f"{where}: {at}not valid YAML ({problem})") from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise YamlError(f"{where}: nested too deeply to read (thousands of levels); a config is a few levels "
                        f"deep") from None
    finally:
        loader.dispose()


def load_yaml(path: str, *, max_nodes: int = MAX_NODES) -> Any:
    """The YAML document of the file ``path`` (UTF-8), checked as above; ``YamlError`` names the file."""
    return loads_yaml(read_utf8(path, YamlError), path, max_nodes=max_nodes)
