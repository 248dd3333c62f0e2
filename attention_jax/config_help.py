"""What each config key means, for `--config=SPEC --help`: read from the comments written
beside the code that sets the key, so an explanation lives in one place and a new key
gets its help by being commented as every key here is.

    config, explanations = config_help.load_explained("gpt:variant=gpt2", overrides)

A key's text is joined from its sources, the general first:
  - config.base_config: the groups every experiment has (optim, train, mesh, eval);
  - the shared data-key tables in config.py (TEXT_FILE_KEYS, IMAGE_KEYS), one entry a
    line;
  - the fields of the task's model dataclass (model.KEY; tasks.register(..., model=));
  - then, after "This config: ", the comment of the statement in the experiment's code
    that set the value shown: get_config(ARG) runs traced (the lines it executes, in its
    module and in the shipped configs it builds on), so a comment in a branch its
    arguments did not take, or on a value a later statement replaced, is not shown. A
    value chosen by a conditional expression (`4 if own else None`) has no comment of
    its own (it may describe the other arm), nor a key set on the command line.
A statement's comment is the one at the end of its line(s); else the comment lines just
above it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import itertools
import os
import sys
import textwrap
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass

from attention_jax import config as config_lib

# The tables in config.py whose entries are data keys (data.KEY), each entry commented. A
# config has a table's keys when it has the first (files, root); some names are in both.
DATA_KEY_TABLES = ("TEXT_FILE_KEYS", "IMAGE_KEYS")

# model.variant is no field of a model's dataclass: every family reads it the same way
# (tasks.base.model_config), so its text is here.
VARIANT = ("a row of the model file's VARIANTS table (models/<family>.py); the model.* "
           "keys beside it override that row's fields (None: the row's value).")
# The functions that build a whole config: the names they return stand for its root.
_BUILDERS = ("get_config", "base_config")


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


@dataclass(frozen=True)
class Assignment:
    """One statement's assignment to a config key (or a whole group of them)."""
    path: str  # "optim.lr"; a group's ("model") replaces every key under it
    first: int  # the statement's lines
    last: int
    comment: str  # "" for none
    chosen: bool  # its value is a conditional expression: the comment may be the other arm's


def _returned_names(function: ast.FunctionDef) -> set[str]:
    return {n.value.id for n in ast.walk(function)
            if isinstance(n, ast.Return) and isinstance(n.value, ast.Name)}


class _KeyAssignments(ast.NodeVisitor):
    """Walks a config-building source in order. In get_config (or base_config), the
    names it returns stand for the config's root; it follows the names that stand for
    one of its groups (`c.optim = o = ConfigDict()`, `d = c.data`), and records every
    assignment to a key."""

    def __init__(self, source: str):
        self.after_code, self.alone = _comments(source)
        self.names: dict[str, str] = {}  # variable -> the key path it stands for
        self.roots: frozenset = frozenset()
        self.found: list[Assignment] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        saved = self.names, self.roots  # each function's names are its own
        self.roots = frozenset(_returned_names(node) if node.name in _BUILDERS else ())
        self.names = dict.fromkeys(self.roots, "")
        self.generic_visit(node)
        self.names, self.roots = saved

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
        comment = _comment_of(node.lineno, node.end_lineno, self.after_code, self.alone)
        chosen = any(isinstance(n, ast.IfExp) for n in ast.walk(node.value))
        self.found += [Assignment(p, node.lineno, node.end_lineno, comment, chosen)
                       for p in paths]
        for target in node.targets:
            if not isinstance(target, ast.Name) or target.id in self.roots:
                continue
            if paths:  # c.optim = o = ConfigDict(): o stands for optim
                self.names[target.id] = paths[0]
            elif self._path(node.value) is not None:  # d = c.data
                self.names[target.id] = self._path(node.value)
            else:
                self.names.pop(target.id, None)


def key_assignments(source: str) -> list[Assignment]:
    """The assignments to config keys in `source` (a module, or a get_config or
    base_config function), in source order: `c.optim.lr = 3e-4  # peak lr` gives
    Assignment("optim.lr", ..., comment="peak lr"), where c is what get_config returns."""
    source = textwrap.dedent(source)
    visitor = _KeyAssignments(source)
    visitor.visit(ast.parse(source))
    return visitor.found


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


def table_entries(module, names, prefix: str) -> dict[str, str]:
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


def general(config, model_class: type | None = None) -> dict[str, str]:
    """{key: what it means in any experiment}: the base config's comments, the shared
    data tables' (those the config has), the model dataclass's fields'."""
    out = {a.path: a.comment
           for a in key_assignments(inspect.getsource(config_lib.base_config)) if a.comment}
    data_keys = config.get("data") or {}
    tables = [t for t in DATA_KEY_TABLES if next(iter(getattr(config_lib, t))) in data_keys]
    for key, text in table_entries(config_lib, tables, "data").items():
        out.setdefault(key, text)
    if model_class is not None:
        for key, text in fields(model_class, "model").items():
            out.setdefault(key, text)
    out.setdefault("model.variant", VARIANT)
    return out


def _traced(run, traced):
    """(run(), {(file, line): when it last ran}) for the lines `run` executes in the files
    `traced(real path)` is true of; other code runs untraced."""
    order: dict[tuple[str, int], int] = {}
    tick = itertools.count()
    real = functools.lru_cache(maxsize=None)(os.path.realpath)

    def lines(frame, event, arg):
        if event == "line":
            order[(real(frame.f_code.co_filename), frame.f_lineno)] = next(tick)
        return lines

    def calls(frame, event, arg):
        return lines if traced(real(frame.f_code.co_filename)) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        return run(), order
    finally:
        sys.settrace(previous)


def load_explained(spec: str, overrides=(), model_class_of=None):
    """(the config `spec` names with `overrides`, {key: what it means}) for --help: the
    general text of each key, then "This config: " and the comment of the statement
    that set its value (see the module's doc). model_class_of(config): the task's model
    dataclass, or None."""
    module = config_lib.config_module(spec)
    # The shipped configs, and the user's file with the files beside it (its helpers).
    folders = {os.path.realpath(config_lib.CONFIG_DIR)}
    if getattr(module, "__file__", None):
        folders.add(os.path.dirname(os.path.realpath(module.__file__)))
    config, order = _traced(lambda: config_lib.load(spec),
                            lambda file: os.path.dirname(file) in folders)
    setting: dict[str, tuple[int, Assignment]] = {}  # key or group -> its last run
    for file in {file for file, _ in order}:
        try:
            with open(file) as f:
                found = key_assignments(f.read())
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for a in found:
            ran = [order[(file, n)] for n in range(a.first, a.last + 1) if (file, n) in order]
            if ran and max(ran) >= setting.get(a.path, (-1, None))[0]:
                setting[a.path] = (max(ran), a)
    config_lib.apply_overrides(config, overrides)
    given = (set(overrides) if isinstance(overrides, Mapping)
             else {o.partition("=")[0].strip() for o in overrides})
    meanings = general(config, model_class_of(config) if model_class_of else None)
    out = {}
    for key in config_lib.flat(config):
        first, then = _sentence(meanings.get(key, "")), ""
        if key in given:
            then = "set on the command line."
        else:
            # the last statement that set the key, or a whole group above it
            groups = [p for p in setting if key == p or key.startswith(p + ".")]
            last = max(groups, key=lambda p: setting[p][0], default=None)
            if last == key and not setting[key][1].chosen:
                then = _sentence(setting[key][1].comment)
        if _says_within(then, first):  # says nothing more (or nothing)
            then = ""
        elif _says_within(first, then):  # says it all, and more
            first = ""
        if first and then:
            out[key] = f"{first} This config: {then}"
        elif first or then:
            out[key] = first or then
    return config, out


def _sentence(text: str) -> str:
    """A comment with a closing full stop (its first word may be code: left as written)."""
    text = text.strip().rstrip(",;:")
    return text if not text or text[-1] in ".!?" else text + "."


def _says_within(part: str, whole: str) -> bool:
    """Whether `part`'s words (case and punctuation aside) run, in order, in `whole`'s."""
    words = lambda text: [w.strip(".,;:()\"'").lower() for w in text.split()]  # noqa: E731
    a, b = words(part), words(whole)
    return any(b[i:i + len(a)] == a for i in range(len(b) - len(a) + 1))
