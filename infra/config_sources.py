"""Where a job config's values come from, and how a bad one is reported.

The file is read by pydantic-settings' own YAML/TOML sources, with errors that name the file
and never quote its lines (a bad line may hold a credential). ETT_* variables are strings by
nature, so each is first read as its field's type, then validated as strictly as a file.
Error messages never echo a credential: values of secret fields and of unknown keys are left
out, and user:password in URLs is masked.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)


class ConfigError(ValueError):
    """A job config that cannot be used; the message names the field and the allowed values."""


_CONFIG_FILE: ContextVar[Path | None] = ContextVar("ett_config_file", default=None)


def file_source(settings_cls: type[BaseSettings], path: Path) -> PydanticBaseSettingsSource:
    """pydantic-settings' own YAML/TOML source for ``path``, with errors that name the file
    (and never quote its lines: a bad line may hold a credential)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    toml = path.suffix == ".toml"
    try:
        if toml:
            return TomlConfigSettingsSource(settings_cls, toml_file=path)
        return YamlConfigSettingsSource(settings_cls, yaml_file=path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML: {exc.problem}{where}") from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        kind = "TOML" if toml else "YAML"
        raise ConfigError(f"config file {path} is not valid {kind}: {exc}") from None
    except (AttributeError, TypeError, ValueError):
        raise ConfigError(f"config file {path} must hold a mapping at the top") from None


class EnvSource(EnvSettingsSource):
    """ETT_* variables. They are strings by nature, so each value is first read as its
    field's type (``"50"`` -> 50, ``"true"`` -> True), then validated as strictly as a file."""

    def __call__(self) -> dict[str, Any]:
        return _typed_env(self.settings_cls, super().__call__())


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _typed_env(model: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        field = model.model_fields.get(key)
        sub = _model_of(field.annotation) if field is not None else None
        if sub is not None and isinstance(value, dict):
            out[key] = _typed_env(sub, value)
        elif field is not None and isinstance(value, str):
            try:
                out[key] = TypeAdapter(field.annotation).validate_python(value)
            except ValidationError:
                out[key] = value  # the strict validation names the field
        else:
            out[key] = value
    return out


_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_SECRET_NAME = re.compile(r"secret|password|passwd|token|credential|access_key|api_key", re.I)


def redact_url(text: str) -> str:
    """``http://user:token@host/x`` -> ``http://***@host/x`` (anywhere in ``text``)."""
    return _URL_USERINFO.sub(r"\g<scheme>***@", text)


def _shown_input(err: Any) -> str:
    """What a config error may show of the bad value: scalars only, never the value of a
    secret-looking field or of an unknown key (a misspelt ``s3_secret_key`` holds one)."""
    value = err.get("input")
    names = " ".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden" or _SECRET_NAME.search(names):
        return ""
    if isinstance(value, str):
        return f" (got {redact_url(value)[:80]!r})"
    if value is None or isinstance(value, bool | int | float):
        return f" (got {value!r})"
    return ""


def format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid job config ({source}):"]
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  {field}: {redact_url(err['msg'])}{_shown_input(err)}")
    return "\n".join(lines)


def config_file() -> Path | None:
    """The file the config being loaded on this thread comes from (see ``reading``)."""
    return _CONFIG_FILE.get()


@contextmanager
def reading(path: Path | None) -> Iterator[None]:
    """Configs made inside this block read ``path`` (None: no file, defaults and env only)."""
    token = _CONFIG_FILE.set(path)
    try:
        yield
    finally:
        _CONFIG_FILE.reset(token)
