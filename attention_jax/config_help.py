"""What each config key means, for `--config=SPEC --help`: read from the comments written
beside the code that sets the key, so an explanation lives in one place and a new key
gets its help by being commented as every key here is.

    config, explanations = config_help.load_explained("gpt:variant=gpt2", overrides)

A key's text is joined from its sources, the general first:
  - config.base_config: the groups every experiment has (optim, train, mesh, eval);
  - the shared data-key tables in config.py (TEXT_FILE_KEYS, IMAGE_KEYS), one entry a
    line;
  - the fields of the task's model dataclass (model.KEY; tasks.register(..., model=));
  - then, after "This config: ", the comment of the statement that set the value shown:
    get_config(ARG) runs with every write into a ConfigDict recorded (which group, which
    key, which line of which file wrote it), so the statement is the one that ran for
    these arguments, however it wrote the key (an assignment, update(), setattr, a
    helper function, a base config's get_config), in the experiment's module, the
    shipped configs or the files beside a user's. A group replaced whole has its new
    keys' writes: its statement's comment, as a config copied whole by
    copy_and_resolve_references has the copying statement's (copy.deepcopy's copy has
    none: the standard library wrote it). No comment is shown for a value chosen by a
    conditional expression (`4 if own else None`: the comment may be the other arm's),
    or a key set on the command line ("Set on the command line; the config gives" its
    own value, and that value's comment).
A statement's comment is the one at the end of its line(s); else the comment lines just
above it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import os
import sys
import textwrap
import tokenize

import ml_collections

from attention_jax import config as config_lib

# The tables in config.py whose entries are data keys (data.KEY), each entry commented. A
# config has a table's keys when it has the first (files, root); some names are in both.
DATA_KEY_TABLES = ("TEXT_FILE_KEYS", "IMAGE_KEYS")

# model.variant is no field of a model's dataclass: every family reads it the same way
# (tasks.base.model_config), so its text is here.
VARIANT = ("a row of the model file's VARIANTS table (models/<family>.py); the model.* "
           "keys beside it override that row's fields (None: the row's value).")


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


def _writes(run):
    """(run(), [(ConfigDict, key, file, line)]): every key written into a ConfigDict while
    `run` runs, with the file and line of the code outside ml_collections that wrote it
    (`c.optim.lr = 1`, `c.train.update(steps=5)`, `setattr(c.data, "name", x)` alike)."""
    from ml_collections import config_dict
    real = functools.lru_cache(maxsize=None)(os.path.realpath)
    library = os.path.dirname(real(config_dict.__file__))
    original = config_dict.ConfigDict.__setitem__
    writes = []

    def setitem(self, key, value):
        frame = sys._getframe(1)
        # get_ref("k") stores a reference to k in k's place: a read of k, not a write
        reading = frame.f_code.co_name in ("get_ref", "get_oneway_ref")
        while frame is not None and os.path.dirname(real(frame.f_code.co_filename)) == library:
            frame = frame.f_back
        if frame is not None and not reading:
            writes.append((self, key, real(frame.f_code.co_filename), frame.f_lineno))
        return original(self, key, value)

    config_dict.ConfigDict.__setitem__ = setitem
    try:
        return run(), writes
    finally:
        config_dict.ConfigDict.__setitem__ = original


def _paths(config) -> dict[int, str]:
    """{id(group): its path} of the config and every group in it ("" the root)."""
    out, todo = {}, [(config, "")]
    while todo:
        group, path = todo.pop()
        out[id(group)] = path
        todo += [(v, _join(path, k)) for k, v in group.items()
                 if isinstance(v, ml_collections.ConfigDict)]
    return out


def _last_writes(config, writes) -> dict[str, tuple[str, int, str]]:
    """{key: (file, line, key's own name)} of the last write into each key of `config`,
    counting only writes into the groups it holds now (a group replaced later, by a copy
    or a new one, took its writes with it: the new group's own are the ones counted)."""
    paths = _paths(config)
    keys = set(config_lib.flat(config))
    last = {}
    for group, key, file, line in writes:
        path = _join(paths[id(group)], key) if id(group) in paths else None
        if path in keys:
            last[path] = (file, line, key)
    return last


def _statements(file: str) -> tuple:
    """(first line, last line, comment, chosen, {name: its line's comment} or None) of
    each simple statement in `file`; () where the file cannot be read. chosen: the
    statement holds a conditional expression, so its comment may be the other arm's.
    The names, for a statement whose lines end in several comments (`update(\n
    steps=11,  # eleven\n  seed=4,  # four\n)`), are its keyword arguments and string
    dict keys whose own line ends in one."""
    try:
        with open(file) as f:
            return _parsed_statements(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ()


@functools.lru_cache(maxsize=64)
def _parsed_statements(source: str) -> tuple:
    tree = ast.parse(source)
    after_code, alone = _comments(source)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not hasattr(node, "body"):
            lines = range(node.lineno, node.end_lineno + 1)
            named = {} if sum(n in after_code for n in lines) > 1 else None
            for n in ast.walk(node) if named is not None else ():
                if isinstance(n, ast.keyword) and n.arg and n.lineno in after_code:
                    named[n.arg] = after_code[n.lineno]
                if isinstance(n, ast.Dict):
                    named.update({k.value: after_code[k.lineno] for k in n.keys
                                  if isinstance(k, ast.Constant) and isinstance(k.value, str)
                                  and k.lineno in after_code})
            out.append((node.lineno, node.end_lineno,
                        _comment_of(node.lineno, node.end_lineno, after_code, alone),
                        any(isinstance(n, ast.IfExp) for n in ast.walk(node)), named))
    return tuple(out)


def _comment_at(file: str, line: int, name: str) -> str:
    """The comment of the innermost simple statement of `file` holding `line`, for its
    key `name`: the comment on that key's own line in a statement that comments several
    ("" for none, for a chosen value's, or for a statement of several comments none of
    which is the key's)."""
    holding = [s for s in _statements(file) if s[0] <= line <= s[1]]
    if not holding:
        return ""
    first, last, comment, chosen, named = min(holding, key=lambda s: s[1] - s[0])
    if chosen:
        return ""
    return comment if named is None else named.get(name, "")


def general(config, model_class: type | None = None) -> dict[str, str]:
    """{key: what it means in any experiment}: the base config's comments, the shared
    data tables' (those the config has), the model dataclass's fields'."""
    base, writes = _writes(config_lib.base_config)
    out = {key: text for key, where in _last_writes(base, writes).items()
           if (text := _comment_at(*where))}
    data_keys = config.get("data") or {}
    tables = [t for t in DATA_KEY_TABLES if next(iter(getattr(config_lib, t))) in data_keys]
    for key, text in table_entries(config_lib, tables, "data").items():
        out.setdefault(key, text)
    if model_class is not None:
        for key, text in fields(model_class, "model").items():
            out.setdefault(key, text)
    out.setdefault("model.variant", VARIANT)
    return out


def load_explained(spec: str, overrides=(), model_class_of=None):
    """(the config `spec` names with `overrides`, {key: what it means}) for --help: the
    general text of each key, then "This config: " and the comment of the statement
    that set its value (see the module's doc). model_class_of(config): the task's model
    dataclass, or None."""
    module = config_lib.config_module(spec)
    # The shipped configs, and the user's file with the files beside it (its helpers):
    # a value written elsewhere (config.py's shared tables) has the general text only.
    folders = {os.path.realpath(config_lib.CONFIG_DIR)}
    if getattr(module, "__file__", None):
        folders.add(os.path.dirname(os.path.realpath(module.__file__)))
    config, writes = _writes(lambda: config_lib.load(spec))
    setters = _last_writes(config, writes)
    written = config_lib.flat(config)
    _, given = _writes(lambda: config_lib.apply_overrides(config, overrides))
    given = set(_last_writes(config, given))
    meanings = general(config, model_class_of(config) if model_class_of else None)
    out = {}
    for key in config_lib.flat(config):
        first, then = _sentence(meanings.get(key, "")), ""
        if key in setters and os.path.dirname(setters[key][0]) in folders:
            then = _sentence(_comment_at(*setters[key]))
        if _says_within(then, first):  # says nothing more (or nothing)
            then = ""
        elif _says_within(first, then):  # says it all, and more
            first = ""
        if key in given:  # the user's value: the config's own, and why, beside it
            out[key] = " ".join(filter(None, (first, (
                f"Set on the command line; the config gives {written.get(key)!r}"
                + (f": {then}" if then else ".")))))
        elif first and then:
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
