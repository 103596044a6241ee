"""ServeArgs from its sources, in a fixed order of precedence whatever the command line's order:

    defaults < a --config YAML file < dedicated CLI flags < --set PATH=VALUE

A path names a field with dots for nesting (`kv_cache_config.max_tokens`); a value is YAML (null, booleans,
finite numbers, strings, lists, string-keyed mappings). An assignment replaces exactly the addressed value, a
mapping or list entirely. Of duplicate --set paths the last wins; a --set path and one of its descendants
conflict. An unknown path is rejected with the valid paths at that level.

A file may list several models under `models` (config.py): each entry's paths are checked as ModelArgs', named
`models[1].max_batch_size` in messages. --set addresses no list item; the ModelArgs fields it sets at the top
level are the default of every entry (an entry's own value wins), and `--set models=[...]` replaces the list.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from raylm.serving.config import ServeArgs

# Fields --set may not address, and what to use instead.
SET_EXCLUDED = {"model": "give the model as the MODEL argument"}


class ConfigError(ValueError):
    """A configuration source is malformed; the message names the source, the path and what is allowed."""


def _options(annotation: Any) -> tuple[Any, ...]:
    """The types an annotation allows: each of a union's (through Annotated and nested unions), else itself."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _options(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(option for arg in typing.get_args(annotation) for option in _options(arg))
    return (annotation,)


def _nested_models(model: type[BaseModel], name: str) -> list[type[BaseModel]]:
    """The model classes field `name` may hold (several for a union of models, such as speculative_config's
    decoding types; none when it holds a value)."""
    return [option for option in _options(model.model_fields[name].annotation)
            if isinstance(option, type) and issubclass(option, BaseModel)]


def _item_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model class of the items of field `name` when it holds a list of models (`models`), else None."""
    for option in _options(model.model_fields[name].annotation):
        if typing.get_origin(option) is list:
            (item,) = typing.get_args(option)
            if isinstance(item, type) and issubclass(item, BaseModel):
                return item
    return None


Models = type[BaseModel] | list[type[BaseModel]]


def _as_list(models: Models) -> list[type[BaseModel]]:
    return models if isinstance(models, list) else [models]


def config_paths(model: Models = ServeArgs, prefix: str = "") -> list[str]:
    """Every path a source may set, sorted: each field, and the fields of nested models (of any model a union
    allows)."""
    paths = set()
    for each in _as_list(model):
        for name in each.model_fields:
            paths.add(prefix + name)
            nested = _nested_models(each, name)
            if nested:
                paths.update(config_paths(nested, f"{prefix}{name}."))
    return sorted(paths)


def check_path(path: str, source: str, model: Models = ServeArgs, shown: str = "") -> None:
    """Raises ConfigError unless `path` names a field of `model` (of one of them, for a union), listing the valid
    paths where it went wrong; messages show paths after `shown` (`models[1].` for a path inside an entry of
    models)."""
    parts = path.split(".")
    models = _as_list(model)
    for depth, part in enumerate(parts):
        parent = shown + ".".join(parts[:depth])
        owners = [each for each in models if part in each.model_fields]
        if not owners:
            where = f"under {parent.rstrip('.')!r}" if parent else "at the top level"
            valid = ", ".join(config_paths(models, f"{parent.rstrip('.')}." if parent else ""))
            raise ConfigError(f"{source}: unknown config path {shown + path!r}; valid paths {where}: {valid}")
        models = [nested for each in owners for nested in _nested_models(each, part)]
        if not models and depth < len(parts) - 1:
            raise ConfigError(f"{source}: {shown + '.'.join(parts[:depth + 1])!r} is a value, not a mapping; "
                              f"{shown + path!r} cannot address inside it")


def _check_values(value: Any, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where}: numbers must be finite, got {value}")
        return
    if isinstance(value, list):
        for item in value:
            _check_values(item, where)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}: mapping keys must be strings, got {key!r}")
            _check_values(item, where)
        return
    raise ConfigError(f"{where}: values must be null, booleans, numbers, strings, lists or mappings, got a "
                      f"{type(value).__name__} ({value!r}); quote it to pass a string")


def _check_tree(values: Mapping[str, Any], source: str, model: Models = ServeArgs, shown: str = "") -> None:
    """Checks every path of a mapping of `model`'s fields, those inside nested models and entries of models too."""
    for key, value in values.items():
        check_path(str(key), source, model, shown)
        owners = [each for each in _as_list(model) if key in each.model_fields]
        nested = [models for each in owners for models in _nested_models(each, key)]
        item = next((found for each in owners if (found := _item_model(each, key)) is not None), None)
        if isinstance(value, dict) and nested:
            _check_tree(value, source, nested, f"{shown}{key}.")
        if isinstance(value, list) and item is not None:
            for index, entry in enumerate(value):
                if isinstance(entry, dict):
                    _check_tree(entry, source, item, f"{shown}{key}[{index}].")


def _check_value(path: str, value: Any, source: str) -> None:
    """Checks the paths inside a (checked) path's new value."""
    *parents, leaf = path.split(".")
    models: list[type[BaseModel]] = [ServeArgs]
    for part in parents:
        models = [nested for each in models if part in each.model_fields for nested in _nested_models(each, part)]
    _check_tree({leaf: value}, source, models, "".join(f"{part}." for part in parents))


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a --config YAML file, its paths checked (an empty file is an empty mapping)."""
    source = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the file: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: the file must hold a mapping of config fields, got a {type(values).__name__}")
    _check_values(values, source)
    _check_tree(values, source)
    return values


def parse_assignment(text: str) -> tuple[str, Any]:
    """PATH=VALUE of one --set, the path checked and the value parsed as YAML."""
    path, sep, raw = text.partition("=")
    path = path.strip()
    source = f"--set {text}"
    if not sep or not path:
        raise ConfigError(f"{source}: expected PATH=VALUE, such as kv_cache_config.max_tokens=4096")
    check_path(path, source)
    top = path.split(".", 1)[0]
    if top in SET_EXCLUDED:
        raise ConfigError(f"{source}: {top!r} cannot be set with --set; {SET_EXCLUDED[top]}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: the value is not valid YAML: {exc}") from exc
    _check_values(value, source)
    _check_value(path, value, source)
    return path, value


def _without_conflicts(assignments: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The assignments by path (the last of duplicates wins); a path and one of its descendants conflict."""
    latest = dict(assignments)
    for path in latest:
        for other in latest:
            if other.startswith(path + "."):
                raise ConfigError(f"--set {path} and --set {other} conflict: set the mapping or its field, "
                                  "not both")
    return latest


def _assign(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[leaf] = value


def _describe(error: Mapping[str, Any]) -> str:
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.get("loc", ())).lstrip(".")
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    value = error.get("input")
    shown = "" if error.get("type") == "missing" or isinstance(value, dict) else f" (got {value!r})"
    return f"{path}: {message}{shown}" if path else message


def layer_serve_args(config_file: str | Path | None = None, flags: Mapping[str, Any] | None = None,
                     assignments: Iterable[str] = ()) -> ServeArgs:
    """ServeArgs from the defaults, then a --config file, then CLI flags (path -> value, None meaning not
    given), then --set assignments. Raises ConfigError naming the source and path of any bad value."""
    tree = load_config_file(config_file) if config_file else {}
    for path, value in (flags or {}).items():
        if value is not None:
            check_path(path, "command line")
            _assign(tree, path, value)
    for path, value in _without_conflicts([parse_assignment(text) for text in assignments]).items():
        _assign(tree, path, value)
    try:
        return ServeArgs.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError("invalid configuration: " + "; ".join(_describe(error) for error in exc.errors())) from exc
