"""What each config key means, for `--config=NAME --help`: read from the comments written
beside the code that sets the key, so an explanation lives in one place and a new key
gets its help by being commented as every key here is.

    explanations = config_help.explain(config, module, model_class)  # {key: text}

A key's text is joined from its sources, the general first:
  - config.base_config: the groups every experiment has (optim, train, mesh, eval);
  - the shared data-key tables in config.py (TEXT_FILE_KEYS, IMAGE_KEYS), one entry a
    line;
  - the fields of the task's model dataclass (model.KEY; tasks.register(..., model=));
  - the experiment's own module, and the config whose get_config() it starts from for
    the keys it does not set itself (what this experiment sets, and often why).
A statement's comment is the one at the end of its line(s); else the comment lines just
above it. An experiment's comment is shown only where it holds whatever the config's
arguments: not for a key set inside a branch (`if args.model == ...`) unless every
assignment says the same. The experiment's text follows the general one after "This
config: ". The sources are read (inspect.getsource, ast), not run.
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from types import ModuleType

from attention_jax import config as config_lib

# The tables in config.py whose entries are data keys (data.KEY), each entry commented. A
# config has a table's keys when it has the first (files, root); some names are in both.
DATA_KEY_TABLES = ("TEXT_FILE_KEYS", "IMAGE_KEYS")


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """(comments ending a line of code, comments on a line of their own) by line number."""
    after_code, alone = {}, {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            line = token.start[0]
            (after_code if token.line[:token.start[1]].strip() else alone)[line] = text
    return after_code, alone


def _comment_of(first: int, last: int, after_code: dict, alone: dict) -> str:
    """The comment of the statement on lines first..last: its own line-end comments, else
    the block of comment lines right above it."""
    own = [after_code[n] for n in range(first, last + 1) if n in after_code]
    if own:
        return " ".join(own)
    above, n = [], first - 1
    while n in alone:
        above.insert(0, alone[n])
        n -= 1
    return " ".join(above)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# model.variant is no field of a model's dataclass: every family reads it the same way
# (tasks.base.model_config), so its text is here.
VARIANT = ("a row of the model file's VARIANTS table (models/<family>.py); the model.* "
           "keys beside it override that row's fields (None: the row's value).")

# Statements whose body may not run: a comment on an assignment inside one holds for
# some of the config's arguments only.
_BRANCHES = (ast.If, ast.For, ast.While, ast.Try, ast.Match)
# The functions that build a whole config: the names they return stand for its root.
_BUILDERS = ("get_config", "base_config")


def _returned_names(function: ast.FunctionDef) -> set[str]:
    return {n.value.id for n in ast.walk(function)
            if isinstance(n, ast.Return) and isinstance(n.value, ast.Name)}


class _KeyComments(ast.NodeVisitor):
    """Walks a config-building source in order. In get_config (or base_config), the
    names it returns stand for the config's root; it follows the names that stand for
    one of its groups (`c.optim = o = ConfigDict()`, `d = c.data`), and records every
    assignment to a key: its comment ("" for none) and whether it sits in a branch. A
    root assigned another config's get_config() names that config's module as a base."""

    def __init__(self, source: str):
        self.after_code, self.alone = _comments(source)
        self.names: dict[str, str] = {}  # variable -> the key path it stands for
        self.roots: frozenset = frozenset()
        self.branch = 0
        self.comments: dict[str, list[str]] = {}  # key path -> its assignments' comments
        self.conditional: set[str] = set()
        self.bases: list[str] = []  # module names whose get_config() is the root

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved = self.names, self.roots  # each function's names are its own
        self.roots = frozenset(_returned_names(node) if node.name in _BUILDERS else ())
        self.names = dict.fromkeys(self.roots, "")
        self.generic_visit(node)
        self.names, self.roots = saved

    def _in_branch(self, node) -> None:
        self.branch += 1
        self.generic_visit(node)
        self.branch -= 1

    visit_If = visit_For = visit_While = visit_Try = visit_Match = _in_branch

    def _path(self, node) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._path(node.value)
            return None if base is None else _join(base, node.attr)
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            base = self._path(node.value)
            return None if base is None else _join(base, node.slice.value)
        return None

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        # the keys assigned (a bare name is a variable, not a key)
        paths = [p for p in (self._path(t) for t in node.targets
                             if not isinstance(t, ast.Name)) if p]
        text = _comment_of(node.lineno, node.end_lineno, self.after_code, self.alone)
        for path in paths:
            self.comments.setdefault(path, []).append(text)
            if self.branch:
                self.conditional.add(path)
        for target in node.targets:
            if not isinstance(target, ast.Name):
                continue
            if target.id in self.roots:  # c = vit_digits.get_config(): built on vit_digits
                call = node.value.func if isinstance(node.value, ast.Call) else None
                if (isinstance(call, ast.Attribute) and call.attr == "get_config"
                        and isinstance(call.value, ast.Name)):
                    self.bases.append(call.value.id)
            elif paths:  # c.optim = o = ConfigDict(): o stands for optim
                self.names[target.id] = paths[0]
            elif self._path(node.value) is not None:  # d = c.data
                self.names[target.id] = self._path(node.value)
            else:
                self.names.pop(target.id, None)

    def found(self) -> dict[str, str]:
        """{key: comment} of the keys whose comment holds whatever the arguments: one
        unconditional assignment with a comment, or every assignment with the same one."""
        out = {}
        for path, texts in self.comments.items():
            if texts[0] and len(set(texts)) == 1 and (
                    len(texts) > 1 or path not in self.conditional):
                out[path] = texts[0]
        return out


def _visit(source: str) -> _KeyComments:
    visitor = _KeyComments(textwrap.dedent(source))
    visitor.visit(ast.parse(textwrap.dedent(source)))
    return visitor


def assignments(source: str) -> dict[str, str]:
    """{key path: comment} of the assignments to config keys in `source` (a module, or
    a get_config or base_config function): `c.optim.lr = 3e-4  # peak lr` gives
    {"optim.lr": "peak lr"}, where c is what get_config returns. A key assigned in a
    branch (if, for, ...) or twice with other comments has none: its comment may not
    hold for the arguments given."""
    return _visit(source).found()


def fields(cls: type, prefix: str) -> dict[str, str]:
    """{prefix.field: comment} of a dataclass's commented fields ({} where its source
    cannot be read: a class made at run time)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    after_code, alone = _comments(source)
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = _comment_of(node.lineno, node.end_lineno, after_code, alone)
            if text:
                found[_join(prefix, node.target.id)] = text
    return found


def table_entries(module: ModuleType, names, prefix: str) -> dict[str, str]:
    """{prefix.key: comment} of the entries of the module-level dict literals `names`."""
    source = inspect.getsource(module)
    after_code, alone = _comments(source)
    found = {}
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id in names for t in node.targets)):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant):
                    text = _comment_of(key.lineno, value.end_lineno, after_code, alone)
                    if text:
                        found.setdefault(_join(prefix, key.value), text)
    return found


def _own(module: ModuleType, depth: int = 0) -> tuple[dict[str, str], set[str]]:
    """({key: comment}, the key paths set) of an experiment module and the configs it
    is built on (`c = vit_digits.get_config()`): the module that sets a key, or a group
    above it, is the one whose comment counts (a base's comment on a value the module
    replaces would describe the replaced value)."""
    try:
        visitor = _visit(inspect.getsource(module))
    except (OSError, TypeError):  # a config module without a file to read
        return {}, set()
    found, assigned = visitor.found(), set(visitor.comments)
    for name in visitor.bases if depth < 8 else ():
        base = getattr(module, name, None)
        if isinstance(base, ModuleType) and base is not module:
            base_found, base_assigned = _own(base, depth + 1)
            shadowed = lambda key: any(key == p or key.startswith(p + ".")  # noqa: E731
                                       for p in assigned)
            found.update({k: v for k, v in base_found.items() if not shadowed(k)})
            assigned |= base_assigned
    return found, assigned


def explain(config, module: ModuleType, model_class: type | None = None) -> dict[str, str]:
    """{key: what it means} for the keys of `config` that have a comment somewhere: the
    general text (base config, shared data tables, model fields), then "This config: "
    and the experiment module's own where it says more."""
    general = assignments(inspect.getsource(config_lib.base_config))
    data_keys = config.get("data") or {}
    tables = [t for t in DATA_KEY_TABLES if next(iter(getattr(config_lib, t))) in data_keys]
    for key, text in table_entries(config_lib, tables, "data").items():
        general.setdefault(key, text)
    if model_class is not None:
        for key, text in fields(model_class, "model").items():
            general.setdefault(key, text)
    general.setdefault("model.variant", VARIANT)
    own = _own(module)[0]
    out = {}
    for key in config_lib.flat(config):
        first, then = _sentence(general.get(key, "")), _sentence(own.get(key, ""))
        if _says_within(then, first):  # says nothing more (or nothing)
            then = ""
        elif _says_within(first, then):  # says it all, and more
            first = ""
        if first and then:
            out[key] = f"{first} This config: {then}"
        elif first or then:
            out[key] = first or then
    return out


def _sentence(text: str) -> str:
    """A comment with a closing full stop (its first word may be code: left as written)."""
    text = text.strip().rstrip(",;:")
    return text if not text or text[-1] in ".!?" else text + "."


def _says_within(part: str, whole: str) -> bool:
    """Whether `part`'s words (case and punctuation aside) run, in order, in `whole`'s."""
    words = lambda text: [w.strip(".,;:()\"'").lower() for w in text.split()]  # noqa: E731
    a, b = words(part), words(whole)
    return any(b[i:i + len(a)] == a for i in range(len(b) - len(a) + 1))
