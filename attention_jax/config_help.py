"""What each config key means, for `--config=NAME --help`: read from the comments written
beside the code that sets the key, so an explanation lives in one place and a new key
gets its help by being commented as every key here is.

    explanations = config_help.explain(config, module, model_class)  # {key: text}

A key's text is joined from its sources, the general first:
  - config.base_config: the groups every experiment has (optim, train, mesh, eval);
  - the shared data-key tables in config.py (TEXT_FILE_KEYS, IMAGE_KEYS), one entry a
    line;
  - the fields of the task's model dataclass (model.KEY; tasks.register(..., model=));
  - the experiment's own module and the shipped configs it builds on (what this
    experiment sets, and often why).
A statement's comment is the one at the end of its line(s); else the comment lines just
above it. The experiment's text follows the general one after "This config: ".
Read without running anything but `inspect.getsource`.
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
# Calls whose result is a whole run config: a name assigned one is the config's root.
_WHOLE_CONFIG_CALLS = ("base_config", "get_config")


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


class _KeyComments(ast.NodeVisitor):
    """Walks a config-building source in order, following the names that stand for the
    config or one of its groups (`c = base_config()`, `c.optim = o = ConfigDict()`,
    `d = c.data`), and records the comment of each assignment to a key."""

    def __init__(self, source: str, roots):
        self.after_code, self.alone = _comments(source)
        self.roots = frozenset(roots)  # stand for the whole config, whatever is assigned
        self.names = dict.fromkeys(roots, "")  # variable -> the key path it stands for
        self.found: dict[str, str] = {}

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

    def _record(self, path: str, node) -> None:
        text = _comment_of(node.lineno, node.end_lineno, self.after_code, self.alone)
        if text and path not in self.found:  # the first assignment is the one commented
            self.found[path] = text

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        # the keys assigned (a bare name is a variable, not a key)
        paths = [p for p in (self._path(t) for t in node.targets
                             if not isinstance(t, ast.Name)) if p]
        for path in paths:
            self._record(path, node)
        for target in node.targets:
            if not isinstance(target, ast.Name) or target.id in self.roots:
                continue
            call = node.value.func if isinstance(node.value, ast.Call) else None
            called = getattr(call, "attr", getattr(call, "id", None))
            if paths:  # c.optim = o = ConfigDict(): o stands for optim
                self.names[target.id] = paths[0]
            elif called in _WHOLE_CONFIG_CALLS:
                self.names[target.id] = ""
            elif self._path(node.value) is not None:  # d = c.data
                self.names[target.id] = self._path(node.value)
            else:
                self.names.pop(target.id, None)


def assignments(source: str, roots=()) -> dict[str, str]:
    """{key path: comment} of the assignments to config keys in `source` (a module or a
    function): `c.optim.lr = 3e-4  # peak lr` gives {"optim.lr": "peak lr"}. roots: names
    that stand for the whole config from the start (else only a name assigned
    base_config() or get_config() does)."""
    visitor = _KeyComments(textwrap.dedent(source), roots)
    visitor.visit(ast.parse(textwrap.dedent(source)))
    return visitor.found


def fields(cls: type, prefix: str) -> dict[str, str]:
    """{prefix.field: comment} of a dataclass's commented fields."""
    source = textwrap.dedent(inspect.getsource(cls))
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


def _builds_on(module: ModuleType) -> list[ModuleType]:
    """The module and the shipped configs it imports (inductive_bias builds on
    vit_digits), the module first."""
    chain = [module]
    for value in vars(module).values():
        if (isinstance(value, ModuleType) and value is not module
                and value.__name__.startswith("attention_jax.configs.")):
            chain.append(value)
    return chain


def explain(config, module: ModuleType, model_class: type | None = None) -> dict[str, str]:
    """{key: what it means} for the keys of `config` that have a comment somewhere: the
    general text (base config, shared data tables, model fields), then "This config: "
    and the experiment module's own where it says more."""
    general = assignments(inspect.getsource(config_lib.base_config), roots=("c",))
    data_keys = config.get("data") or {}
    tables = [t for t in DATA_KEY_TABLES if next(iter(getattr(config_lib, t))) in data_keys]
    for key, text in table_entries(config_lib, tables, "data").items():
        general.setdefault(key, text)
    if model_class is not None:
        for key, text in fields(model_class, "model").items():
            general.setdefault(key, text)
    own: dict[str, str] = {}
    for source_module in _builds_on(module):
        try:
            source = inspect.getsource(source_module)
        except (OSError, TypeError):  # a config module without a file to read
            continue
        for key, text in assignments(source).items():
            own.setdefault(key, text)
    out = {}
    for key in config_lib.flat(config):
        first, then = _sentence(general.get(key, "")), _sentence(own.get(key, ""))
        if _bare(then) in _bare(first):  # says nothing more (or nothing)
            then = ""
        elif _bare(first) in _bare(then):  # says it all, and more
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


def _bare(text: str) -> str:
    """Text compared without case, spaces or punctuation at its ends."""
    return " ".join(text.lower().split()).strip(" .;:,")
