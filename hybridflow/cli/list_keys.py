"""`hybridflow train --list-keys [PREFIX]` (and `sft`, `dpo`): every config key with its type, default and one-line doc.

Generated from the typed config: the keys and types are the dataclass fields (types as annotated), the defaults
are those of a default-constructed root config (so the main job's, e.g. RunConfig's `data.train_batch_size=8`),
and the doc is the first sentence of the attribute docstring under each field, read from the class's source with
`ast`. Importing the config imports torch (seconds), so the listing is read from list_keys.json, written by
`python -m hybridflow.cli.list_keys` and kept equal to the config by tests/test_cli_front.py. The table
records a hash of the source of every config section class and default factory; when one differs (a section
edited since), the listing is built from the config itself, slower, with a note on stderr.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import hashlib
import importlib
import inspect
import json
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from hybridflow.cli.args import USER_ERRORS, fail

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]`'\"])\.\s+(?=[A-Z])")
_DOC_COLUMN = 64  # docs start here, or right after a longer `key: type = default`
PACKAGE = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("list_keys.json")
"""The generated key table: {command: {"verl_names", "sources", "keys"}}."""
ROOTS = {
    "train": "hybridflow.config.run:RunConfig",
    "sft": "hybridflow.config.sft:SFTConfig",
    "dpo": "hybridflow.config.dpo:DPOConfig",
}
"""The root config dataclass of each command that takes config keys."""


class KeyInfo(NamedTuple):
    """One settable config key."""

    key: str
    """Dotted path, as in a `key=value` override."""
    type: str
    """The field's annotation as written in the source."""
    default: str
    """The default value as YAML-style text (null, true, [a, b])."""
    doc: str
    """First sentence of the field's docstring ("" when it has none)."""


@functools.cache
def _own_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} for the fields `cls` itself declares (not its bases)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen or generated class): no docs
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, str):
            docs[node.target.id] = inspect.cleandoc(doc)
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} of dataclass `cls`, inherited fields included (a subclass's doc wins)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_docs(base))
    return docs


def first_sentence(doc: str) -> str:
    """The first sentence of the first paragraph of `doc`, on one line."""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    end = _SENTENCE_END.search(paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


def format_value(value: Any) -> str:
    """`value` as it would be written in a YAML file or a key=value override."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def iter_keys(config: Any, prefix: str = "") -> Iterator[KeyInfo]:
    """Every leaf key of the config dataclass instance `config`, in declaration order, nested sections expanded."""
    docs = field_docs(type(config))
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from iter_keys(value, f"{prefix}{f.name}.")
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        yield KeyInfo(prefix + f.name, kind, format_value(value), first_sentence(docs.get(f.name, "")))


def select(keys: list[KeyInfo], prefix: str) -> list[KeyInfo]:
    """The keys equal to `prefix` or under it (`actor.optim` selects `actor.optim.lr`, ...); failing those, the
    keys that start with it; a ValueError naming the closest keys when none does."""
    if not prefix:
        return keys
    chosen = [k for k in keys if k.key == prefix or k.key.startswith(prefix + ".")]
    chosen = chosen or [k for k in keys if k.key.startswith(prefix)]
    if chosen:
        return chosen
    names = [k.key for k in keys]
    sections = sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
    near = difflib.get_close_matches(prefix, names + sections, n=3, cutoff=0.6)
    hint = f"; did you mean {near}?" if near else f"; sections: {sections}"
    raise ValueError(f"no config key starts with {prefix!r}{hint}")


def root_class(command: str) -> type:
    """The root config dataclass of `command` (imports the config, and so torch)."""
    module, _, name = ROOTS[command].partition(":")
    return getattr(importlib.import_module(module), name)


def _definitions(config: Any, found: dict[str, set[str]]) -> dict[str, set[str]]:
    """{package-relative file: names of the classes and functions there that define `config`'s keys and defaults}:
    the dataclasses of every section (bases included) and the module-level functions used as default factories."""
    for cls in type(config).__mro__:
        if dataclasses.is_dataclass(cls):
            _add(found, cls)
    for f in dataclasses.fields(config):
        if inspect.isfunction(f.default_factory) and "<" not in f.default_factory.__qualname__:
            _add(found, f.default_factory)  # a lambda or a nested function is inside what defines it
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _definitions(value, found)
    return found


def _add(found: dict[str, set[str]], obj: Any) -> None:
    path = Path(inspect.getfile(obj)).resolve()
    if path.is_relative_to(PACKAGE):  # a plugin's section is not in the table's sources
        found.setdefault(str(path.relative_to(PACKAGE)), set()).add(obj.__name__)


def _digest(path: str, names: list[str]) -> str:
    """sha1 of the source of the module-level classes and functions `names` in package file `path` ("" when the
    file is gone): edits elsewhere in the file leave it unchanged."""
    file = PACKAGE / path
    if not file.is_file():
        return ""
    text = file.read_text()
    nodes = [n for n in ast.parse(text).body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names]
    return hashlib.sha1("\n".join(ast.get_source_segment(text, n) or "" for n in nodes).encode()).hexdigest()


def _sources(definitions: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """{file: {"names": the definitions there, "sha1": their `_digest`}}."""
    return {path: {"names": names, "sha1": _digest(path, names)} for path, names in definitions.items()}


def build_entry(command: str) -> dict[str, Any]:
    """`command`'s part of the table, from the config itself."""
    root = root_class(command)
    config = root()
    definitions = {path: sorted(names) for path, names in sorted(_definitions(config, {}).items())}
    keys = [list(k) for k in iter_keys(config)]
    return {
        "verl_names": getattr(root, "key_dialect", None) is not None,
        "sources": _sources(definitions),
        "keys": keys,
    }


def table_text() -> str:
    """The whole list_keys.json, one source file and one key per line (a changed field is a one-line diff)."""
    parts = []
    for command in ROOTS:
        entry = build_entry(command)
        sources = ",\n      ".join(f"{json.dumps(path)}: {json.dumps(src)}" for path, src in entry["sources"].items())
        keys = ",\n      ".join(json.dumps(k) for k in entry["keys"])
        body = f'"verl_names": {json.dumps(entry["verl_names"])},\n    "sources": {{\n      {sources}\n    }}'
        parts.append(f'"{command}": {{\n    {body},\n    "keys": [\n      {keys}\n    ]\n  }}')
    return "{\n  " + ",\n  ".join(parts) + "\n}\n"


def load_keys(command: str) -> tuple[list[KeyInfo], bool]:
    """`command`'s keys and whether it reads verl's key names: from the table, or from the config itself when a
    config section or default factory the table was built from has changed since (with a note on stderr)."""
    entry = json.loads(TABLE.read_text())[command] if TABLE.is_file() else None
    current = _sources({path: source["names"] for path, source in entry["sources"].items()}) if entry else None
    if entry is None or current != entry["sources"]:
        print(
            f"note: {TABLE.name} is out of date (a config section changed); reading the config itself. "
            "Regenerate it: python -m hybridflow.cli.list_keys",
            file=sys.stderr,
        )
        entry = build_entry(command)
    return [KeyInfo(*k) for k in entry["keys"]], entry["verl_names"]


def render(keys: list[KeyInfo], verl_names: bool, prefix: str = "", prog: str = "hybridflow train") -> str:
    """The listing `prog --list-keys prefix` prints: a header, then one `key: type = default  # doc` line per key."""
    keys = select(keys, prefix)
    header = [
        f"# {prog}: {len(keys)} config keys as `key: type = default  # doc`; set them with key=value or in a",
        "# --config YAML file; `--print-config` shows the values a run resolves to.",
    ]
    if verl_names:
        header.append("# verl's key names are accepted too and mapped to these (docs/verl.md).")
    heads = [f"{k.key}: {k.type} = {k.default}" for k in keys]
    width = min(max(map(len, heads)), _DOC_COLUMN)
    lines = [f"{head:<{width}}  # {k.doc}" if k.doc else head for head, k in zip(heads, keys)]
    return "\n".join(header + lines) + "\n"


def print_keys(command: str, prefix: str, prog: str, debug: bool = False) -> int:
    """Print `command`'s keys under `prefix` on stdout and return 0; a prefix no key has prints one line, returns 2."""
    try:
        text = render(*load_keys(command), prefix, prog)
    except USER_ERRORS as err:
        return fail(prog, err, 2, debug)
    print(text, end="")
    return 0


if __name__ == "__main__":
    TABLE.write_text(table_text())
    print(f"wrote {TABLE}")
