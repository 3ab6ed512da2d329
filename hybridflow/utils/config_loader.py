"""Load typed config dataclasses from YAML plus verl-style `a.b.c=value` overrides.

`load_config(RunConfig, "run.yaml", ["data.train_batch_size=64"])` merges,
in order, the dataclass defaults, the YAML file and the overrides (OmegaConf
structured configs check the types), then builds the dataclasses bottom-up so
that every nested `__post_init__` runs on the merged values. `${...}` values of the
file and overrides resolve as in Hydra: against the file and overrides together, so a
value follows the final value of the key it names (`_resolve_interpolations`). The
unknown keys and wrong values of all layers are reported at once, in one `ConfigError`:

- an unknown key names the closest known keys;
- a value of the wrong type names the key and the source (file or override);
- a failed `__post_init__` check (the first one) is prefixed with the section's key path.

`trainer.plugins` (where the config has it) is read from the merged values and
imported before any section is built, so names the plugins register pass the checks;
`file.py:function` values get absolute file paths, so workers find them too.

Config dataclasses derive from `Section`, so that `freeze` can make a resolved
config read-only (hybridflow/config/resolve.py): a value computed once is never
overwritten later by code that should have read it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from hybridflow.utils.plugins import PluginError, import_plugins, resolve_spec

T = TypeVar("T")
PLUGINS_KEY = "trainer.plugins"
"""The config key listing user modules to import before the checks run (`TrainerConfig.plugins`)."""
_FILE_ATTR = re.compile(r"^[^:]+\.py:[A-Za-z_]\w*\+?$")  # "+": a KL estimator's straight-through suffix
_OVERRIDE = re.compile(r"^[A-Za-z_][\w\-]*(\.[A-Za-z_][\w\-]*)*=")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key and the fix."""


class FrozenConfigError(AttributeError):
    """Code tried to change a field of a frozen (resolved) config."""


class Section:
    """Base of every config dataclass: an instance can be frozen (see `freeze`)."""

    _frozen = False  # a class attribute, not a dataclass field: invisible to OmegaConf, ==, repr

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenConfigError(
                f"{type(self).__name__}.{name} is read-only: this config is resolved and "
                "frozen; set the value in the YAML file or a key=value override instead"
            )
        super().__setattr__(name, value)


def freeze(config: Any) -> Any:
    """Make `config` and every section inside it read-only; returns `config`."""
    if isinstance(config, Section):
        for f in dataclasses.fields(config):
            freeze(getattr(config, f.name))
        object.__setattr__(config, "_frozen", True)
    return config


class KeyDialect(Protocol):
    """Another framework's key names for a root config class (`cls.key_dialect`; RunConfig's: verl's)."""

    def translate(self, data: dict, source: str) -> tuple[dict, list[str]]:
        """One layer with the dialect's names replaced by ours, and one line per key it refuses."""

    def base_layer(self, layers: list[dict]) -> dict | None:
        """Defaults to start from, given the layers as written (before `translate`); None: the class's own."""

    def hint(self, key: str) -> str:
        """Text appended to the report of an unknown key (e.g. "; 'x.y' is 'z' here"), or ""."""


def load_config(cls: type[T], yaml_path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """An instance of dataclass `cls` from defaults, the YAML file and `key=value` overrides.

    When `cls` declares a `key_dialect` (KeyDialect), every layer is translated by it first and the run may
    start from the dialect's base layer. Every unknown or refused key of all layers is reported in one
    ConfigError (one line per key)."""
    layers = []
    if yaml_path is not None:
        layers.append((f"config file {str(yaml_path)!r}", _read_yaml(Path(yaml_path))))
    if overrides:
        layers.append(("command-line overrides", _parse_overrides(overrides)))
    dialect: KeyDialect | None = getattr(cls, "key_dialect", None)
    written = _resolve_interpolations([(source, _as_mapping(layer, source)) for source, layer in layers])
    merged = OmegaConf.structured(cls)
    problems: list[str] = []
    translated = []
    for source, data in written:
        if dialect is not None:
            data, refused = dialect.translate(data, source)
            problems += [f"{source}: {line}" for line in refused]
        problems += unknown_keys(cls, data, source=source, hint=dialect.hint if dialect else None)
        translated.append((source, data))
    base = dialect.base_layer([data for _, data in written]) if dialect is not None else None
    if base is not None:
        translated.insert(0, ("the verl defaults", base))
    for source, data in translated:
        merged = _merge_layer(merged, data, source, problems)
    _raise_all(problems)
    _import_plugins(merged)
    _absolute_file_paths(merged)
    return build(cls, merged)


def _merge_layer(merged: DictConfig, data: dict, source: str, problems: list[str]) -> DictConfig:
    """`merged` with the layer `data` on top; a value of the wrong type adds a line to `problems` (every bad
    value of the layer is found: on a failed merge the layer is merged again one leaf at a time)."""
    try:
        return OmegaConf.merge(merged, OmegaConf.create(data))
    except OmegaConfBaseException:
        pass
    for key, value in _leaves(data):
        try:
            merged = OmegaConf.merge(merged, _nested(key, value))
        except OmegaConfBaseException as err:
            if not (isinstance(err, ConfigKeyError) and _reported(key, problems)):  # unknown: reported already
                problems.append(f"{source}: bad value for config key {key!r}: {_first_line(err)}")
    return merged


def _reported(key: str, problems: list[str]) -> bool:
    """Whether a line of `problems` names `key` or a section above it."""
    parts = key.split(".")
    names = {repr(".".join(parts[:end])) for end in range(1, len(parts) + 1)}
    return any(name in line for line in problems for name in names)


def _leaves(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested mapping (an empty mapping is a leaf)."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _nested(key: str, value: Any) -> DictConfig:
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return OmegaConf.create(node)


def _as_mapping(layer: DictConfig, source: str) -> dict:
    """The layer as a plain dict (interpolations kept as written: `_resolve_interpolations` resolves them)."""
    data = OmegaConf.to_container(layer)
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys to values, got {data!r}")
    return data


def _resolve_interpolations(written: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The layers with their `${...}` values resolved as Hydra resolves them: against all layers merged, so a
    value that follows another key (`${actor_rollout_ref.actor.ppo_epochs}`, `${oc.select:a.b,1}`, `${.x}`)
    gets that key's final value, whichever layer sets it. A reference to a key no layer sets is kept as
    written: it may name a key of the defaults, and resolves when the sections are built."""
    if not any(_has_interpolation(data) for _, data in written):
        return written
    try:
        merged = OmegaConf.merge(*(OmegaConf.create(data) for _, data in written))
    except OmegaConfBaseException:
        return written  # layers that do not merge: the merge in load_config reports it, naming the key
    raw = OmegaConf.to_container(merged)
    return [(source, _resolve_layer(data, merged, raw)) for source, data in written]


def _resolve_layer(data: dict, merged: DictConfig, raw: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = _resolve_layer(value, merged, raw, path + ".")
        elif _has_interpolation(value):
            out[key] = _resolved(merged, raw, path, value)
        else:
            out[key] = value
    return out


def _resolved(merged: DictConfig, raw: dict, path: str, expression: Any) -> Any:
    """`expression`, written at key `path`, resolved against `merged` (`raw`: merged unresolved)."""
    tree = merged
    if _raw_at(raw, path) != expression:  # a later layer sets `path`: evaluate this layer's expression there
        tree = merged.copy()
        OmegaConf.update(tree, path, expression, merge=False)
    try:
        value = OmegaConf.select(tree, path, throw_on_resolution_failure=True)
        return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
    except OmegaConfBaseException:
        return expression


def _raw_at(raw: dict, path: str) -> Any:
    node: Any = raw
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _has_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_has_interpolation(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_interpolation(v) for v in value)
    return False


def _raise_all(problems: list[str]) -> None:
    """One ConfigError: the problem itself when there is one, else a count and one indented line each."""
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} config keys are wrong:\n  " + "\n  ".join(problems))


def _import_plugins(merged: DictConfig) -> None:
    """Import `trainer.plugins` (if the config has that key) before any section is built and checked, so names
    the plugins register pass the checks; the list is stored back with file paths made absolute."""
    if OmegaConf.select(merged, PLUGINS_KEY) is None:
        return
    try:
        resolved = import_plugins(OmegaConf.select(merged, PLUGINS_KEY), PLUGINS_KEY)
    except PluginError as err:
        raise ConfigError(str(err)) from None
    OmegaConf.update(merged, PLUGINS_KEY, resolved)


def _absolute_file_paths(node: DictConfig | ListConfig) -> None:
    """Make the file of every `relative/file.py:attr` registry name absolute, against the working directory at
    load: worker processes look the name up again, from another working directory."""
    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        if OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            _absolute_file_paths(value)
        elif isinstance(value, str) and _FILE_ATTR.match(value):
            file, _, attr = value.rpartition(":")
            node[key] = f"{resolve_spec(file)}:{attr}"


def build(cls: type[T], node: DictConfig, prefix: str = "") -> T:
    """Instantiate dataclass `cls` from `node`, nested sections first."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = prefix + f.name
        try:
            value = node[f.name]
        except MissingMandatoryValue:
            raise ConfigError(f"config key {key!r} has no value; set it in the YAML file or with {key}=...") from None
        sub = _dataclass_type(hints[f.name])
        if sub is not None and isinstance(value, DictConfig):
            kwargs[f.name] = build(sub, value, key + ".")
        elif isinstance(value, (DictConfig, ListConfig)):
            kwargs[f.name] = OmegaConf.to_container(value, resolve=True)
        else:
            kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as err:
        where = prefix.rstrip(".") or cls.__name__
        text = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ConfigError(f"config section {where!r}: {text}") from None


def check_keys(cls: type, data: Any, prefix: str = "", source: str = "config") -> None:
    """Raise ConfigError for the keys in `data` that dataclass `cls` does not have (all of them at once)."""
    _raise_all(unknown_keys(cls, data, prefix, source))


def unknown_keys(
    cls: type, data: Any, prefix: str = "", source: str = "config", hint: Callable[[str], str] | None = None
) -> list[str]:
    """One line per key in `data` that dataclass `cls` does not have, naming the closest known keys (and
    `hint(key)`, e.g. a dialect's name for it)."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the top level"
        return [f"{source}: {where} must be a mapping of keys to values, got {data!r}"]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    lines = []
    for key, value in data.items():
        if key not in names:
            extra = hint(prefix + str(key)) if hint else ""
            near = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
            near_text = f"; did you mean {[prefix + n for n in near]}?" if near and not extra else ""
            known = "" if extra or near else f" Known keys in {prefix.rstrip('.') or cls.__name__}: {names}"
            lines.append(f"{source}: unknown config key {prefix + str(key)!r}{extra}{near_text}{known}")
            continue
        sub = _dataclass_type(hints[key])
        if sub is not None and value is not None:
            lines += unknown_keys(sub, value, f"{prefix}{key}.", source, hint)
    return lines


def to_yaml(config: Any) -> str:
    """The config dataclass instance as YAML (for logging it or saving it with a checkpoint)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _dataclass_type(hint: Any) -> type | None:
    """The dataclass in `hint` (also inside Optional[...]), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _dataclass_type(args[0])
    return None


def _read_yaml(path: Path) -> DictConfig:
    if not path.exists() or path.is_dir():  # a pipe (--config /dev/stdin) is no regular file, and reads fine
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        layer = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and OmegaConf's own errors
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_first_line(err)}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values at the top level")
    return layer


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if not _OVERRIDE.match(item):
            raise ConfigError(f"override {item!r} is not of the form key.sub=value (e.g. data.train_batch_size=32)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {_first_line(err)}") from None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
