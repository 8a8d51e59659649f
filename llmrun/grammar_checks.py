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

**Long forced runs.** When a constraint leaves one continuation, jump-forward asks xgrammar for the text it forces
(`find_jump_forward_string`), which builds that whole text every step: `((a{1000}){1000}){1000}` forced 10^9
characters, taking memory at ~200 MB/s inside one C call that no signal interrupts. `forced_bound` bounds the
longest run any state can force, from the printout: a literal its length, a sequence the sum, a choice the
largest, a repetition of at least m its body m times (plus one iteration if more may follow: past the least
count each iteration is a choice), a rule within itself nothing more (a recursion passes a choice each level),
an opaque `Regex(...)` by its pattern's counts. Past JUMP_FORWARD_MAX jump-forward is off for that constraint.

**Repetition counts.** xgrammar reads a count past 2^31 - 1 into a 32-bit integer: `a{4294967298}` became
`a{2}`, enforced without a word. `check_counts` refuses such a count in a regex, a grammar or a schema's patterns.

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
        if hasattr(self, "order"):  # (parsed already: `read_rules`)
            return self.graph, self.rules, self.order
        order = self.order = []
        self.lengths: dict[str, tuple] = {}  # rule name -> its body's longest forced run, as an expression
        while self.peek() is not None:
            name = self.take()[1]
            self.take("::=")
            if name in self.rules:
                raise ValueError(f"rule {name} defined twice")
            self.rules[name], self.lengths[name] = self.choice()
            order.append(name)
        return self.graph, self.rules, order

    # Each method below returns (the and-or graph's node, the longest forced run's expression: ("n", count),
    # ("sum", items), ("max", options), ("times", factor, expression) or ("ref", rule name)).

    def choice(self) -> tuple[int, tuple]:
        options = [self.sequence()]
        while self.peek() is not None and self.peek()[1] == "|":
            self.take()
            options.append(self.sequence())
        if len(options) == 1:
            return options[0]
        return self.graph.add("or", [node for node, _ in options]), ("max", [length for _, length in options])

    def sequence(self) -> tuple[int, tuple]:
        items = []
        while (token := self.peek()) is not None and token[1] not in (")", "|") and not self.at_rule_start():
            items.append(self.item())
        if len(items) == 1:
            return items[0]
        return self.graph.add("and", [node for node, _ in items]), ("sum", [length for _, length in items])

    def item(self) -> tuple[int, tuple]:
        node, length = self.atom()
        while (token := self.peek()) is not None and (token[1] in ("*", "+", "?") or token[0] == "repeat"):
            self.take()
            least, most = int(token[1] == "+"), -1  # -1: no bound
            if token[0] == "repeat":  # {m}, {m,}, {m, n}
                bounds = token[1].strip("{} ").split(",")
                least = int(bounds[0])
                most = least if len(bounds) == 1 else int(bounds[1]) if bounds[1].strip() else -1
            if token[1] == "?":
                most = 1
            length = ("times", least + (most != least), length)
            if most == 0:  # never there: it reaches nothing
                node = self.empty
            elif least == 0:  # may be absent: derives the empty string; still reaches what it names
                node = self.graph.add("or", [node, self.empty])
        return node, length

    def atom(self) -> tuple[int, tuple]:
        kind, text, _, end = self.take()
        if kind in ("string", "cls"):
            return self.empty, ("n", len(text) - 2 if kind == "string" else 1)
        if text == "(":
            if self.peek() is not None and self.peek()[1] == "=":  # a lookahead assertion: never loops
                self.take()
                self.choice()
                self.take(")")
                return self.empty, ("n", 0)
            node = self.choice()
            self.take(")")
            return node
        if kind == "name":
            after = self.peek()
            if after is not None and after[1] == "(" and after[2] == end:  # Regex("..."), TagDispatch(...)
                pattern = self.skip_call()
                return self.empty, ("n", _regex_bound(pattern) if text == "Regex" else 0)
            return self.graph.add("ref", text), ("ref", text)
        raise ValueError(f"unexpected {text!r}")

    def skip_call(self) -> str:
        """Past a call's parentheses -> its first string argument ("" if none), as written (quotes dropped)."""
        depth, first = 0, None
        while True:
            kind, text, _, _ = self.take()
            if kind == "string" and first is None:
                first = text[1:-1]
            depth += (text == "(") - (text == ")")
            if depth == 0:
                return first or ""


JUMP_FORWARD_MAX = 1 << 16  # the longest forced run (characters) jump-forward may meet: ~10 ms of xgrammar's search
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # a repetition count, {m}, {m,} or {m,n}
_BIG = 10 ** 12  # (bounds are capped here: past it, only "too long" matters)


def _regex_bound(pattern: str) -> int:
    """A bound on what a regex can force in a row: its length times each count's (m, or m + 1 when more may
    follow), all multiplied (nested or not: a bound, not the figure)."""
    bound = max(len(pattern), 1)
    for m in _COUNT.finditer(pattern):
        least = int(m.group(1)[:13])
        more = m.group(2) is not None and m.group(2) != m.group(1)  # {m,} or {m,n}: iterations past m may follow
        bound = min(bound * (least + more), _BIG)
    return bound


def read_rules(ebnf: str) -> _Parser:
    """xgrammar's printout of a grammar, parsed once for `endless_rule` and `forced_bound` (either also takes the
    text). Raises ValueError where the text is not in the form expected."""
    parser = _Parser(ebnf)
    parser.parse()
    return parser


def forced_bound(ebnf: str | _Parser, root: str = "root") -> int:
    """An upper bound on the characters any state of the grammar (as xgrammar prints it) can force in a row: the
    module's docstring. Raises ValueError where the text is not in the form expected."""
    parser = ebnf if isinstance(ebnf, _Parser) else read_rules(ebnf)
    _, rules, order = parser.parse()
    lengths, known, open_ = parser.lengths, {}, set()

    class Needs(Exception):  # a rule whose bound is not known yet: computed first, then the one asking again
        pass

    def size(expr) -> int:
        kind = expr[0]
        if kind == "n":
            return expr[1]
        if kind == "sum":
            return min(sum(size(e) for e in expr[1]), _BIG)
        if kind == "max":
            return max(size(e) for e in expr[1])
        if kind == "times":
            return min(expr[1] * size(expr[2]), _BIG) if expr[1] else 0
        name = expr[1]
        if name not in lengths:
            raise ValueError(f"rule {name} is not defined")
        if name in known:
            return known[name]
        if name in open_:  # within itself: each level of a recursion passes a choice
            return 0
        raise Needs(name)

    if not order:
        return 0
    # Depth first from the root, as a recursion would go but on a list: a chain of thousands of rules (a large
    # schema's) would pass Python's recursion limit.
    path = [root if root in rules else order[0]]
    while path:
        name = path[-1]
        if name not in lengths:
            raise ValueError(f"rule {name} is not defined")
        open_.add(name)
        try:
            known[name] = size(lengths[name])
        except Needs as needs:
            path.append(needs.args[0])
            continue
        open_.discard(name)
        path.pop()
    return known[root if root in rules else order[0]]


def check_counts(text: str, kind: str) -> None:
    """Refuse (ValueError) a repetition count past 2^31 - 1 in a regex or a grammar (xgrammar wraps it to 32 bits);
    counts inside a grammar's strings or either's character classes are text, not counts."""
    at, in_class, in_string = 0, False, False
    while at < len(text):
        ch = text[at]
        if ch == "\\":
            at += 2
            continue
        if in_string:
            in_string = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == '"' and kind == "ebnf":
            in_string = True
        elif ch == "{" and (m := _COUNT.match(text, at)):
            for count in m.groups():
                if count and (len(count) > 10 or int(count) > 2 ** 31 - 1):
                    raise ValueError(f"repetition count {count[:24]}{'...' if len(count) > 24 else ''} is too large "
                                     f"(at most {2 ** 31 - 1:,})")
        at += 1


_SCHEMA_DATA = frozenset(("const", "default", "enum", "examples"))  # keywords whose values are data, not schemas
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"))  # keywords whose values map names to schemas


def schema_patterns(schema) -> list[str]:
    """The regexes in a schema (parsed JSON): `pattern` values and `patternProperties` names, at any depth, but
    not inside data (`const`, `default`, `enum`, `examples`: a "pattern" there is a value, not a regex; a property
    named "default" is still a schema)."""
    found, todo = [], [(schema, False)]  # (node, whether it maps names to schemas)
    while todo:
        node, names = todo.pop()
        if isinstance(node, list):
            todo.extend((item, False) for item in node)
        elif isinstance(node, dict) and names:
            todo.extend((value, False) for value in node.values())
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(node["patternProperties"])
            todo.extend((value, key in _SCHEMA_MAPS) for key, value in node.items() if key not in _SCHEMA_DATA)
    return found


def endless_rule(ebnf: str | _Parser, root: str = "root") -> str | None:
    """The first rule, in breadth-first order from `root`, that derives no string of finite length, or None.
    `ebnf`: a grammar as xgrammar prints it (or `read_rules`' of it). Raises ValueError where the text is not in the
    form expected."""
    graph, rules, order = (ebnf if isinstance(ebnf, _Parser) else read_rules(ebnf)).parse()
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
