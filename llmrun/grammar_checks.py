"""Checks of a constraint that xgrammar does not make: rules that never end, schema keywords it ignores.

**Rules that never end.** A rule such as `root ::= "a" root` matches no string of finite length. xgrammar
compiles it, and its masks let a reply into it, after which the reply can only run on to the token limit; worse,
its jump-forward search (`find_jump_forward_string`) follows the one forced continuation without a bound,
building the endless string until memory runs out. So llmrun refuses such a grammar before the reply starts.

The check reads the grammar as xgrammar prints it after normalization (`str(grammar)`: one `name ::= body` line
a rule, bodies of quoted strings, character classes, rule names, `( | )` groups, `*`/`+`/`?`/`{m, n}`
repetition, `(=...)` lookahead assertions and opaque calls such as `Regex("...")`), and computes, as for any
context-free grammar, which rules derive some finite string: a sequence does when all its items do, a choice
when one of its alternatives does, a terminal or anything optional always does. Lookahead assertions and opaque
calls are taken to pass (they restrict, and never loop). A rule that derives nothing finite yet is reachable
from the root is the one named.

**Ignored keywords.** xgrammar (0.2) compiles some JSON Schema keywords to nothing, without a word: `not`,
`contains`, `uniqueItems`, `if`/`then`/`else`, `dependentRequired`... and a `required` name that `properties`
does not define (it writes only the properties a schema lists). `schema_warnings` names them, for the user.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r'''
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<define>::=)
  | (?P<repeat>\{\s*\d+\s*(?:,\s*-?\d*\s*)?\})
  | (?P<name>[A-Za-z_][\w.\-]*)
  | (?P<number>-?\d+(?:\.\d+)?)
  | (?P<punct>[()|*+?=,:])
''', re.VERBOSE)


class _Graph:
    """An and-or graph: node i is ("and", children) (derives when all children do), ("or", children) (when one
    does), or ("ref", name) (when the rule `name` does)."""

    def __init__(self):
        self.nodes: list[tuple[str, object]] = []

    def add(self, kind: str, payload) -> int:
        self.nodes.append((kind, payload))
        return len(self.nodes) - 1


class _Parser:
    def __init__(self, text: str):
        self.tokens: list[tuple[str, str, int, int]] = []  # (kind, text, start, end)
        at = 0
        while at < len(text):
            m = _TOKEN.match(text, at)
            if m is None:
                raise ValueError(f"unexpected {text[at]!r} at {at}")
            if m.lastgroup != "space":
                self.tokens.append((m.lastgroup, m.group(), m.start(), m.end()))
            at = m.end()
        self.at = 0
        self.graph = _Graph()
        self.empty = self.graph.add("and", [])  # derives the empty string: terminals, options, assertions
        self.rules: dict[str, int] = {}  # rule name -> its body's node

    def peek(self, ahead: int = 0) -> tuple[str, str, int, int] | None:
        i = self.at + ahead
        return self.tokens[i] if i < len(self.tokens) else None

    def take(self, text: str | None = None) -> tuple[str, str, int, int]:
        token = self.peek()
        if token is None or (text is not None and token[1] != text):
            raise ValueError(f"expected {text or 'more'}, found {token and token[1]!r}")
        self.at += 1
        return token

    def at_rule_start(self) -> bool:
        first, second = self.peek(), self.peek(1)
        return first is not None and first[0] == "name" and second is not None and second[0] == "define"

    def parse(self) -> tuple[_Graph, dict[str, int], list[str]]:
        order = []
        while self.peek() is not None:
            name = self.take()[1]
            self.take("::=")
            if name in self.rules:
                raise ValueError(f"rule {name} defined twice")
            self.rules[name] = self.choice()
            order.append(name)
        return self.graph, self.rules, order

    def choice(self) -> int:
        options = [self.sequence()]
        while self.peek() is not None and self.peek()[1] == "|":
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else self.graph.add("or", options)

    def sequence(self) -> int:
        items = []
        while (token := self.peek()) is not None and token[1] not in (")", "|") and not self.at_rule_start():
            items.append(self.item())
        return items[0] if len(items) == 1 else self.graph.add("and", items)

    def item(self) -> int:
        node = self.atom()
        while (token := self.peek()) is not None and (token[1] in ("*", "+", "?") or token[0] == "repeat"):
            self.take()
            least, most = int(token[1] == "+"), -1  # -1: no bound
            if token[0] == "repeat":  # {m}, {m,}, {m, n}
                bounds = token[1].strip("{} ").split(",")
                least = int(bounds[0])
                most = least if len(bounds) == 1 else int(bounds[1]) if bounds[1].strip() else -1
            if most == 0:  # never there: it reaches nothing
                node = self.empty
            elif least == 0:  # may be absent: derives the empty string; still reaches what it names
                node = self.graph.add("or", [node, self.empty])
        return node

    def atom(self) -> int:
        kind, text, _, end = self.take()
        if kind in ("string", "cls"):
            return self.empty
        if text == "(":
            if self.peek() is not None and self.peek()[1] == "=":  # a lookahead assertion: never loops
                self.take()
                self.choice()
                self.take(")")
                return self.empty
            node = self.choice()
            self.take(")")
            return node
        if kind == "name":
            after = self.peek()
            if after is not None and after[1] == "(" and after[2] == end:  # Regex("..."), TagDispatch(...)
                self.skip_call()
                return self.empty
            return self.graph.add("ref", text)
        raise ValueError(f"unexpected {text!r}")

    def skip_call(self) -> None:
        depth = 0
        while True:
            text = self.take()[1]
            depth += (text == "(") - (text == ")")
            if depth == 0:
                return


def endless_rule(ebnf: str, root: str = "root") -> str | None:
    """The first rule, in breadth-first order from `root`, that derives no string of finite length, or None.
    `ebnf`: a grammar as xgrammar prints it. Raises ValueError where the text is not in the form expected."""
    graph, rules, order = _Parser(ebnf).parse()
    if root not in rules:
        if not order:
            raise ValueError("no rules")
        root = order[0]
    nodes = graph.nodes
    parents: list[list[int]] = [[] for _ in nodes]
    waiting = [0] * len(nodes)  # "and" nodes: children not yet known to derive a finite string
    for i, (kind, payload) in enumerate(nodes):
        if kind == "ref":
            if payload not in rules:
                raise ValueError(f"rule {payload} is not defined")
            children = [rules[payload]]
        else:
            children = payload
        for child in children:
            parents[child].append(i)
        waiting[i] = len(children) if kind == "and" else 1
    finite = [False] * len(nodes)
    todo = [i for i, (kind, payload) in enumerate(nodes) if kind == "and" and not payload]
    for i in todo:
        finite[i] = True
    while todo:
        node = todo.pop()
        for parent in parents[node]:
            if not finite[parent]:
                waiting[parent] -= 1
                if waiting[parent] == 0 or nodes[parent][0] != "and":
                    finite[parent] = True
                    todo.append(parent)
    seen, queue = {root}, [root]
    for name in queue:  # breadth first over the rules, walking each body's nodes
        if not finite[rules[name]]:
            return name
        stack = [rules[name]]
        while stack:
            kind, payload = nodes[stack.pop()]
            if kind == "ref":
                if payload not in seen:
                    seen.add(payload)
                    queue.append(payload)
            else:
                stack.extend(payload)
    return None


_IGNORED = ("not", "contains", "minContains", "maxContains", "uniqueItems", "if", "then", "else",
            "dependentRequired", "dependentSchemas", "dependencies")
# Where a schema holds schemas (those under an ignored keyword are not walked: all of it is ignored).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMAS = ("items", "additionalItems", "unevaluatedItems", "additionalProperties", "unevaluatedProperties",
            "propertyNames")
_SCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")


def schema_warnings(schema) -> list[str]:
    """What in `schema` (parsed JSON) xgrammar ignores, one phrase each, in the order first met."""
    said: dict[str, None] = {}
    todo = [schema]
    while todo:  # (a walk of the schema positions only: a property called "not" is a name, not a keyword)
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        for key in _IGNORED:
            if key in node and not (key in ("then", "else") and "if" in node):
                said[f"keyword {key!r}"] = None
        required, properties = node.get("required"), node.get("properties")
        if isinstance(required, list):
            named = properties if isinstance(properties, dict) else {}
            patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
            for name in required:
                if isinstance(name, str) and name not in named and not _matches_any(name, patterns):
                    said[f"'required' names {name!r}, which 'properties' does not define: only the properties a"
                         " schema lists are written"] = None
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                todo.extend(node[key].values())
        todo.extend(node[key] for key in _SCHEMAS if isinstance(node.get(key), dict))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                todo.extend(node[key])
    return list(said)


def _matches_any(name: str, patterns: dict) -> bool:
    for pattern in patterns:
        try:
            if re.search(pattern, name):
                return True
        except re.error:  # a pattern Python's dialect does not read: give it the benefit of the doubt
            return True
    return False
