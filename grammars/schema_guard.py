"""Value checks for the JSON-Schema assertions the grammar does not hold (uniqueItems, not, if/then/else,
a oneOf enforced as anyOf...): each instance location the schema determines (properties, items,
allOf, $ref) learns which schema objects apply there, and those owning or hiding a checked keyword
validate the value the moment it completes (jsonschema's verdict, computed by schema_verdicts).
Promises: a check never refuses a value that the full schema allows at that location (every schema
object checked there applies to it), and a document accepted to its end is valid (the root, or the
locations below it, check every keyword)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from .schema_policy import compiles
from .schema_verdicts import NodeVerdicts
from .schema_walk import dict_at, list_at, reaching, resolve_pointer, subschemas, walk

_DEFINITIONS = ("/$defs/", "/definitions/")
_UNIQUE = {"uniqueItems": True}
_NO_VALUE = object()
_VERDICT_CLASSES: dict[type, type] = {}
# an array's items: the scalars' keys (_scalar_key), and the arrays' and objects' JSON texts
ArrayItems = tuple[frozenset[Any], tuple[bytes, ...]]


def _any_of(validator: Any, any_of: list[Any], instance: Any, schema: Any) -> Iterator[ValidationError]:
    for index, sub in enumerate(any_of):
        if next(validator.descend(instance, sub, schema_path=index), None) is None:
            return
    yield ValidationError(f"{instance!r} is not valid under any of the given schemas")


def _one_of(validator: Any, one_of: list[Any], instance: Any, schema: Any) -> Iterator[ValidationError]:
    branches = enumerate(one_of)
    for index, sub in branches:
        if next(validator.descend(instance, sub, schema_path=index), None) is None:
            break
    else:
        yield ValidationError(f"{instance!r} is not valid under any of the given schemas")
        return
    if any(validator.evolve(schema=each).is_valid(instance) for _, each in branches):
        yield ValidationError(f"{instance!r} is valid under more than one of the given schemas")


def verdict_validator(cls: type) -> type:
    """cls whose anyOf / oneOf stop reading a branch at its first error. jsonschema's own keywords
    collect every error of each failing branch, which only an error report reads; the verdict
    (is_valid) is the same, branch by branch, and it is all the value checks and EOS ask for."""
    fast = _VERDICT_CLASSES.get(cls)
    if fast is None:
        own = getattr(cls, "VALIDATORS", {})
        keywords = {k: f for k, f in (("anyOf", _any_of), ("oneOf", _one_of)) if k in own}
        fast = jsonschema.validators.extend(cls, keywords) if keywords else cls
        _VERDICT_CLASSES[cls] = fast
    return fast


class GuardPlan:
    """The schema objects of the full schema that need a value check, and the instance locations."""

    def __init__(self, full: Any, checked: dict[int, set[str]], validator: Any) -> None:
        """checked: id(schema object) -> the keywords only a check enforces there."""
        self.full = full
        self.validator = validator
        self.modern_items = "prefixItems" in getattr(validator, "VALIDATORS", {})
        self._verdicts: dict[tuple[int, bytes], bool] = {}
        walked = list(walk(full)) if isinstance(full, dict) else []
        self.nodes = [n for n, _ in walked]
        self.checked_at = checked
        self.root_only = any(
            isinstance(n.get(k), str) for n in self.nodes[1:] for k in ("$id", "id") if k in n
        ) or any(not compiles(p) for n in self.nodes for p in dict_at(n, "patternProperties"))
        followed = {id(n): self._followed(n) for n in self.nodes}
        hidden = self._reaching(self._applicable, set(checked))  # a checked keyword lies at or below
        hides = {
            id(n)
            for n in self.nodes
            if any(id(c) in hidden and not any(c is f for f in followed[id(n)]) for c in self._applicable(n))
        }
        self.needs_check = set(checked) | hides
        # arrays whose one checked keyword is uniqueItems: their items are compared as each one
        # completes (Location.check_unique), so the whole array needs no check when it closes
        self.unique_only = (
            set()
            if self.root_only
            else {
                id(n)
                for n in self.nodes
                if checked.get(id(n)) == {"uniqueItems"}
                and n.get("uniqueItems") is True
                and id(n) not in hides
            }
        )
        self._array_items: dict[tuple[bytes, ...], ArrayItems | None] = {}
        self._validated_memo: dict[int, set[int]] = {}
        # the last prefix asked for, by identity: every candidate token at one position passes the
        # same tuple, and hashing it is linear in the array's length
        self._last_items: tuple[tuple[bytes, ...], ArrayItems | None] | None = None
        self._live = self._reaching(lambda n: followed[id(n)], self.needs_check)
        roots = (full,) if isinstance(full, dict) else ()
        self.node_verdicts = NodeVerdicts(
            full, validator, walked, lambda seed: self._reaching(self._applicable, seed), not self.root_only
        )
        self.root = Location(self, self._expand(roots))

    def _reaching(self, edges: Any, seed: set[int]) -> set[int]:
        """ids of the objects from which `edges` lead (in any number of steps) to one in seed."""
        parents: dict[int, list[int]] = {}
        for n in self.nodes:
            for c in edges(n):
                parents.setdefault(id(c), []).append(id(n))
        return reaching(parents, seed)

    def _ref(self, node: dict[str, Any]) -> list[dict[str, Any]]:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = resolve_pointer(self.full, ref)
            return [target] if isinstance(target, dict) else []
        return []

    def _applicable(self, node: dict[str, Any]) -> list[dict[str, Any]]:
        """Every subschema that can apply to the node's instance or its parts (not definitions)."""
        subs = [s for s, p in subschemas(node, "") if isinstance(s, dict) and not p.startswith(_DEFINITIONS)]
        return subs + self._ref(node)

    def _followed(self, node: dict[str, Any]) -> list[dict[str, Any]]:
        """The subschemas a Location descends into: allOf, $ref, and the property and item edges."""
        if self.root_only:
            return []
        out = [m for m in list_at(node, "allOf") if isinstance(m, dict)] + self._ref(node)
        out += [s for s in dict_at(node, "properties").values() if isinstance(s, dict)]
        out += [s for s in dict_at(node, "patternProperties").values() if isinstance(s, dict)]
        for key in ("additionalProperties", "additionalItems"):
            if isinstance(node.get(key), dict) and (key != "additionalItems" or not self.modern_items):
                out.append(node[key])
        items = node.get("items")
        if isinstance(items, dict):
            out.append(items)
        elif isinstance(items, list) and not self.modern_items:
            out += [s for s in items if isinstance(s, dict)]
        if self.modern_items:
            out += [s for s in list_at(node, "prefixItems") if isinstance(s, dict)]
        return out

    def _expand(self, nodes: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
        """nodes with what applies beside them: allOf members and $ref targets, transitively."""
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        stack = list(reversed(nodes))
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            out.append(n)
            if not self.root_only:
                stack += [m for m in list_at(n, "allOf") if isinstance(m, dict)] + self._ref(n)
        return tuple(out)

    def child_nodes(self, nodes: tuple[dict[str, Any], ...], key: str | int) -> tuple[dict[str, Any], ...]:
        if self.root_only:
            return ()
        out: list[dict[str, Any]] = []
        for n in nodes:
            out += _object_child(n, key) if isinstance(key, str) else self._item_child(n, key)
        return self._expand(tuple(s for s in out if isinstance(s, dict)))

    def _item_child(self, node: dict[str, Any], index: int) -> list[Any]:
        prefix = list_at(node, "prefixItems") if self.modern_items else list_at(node, "items")
        if index < len(prefix):
            return [prefix[index]]
        rest = node.get("items") if self.modern_items else node.get("additionalItems")
        if not self.modern_items and isinstance(node.get("items"), dict):
            rest = node["items"]
        return [rest]

    def array_items(self, items: tuple[bytes, ...]) -> ArrayItems | None:
        """An array's items so far, split for duplicate checks; None if one is not JSON. Memoized
        per prefix: every candidate token at one position compares against the same items."""
        last = self._last_items
        if last is not None and last[0] is items:
            return last[1]
        if items in self._array_items:
            self._last_items = (items, self._array_items[items])
            return self._last_items[1]
        base: ArrayItems | None = (frozenset(), ())
        new = items
        if items[:-1] in self._array_items:
            base, new = self._array_items[items[:-1]], items[-1:]
        keys = [_scalar_key(text) for text in new]
        out = None
        if base is not None and not any(k is _NO_VALUE for k in keys):
            scalars = base[0] | {k for k in keys if k is not None}
            out = (scalars, base[1] + tuple(t for t, k in zip(new, keys) if k is None))
        if len(self._array_items) > 4096:
            self._array_items.clear()
        self._array_items[items] = out
        self._last_items = (items, out)
        return out

    def check_nodes(self, nodes: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
        """The objects among nodes that validate a value completing there: those needing a check,
        less any that another of them validates anyway (its allOf member or $ref target)."""
        wanted = [n for n in nodes if id(n) in self.needs_check and id(n) not in self.unique_only]
        kept: list[dict[str, Any]] = []
        covered: set[int] = set()
        for n in wanted:
            if id(n) not in covered:
                kept.append(n)
                covered |= self._validated_with(n)
        return [n for n in kept if not any(m is not n and id(n) in self._validated_with(m) for m in kept)]

    def _validated_with(self, node: dict[str, Any]) -> set[int]:
        """ids of the objects jsonschema applies to the same instance whenever it validates node: its
        $ref target (alone: drafts up to 7 ignore the siblings of $ref) or else its allOf members,
        transitively. An under-estimate is safe: it only keeps a redundant check."""
        memo = self._validated_memo.get(id(node))
        if memo is None:
            memo = self._validated_memo[id(node)] = set()
            stack = [node]
            while stack:
                n = stack.pop()
                nxt = self._ref(n) if "$ref" in n else [m for m in list_at(n, "allOf") if isinstance(m, dict)]
                for m in nxt:
                    if id(m) not in memo:
                        memo.add(id(m))
                        stack.append(m)
        return memo

    def is_live(self, nodes: tuple[dict[str, Any], ...]) -> bool:
        return any(id(n) in self._live for n in nodes)

    def valid(self, node: Any, text: bytes) -> bool:
        """jsonschema's verdict on the value (JSON text) against one schema object of the full schema."""
        key = (id(node), text)
        verdict = self._verdicts.get(key)
        if verdict is None:
            value = _json_value(text)
            verdict = value is not _NO_VALUE and self.node_verdicts.is_valid(node, text, value)
            if len(self._verdicts) > 4096:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict


# a JSON string with nothing to unescape: its text between the quotes is its value
_PLAIN_STRING = re.compile(rb'"[^"\\\x00-\x1f]*"\Z')


def _json_value(text: bytes) -> Any:
    """The value of a JSON text, _NO_VALUE for text that is not JSON (a number cut off by the end of
    the document). A string with nothing to unescape is decoded as json.loads decodes (surrogates
    pass) without the parser."""
    if _PLAIN_STRING.match(text):
        try:
            return text[1:-1].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return _NO_VALUE
    try:
        return json.loads(text)
    except ValueError:
        return _NO_VALUE


@functools.lru_cache(maxsize=8192)  # every candidate token at a position completes the same item
def _scalar_key(text: bytes) -> Any:
    """A hashable key equal for two JSON scalars exactly when JSON Schema calls them equal (1 and
    1.0 are, true and 1 are not); None for an array or object, _NO_VALUE for text that is not JSON."""
    value = _json_value(text)
    if value is _NO_VALUE:
        return _NO_VALUE
    if isinstance(value, (list, dict)):
        return None
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    return ("string", value) if isinstance(value, str) else ("number", value)


def _object_child(node: dict[str, Any], key: str) -> list[Any]:
    props = dict_at(node, "properties")
    out = [props[key]] if key in props else []
    matched = [s for p, s in dict_at(node, "patternProperties").items() if re.search(p, key)]
    if key not in props and not matched:
        out.append(node.get("additionalProperties"))
    return out + matched


class Location:
    """The schema objects applying at one instance location; children are computed once per key."""

    __slots__ = (
        "plan",
        "nodes",
        "check_nodes",
        "name_schemas",
        "checked",
        "checks_keys",
        "live",
        "unique_items",
        "_kids",
    )

    def __init__(self, plan: GuardPlan, nodes: tuple[dict[str, Any], ...]) -> None:
        self.plan = plan
        self.nodes = nodes
        self.check_nodes = plan.check_nodes(nodes)
        self.name_schemas = [
            n["propertyNames"]
            for n in nodes
            if "propertyNames" in n and "propertyNames" in plan.checked_at.get(id(n), ())
        ]
        self.checked = bool(self.check_nodes)
        self.checks_keys = bool(self.name_schemas)
        self.live = plan.is_live(nodes)
        self.unique_items = any(
            n.get("uniqueItems") is True and "uniqueItems" in plan.checked_at.get(id(n), ()) for n in nodes
        )
        self._kids: dict[str | int, Location] = {}

    def child(self, key: str | int) -> Location:
        kid = self._kids.get(key)
        if kid is None:
            nodes = self.plan.child_nodes(self.nodes, key) if self.live else ()
            kid = Location(self.plan, nodes)
            if len(self._kids) < 1024:
                self._kids[key] = kid
        return kid

    def check_value(self, text: bytes) -> bool:
        return all(self.plan.valid(n, text) for n in self.check_nodes)

    def check_unique(self, earlier: tuple[bytes, ...], last: bytes) -> bool:
        """The items so far (JSON texts: earlier, then last) hold no duplicate, by JSON Schema's
        equality (1 == 1.0). The earlier items passed this check when they completed, so last is
        compared only with them: a scalar by its key, an array or object by jsonschema among the others."""
        if not earlier:
            return True
        key = _scalar_key(last)
        prior = self.plan.array_items(earlier) if key is not _NO_VALUE else None
        if prior is None:  # an item that is not JSON (a number cut off by the end of the document)
            return False
        if key is not None:
            return key not in prior[0]
        return not prior[1] or self.plan.valid(_UNIQUE, b"[" + b",".join((*prior[1], last)) + b"]")

    def check_key(self, text: bytes) -> bool:
        """Whether an object key (its JSON text) passes every propertyNames checked here."""
        return all(self.plan.valid(s, text) for s in self.name_schemas)
