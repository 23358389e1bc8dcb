"""The YAML loader for recipes and ``key=value`` overrides: PyYAML's SafeLoader with bounds.

- A duplicate key is an error (PyYAML silently keeps the last one).
- Nesting deeper than :data:`MAX_DEPTH` is an error, raised while composing, before PyYAML's
  recursive composer and constructor could run out of stack (50,000 ``[`` were a RecursionError).
- A document whose tree, with every alias expanded, has more than :data:`MAX_NODES` nodes is an
  error, raised before anything is constructed. Aliases are legitimate YAML (a shared
  ``&defaults`` block), but nested ones multiply: nine levels of ten aliases (a "billion laughs")
  parse into a small object graph that anything walking it as a tree (validation, ``repr``)
  expands to 10^9 values. The count is memoised per node, so it costs one pass over the document.

Errors are PyYAML ``MarkedYAMLError``s with the position, which :func:`load_recipe` turns into its
``FILE:LINE:COL: invalid YAML: ...`` line.
"""

from __future__ import annotations

import yaml

YamlValue = object  # what a YAML document parses to (dicts, lists, strings, numbers, booleans, None, and
# the dates, bytes and sets of YAML 1.1): a reader narrows it with isinstance

MAX_DEPTH = 100  # nested mappings / sequences; a recipe uses 3
MAX_NODES = 100_000  # scalars, mappings and sequences with aliases expanded; a recipe has a few hundred


class RecipeYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, deep nesting and alias expansion past the bounds."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int | yaml.Node | None) -> yaml.Node | None:
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: yaml.Node) -> YamlValue:
        try:
            expanded_size(node, {})
        except _TooBig as e:
            raise yaml.constructor.ConstructorError(None, None, str(e), node.start_mark) from None
        return super().construct_document(node)


class _TooBig(Exception):
    pass


def expanded_size(node: yaml.Node, memo: dict[int, tuple[int, int]], level: int = 1) -> tuple[int, int]:
    """(nodes, levels) of the tree under ``node`` with every alias expanded into a copy of its
    anchor's tree, memoised by node identity (a chain of aliases costs one visit per distinct
    node). Raises ``_TooBig`` past :data:`MAX_NODES` nodes or :data:`MAX_DEPTH` levels (aliases
    nest too: an alias at level 90 of an anchor 90 levels deep), or for a recursive alias."""
    if level > MAX_DEPTH:
        raise _TooBig(f"nested deeper than {MAX_DEPTH} levels once aliases are expanded")
    key = id(node)
    if key in memo:
        size, height = memo[key]
        if size < 0:
            raise _TooBig("a recursive alias (a node that contains itself)")
        if level + height - 1 > MAX_DEPTH:
            raise _TooBig(f"nested deeper than {MAX_DEPTH} levels once aliases are expanded")
        return size, height
    memo[key] = (-1, 0)  # in progress
    if isinstance(node, yaml.SequenceNode):
        children: list[yaml.Node] = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    size, height = 1, 1
    for child in children:
        child_size, child_height = expanded_size(child, memo, level + 1)
        size += child_size
        height = max(height, child_height + 1)
        if size > MAX_NODES:
            raise _TooBig(f"the document expands to more than {MAX_NODES} values (nested aliases?)")
    memo[key] = (size, height)
    return size, height


def _construct_mapping(loader: RecipeYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


RecipeYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str) -> YamlValue:
    """``text`` parsed with :class:`RecipeYamlLoader` (raises ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=RecipeYamlLoader)  # noqa: S506 - a SafeLoader


__all__ = ["MAX_DEPTH", "MAX_NODES", "RecipeYamlLoader", "YamlValue", "expanded_size", "load_yaml"]
