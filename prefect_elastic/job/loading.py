"""A job's settings from the outside: a YAML file, and pydantic's refusals as `JobConfigError`.

`read_settings` reads the mapping of settings in a YAML file (every refusal names the file);
`yaml_of` writes one that it reads back equal. `config_error` turns pydantic's `ValidationError` into the
`JobConfigError` a user catches: the field, the value, and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import yaml

from ..errors import JobConfigError


def read_settings(file: Path, settings: tuple[str, ...]) -> dict[str, Any]:
    """The mapping of settings in the YAML file `file`, each key one of `settings` (the job's fields)."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobConfigError(
            "config", str(file), "no such file; give the path of a YAML file with the job's settings"
        ) from None
    except OSError as exc:
        raise JobConfigError("config", str(file), f"cannot be read ({exc})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobConfigError("config", str(file), f"is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise JobConfigError(
            "config",
            str(file),
            f"must hold a YAML mapping of settings (e.g. 'model: pkg.mod:make_net'), "
            f"not {type(data).__name__}",
        )
    unknown = [key for key in data if key not in settings]
    if unknown:
        key = unknown[0]
        raise JobConfigError(
            str(key),
            data[key],
            f"unknown setting in {file}; the settings are: {', '.join(settings)}",
        )
    return {str(key): item for key, item in data.items()}


def yaml_of(data: dict[str, Any]) -> str:
    """A job's settings (`model_dump`) as a YAML mapping that `read_settings` reads back equal."""
    data = dict(data)
    data["optimizer"] = {
        key: list(item) if isinstance(item, tuple) else item for key, item in data["optimizer"].items()
    }
    return yaml.safe_dump(data, sort_keys=False)


def config_error(exc: pydantic.ValidationError, settings: tuple[str, ...]) -> JobConfigError:
    """Our error for pydantic's: the first problem in full, the others in short (`settings`: the job's
    field names, for a setting it does not have)."""
    errors = exc.errors(include_url=False)
    first, rest = errors[0], errors[1:]
    field, value, problem = _describe(first, settings)
    if rest:
        others = "; ".join("{}={!r:.60}: {}".format(*_describe(e, settings)) for e in rest)
        problem += f" (also: {others})"
    return JobConfigError(field=field, value=value, problem=problem)


def _describe(error: Any, settings: tuple[str, ...]) -> tuple[str, Any, str]:
    loc = error.get("loc", ())
    field = ".".join(str(part) for part in loc) if loc else "job"
    kind = error.get("type", "")
    message = str(error.get("msg", ""))
    if kind == "value_error":
        # Our own validators' text, without pydantic's "Value error, " prefix.
        ctx_error = error.get("ctx", {}).get("error")
        if isinstance(ctx_error, JobConfigError):
            # A check across fields names the field to change itself.
            return ctx_error.field, ctx_error.value, ctx_error.problem
        message = str(ctx_error) if ctx_error is not None else message.removeprefix("Value error, ")
        return field, error.get("input"), message
    if kind == "missing":
        return field, None, "is required; give it in the job"
    if kind == "extra_forbidden":
        known = ", ".join(settings)
        return field, error.get("input"), f"is not a setting of the job; the settings are: {known}"
    if kind == "literal_error":
        return field, error.get("input"), message
    return field, error.get("input"), f"{message}; give a value of the declared type"
