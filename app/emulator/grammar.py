"""Text a ``regex`` or an ``ebnf`` grammar accepts: the answer of a grammar-constrained request.

Regular expressions are read with the standard library's own parser (``re._parser``, the one
module here that touches it; Python 3.11-3.13 keep its shape) and walked: a branch and a
repetition count are drawn from the caller's ``random``, character classes give their first
allowed characters, back-references repeat their group. EBNF is the GBNF dialect SGLang's
xgrammar backend takes: ``name ::= ...`` rules from ``root``, ``"literals"``, ``[classes]``,
``( )``, ``|``, ``* + ?`` and ``{m,n}``; past a nesting depth the shortest alternatives are taken,
so recursive grammars end. A pattern this cannot read is a ``GrammarError`` (400).

Expansion is bounded: every pattern node visited and every character produced spends one unit
of a ``Budget`` (``MAX_EXPANSION``), and a pattern that needs more is a ``GrammarError`` too. So
``((a{200}){200}){200}`` (8 million characters), ``a{4000000000}`` or a nest of empty
repetitions is refused at once instead of stalling the worker's event loop or exhausting its
memory; what a client may constrain an answer to stays far above what ``max_tokens`` lets it
generate.
"""

from __future__ import annotations

import importlib
import random
import re
import string
from typing import Any

# The standard library's regex parser and its opcodes (no type stubs; typed as Any here).
sre_parse: Any = importlib.import_module("re._parser")
sre: Any = importlib.import_module("re._constants")

_POOL = string.ascii_lowercase + string.digits + " "
_CATEGORY = {
    sre.CATEGORY_DIGIT: string.digits,
    sre.CATEGORY_NOT_DIGIT: string.ascii_lowercase,
    sre.CATEGORY_SPACE: " ",
    sre.CATEGORY_NOT_SPACE: string.ascii_lowercase,
    sre.CATEGORY_WORD: string.ascii_lowercase,
    sre.CATEGORY_NOT_WORD: " ",
}
_MAX_DEPTH = 24
# Units of work one constrained answer may take (a pattern node visited or a character produced
# costs one): some tens of milliseconds of the worker's event loop at most.
MAX_EXPANSION = 100_000


class GrammarError(ValueError):
    pass


class Budget:
    """The work left for one expansion; ``spend`` past it raises ``GrammarError``."""

    __slots__ = ("classes", "kind", "left")

    def __init__(self, kind: str, units: int = MAX_EXPANSION) -> None:
        self.kind = kind
        self.left = units
        # A regex class node's characters, and whether it has just one fixed one (``_in``).
        self.classes: dict[int, tuple[bool, str]] = {}

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise GrammarError(
                f"Failed to compile {self.kind} grammar: it expands past {MAX_EXPANSION} "
                "characters (or steps)"
            )


def regex_text(pattern: str, rng: random.Random, budget: Budget | None = None) -> str:
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise GrammarError(f"Invalid regex: {exc}") from None
    except OverflowError:
        raise GrammarError("Invalid regex: a repetition count is too large") from None
    groups: dict[int, str] = {}
    return _walk(list(parsed), rng, groups, budget or Budget("regex"))


def _walk(items: list[Any], rng: random.Random, groups: dict[int, str], budget: Budget) -> str:
    out: list[str] = []
    for op, av in items:
        budget.spend(1)
        if op is sre.LITERAL:
            out.append(chr(av))
        elif op is sre.NOT_LITERAL:
            out.append("a" if av != ord("a") else "b")
        elif op is sre.ANY:
            out.append(rng.choice(string.ascii_lowercase))
        elif op is sre.IN:
            out.append(_in(av, rng, budget))
        elif op is sre.BRANCH:
            out.append(_walk(list(rng.choice(av[1])), rng, groups, budget))
        elif op is sre.SUBPATTERN:
            text = _walk(list(av[-1]), rng, groups, budget)
            if av[0] is not None:
                groups[av[0]] = text
            out.append(text)
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            low, high, sub = av
            count = low + rng.randint(0, 2) if low < 3 else low
            count = min(count, high)
            sub = list(sub)
            for _ in range(count):
                budget.spend(1)  # an empty repetition costs its count too
                out.append(_walk(sub, rng, groups, budget))
        elif op is sre.GROUPREF:
            text = groups.get(av, "")
            budget.spend(len(text))
            out.append(text)
        elif op is sre.CATEGORY:
            out.append(rng.choice(_CATEGORY.get(av, "a")))
        elif op is sre.ATOMIC_GROUP:
            out.append(_walk(list(av), rng, groups, budget))
        # AT (anchors) and look-around assertions produce no text
    return "".join(out)


def _in(items: list[Any], rng: random.Random, budget: Budget) -> str:
    """One character of a class: one of its first allowed ones (a fixed one if negated). The
    choices are worked out once per class node and expansion."""
    key = id(items)
    known = budget.classes.get(key)
    if known is None:
        negate = any(op is sre.NEGATE for op, _ in items)
        allowed: list[str] = []
        for op, av in items:
            if op is sre.LITERAL:
                allowed.append(chr(av))
            elif op is sre.RANGE:
                allowed.extend(chr(c) for c in range(av[0], min(av[1], av[0] + 25) + 1))
            elif op is sre.CATEGORY:
                allowed.extend(_CATEGORY.get(av, "a"))
        budget.spend(len(items) + len(allowed))
        if negate:
            known = (True, next((c for c in _POOL if c not in allowed), "~"))
        else:
            known = (not allowed, "".join(allowed) or "a")
        budget.classes[key] = known
    fixed, choices = known
    return choices if fixed else rng.choice(choices)


_TOKEN = re.compile(
    r"\s+|#[^\n]*|(?P<rule>[A-Za-z_][\w-]*\s*::=)|(?P<name>[A-Za-z_][\w-]*)"
    r'|(?P<str>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])'
    r"|(?P<rep>\{\s*\d+\s*(?:,\s*\d*\s*)?\})|(?P<op>[()|*+?])"
)


def ebnf_text(grammar: str, rng: random.Random, budget: Budget | None = None) -> str:
    rules: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pos = 0
    while pos < len(grammar):
        match = _TOKEN.match(grammar, pos)
        if match is None:
            raise GrammarError(f"Invalid EBNF grammar near {grammar[pos : pos + 20]!r}")
        pos = match.end()
        kind = match.lastgroup
        if kind is None:
            continue
        if kind == "rule":
            current = rules.setdefault(match.group()[:-3].strip(), [])
        elif current is None:
            raise GrammarError("An EBNF grammar starts with a rule: name ::= ...")
        else:
            current.append((kind, match.group()))
    if "root" not in rules:
        raise GrammarError("The EBNF grammar has no root rule.")
    return _Expander(rules, rng, budget or Budget("ebnf")).rule("root", 0)


class _Expander:
    def __init__(
        self, rules: dict[str, list[tuple[str, str]]], rng: random.Random, budget: Budget
    ) -> None:
        self._rules = rules
        self._rng = rng
        self._budget = budget

    def rule(self, name: str, depth: int) -> str:
        tokens = self._rules.get(name)
        if tokens is None:
            raise GrammarError(f"The EBNF grammar uses an undefined rule: {name}")
        text, _ = self._alternatives(tokens, 0, depth)
        return text

    def _alternatives(self, tokens: list[tuple[str, str]], at: int, depth: int) -> tuple[str, int]:
        branches: list[list[tuple[str, str]]] = [[]]
        level = 0
        start = at
        while at < len(tokens):
            kind, value = tokens[at]
            if kind == "op" and value == ")" and level == 0:
                break
            if kind == "op" and value == "|" and level == 0:
                branches.append([])
            else:
                level += (value == "(") - (value == ")") if kind == "op" else 0
                branches[-1].append((kind, value))
            at += 1
        self._budget.spend(at - start + 1)
        if depth > _MAX_DEPTH:
            branch = min(branches, key=lambda b: sum(k == "name" for k, _ in b))
        else:
            branch = self._rng.choice(branches)
        return self._sequence(branch, depth), at

    def _sequence(self, tokens: list[tuple[str, str]], depth: int) -> str:
        out: list[str] = []
        at = 0
        while at < len(tokens):
            kind, value = tokens[at]
            group = kind == "op" and value == "("
            start = at
            at = self._alternatives(tokens, at + 1, depth + 1)[1] + 1 if group else at + 1
            low, high = 1, 1
            if at < len(tokens) and (tokens[at][0] == "rep" or tokens[at][1] in ("*", "+", "?")):
                low, high = _bounds(tokens[at][1])
                at += 1
            count = low if depth > _MAX_DEPTH else min(high, low + self._rng.randint(0, 2))
            for _ in range(count):
                self._budget.spend(1)
                if group:
                    out.append(self._alternatives(tokens, start + 1, depth + 1)[0])
                else:
                    out.append(self._atom(kind, value, depth))
        return "".join(out)

    def _atom(self, kind: str, value: str, depth: int) -> str:
        if kind == "str":
            self._budget.spend(len(value))
            return str(_unescape(value[1:-1]))
        if kind == "cls":
            return regex_text(value, self._rng, self._budget)
        if kind == "name":
            return self.rule(value, depth + 1)
        raise GrammarError(f"Unexpected {value!r} in the EBNF grammar")


def _bounds(op: str) -> tuple[int, int]:
    if op == "*":
        return 0, 3
    if op == "+":
        return 1, 3
    if op == "?":
        return 0, 1
    low, _, high = op.strip("{} ").partition(",")
    if not _:
        return int(low), int(low)
    return int(low), int(high) if high.strip() else int(low) + 2


def _unescape(text: str) -> str:
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
