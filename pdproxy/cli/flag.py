"""One flag, declared once (``Flag``), and what the command line derives from a table of them: the
argparse groups, the ``PDPROXY_*`` environment, and the ``ProxyConfig`` the parsed flags build.

A flag names the config field it sets as a dotted path into ``ProxyConfig``'s sections
(``"retry.max_retries"``); its default is that field's default unless the flag gives its own, and
its value goes there as parsed, a list flag's as a tuple. The few that combine flags or change
units give ``convert``, which reads the whole parsed namespace. Validation stays in the config
classes (``__post_init__``).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from pdproxy.config.proxy import ProxyConfig

ENV_PREFIX: Final = "PDPROXY_"
FROM_CONFIG: Final[Any] = object()  # a flag's default unless it gives one: its field's
_TRUE = ("1", "true", "yes", "on")

# The --help groups, in the order they are shown; a flag sits where an operator looks for it.
LISTENER: Final = "listener"
FLEET: Final = "fleet"
UPSTREAM: Final = "upstream (the connections to the engines)"
SCHEDULING: Final = "scheduling (docs/scheduling.md)"
RESILIENCE: Final = "resilience (retries, health, ejection)"
SECURITY: Final = "security (docs/security.md)"
OBSERVABILITY: Final = "observability"
SCALE_OUT: Final = "scale-out (docs/scale-out.md)"
RENDER: Final = "tokenize once (docs/endpoints.md)"
GROUPS: Final = (
    LISTENER,
    FLEET,
    UPSTREAM,
    SCHEDULING,
    RESILIENCE,
    SECURITY,
    OBSERVABILITY,
    SCALE_OUT,
    RENDER,
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """One command-line flag: its spellings (none: set from the environment only), its ``--help``
    group and sentence, how argparse reads it, and the config field it sets (None: another
    flag's ``convert`` reads it). Its variable is ``PDPROXY_<DEST>``; ``env_aliases`` are older
    names read last, when neither the flag nor ``PDPROXY_<DEST>`` is given."""

    names: tuple[str, ...]
    group: str
    help: str
    field: str | None
    type: Callable[[str], Any] | None = None
    action: str | builtins.type[argparse.Action] | None = None
    default: Any = FROM_CONFIG
    nargs: str | None = None
    metavar: str | None = None
    choices: Sequence[Any] | None = None
    dest: str = ""  # else from the first name, as argparse makes it
    convert: Callable[[argparse.Namespace], Any] | None = None
    env_aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.dest:
            object.__setattr__(self, "dest", self.names[0].lstrip("-").replace("-", "_"))

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def is_switch(self) -> bool:
        return self.action in ("store_true", argparse.BooleanOptionalAction)

    def default_value(self) -> Any:
        if self.default is not FROM_CONFIG:
            return self.default
        if self.field is None or self.convert is not None:
            return None
        return config_default(self.field)

    def config_value(self, args: argparse.Namespace) -> Any:
        if self.convert is not None:
            return self.convert(args)
        value = getattr(args, self.dest)
        return tuple(value or ()) if self.nargs == "+" else value


def _section(cls: Any, name: str) -> Any:
    """The class of section ``name`` of ``cls``: every section defaults to a fresh instance of
    its class (``field(default_factory=Timeouts)``)."""
    factory = {f.name: f for f in dataclasses.fields(cls)}[name].default_factory
    assert isinstance(factory, type), f"{cls.__name__}.{name} is not a section"
    return factory


def config_default(path: str) -> Any:
    """The default of ``ProxyConfig``'s field at dotted ``path``, as its class declares it."""
    cls: Any = ProxyConfig
    *sections, name = path.split(".")
    for section in sections:
        cls = _section(cls, section)
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    """One argparse group per ``GROUPS`` title, its flags in table order."""
    for title in GROUPS:
        group = parser.add_argument_group(title)
        for flag in (f for f in flags if f.group == title):
            if not flag.names:  # environment only
                parser.set_defaults(**{flag.dest: None})
                continue
            extra: dict[str, Any] = {"dest": flag.dest, "type": flag.type, "action": flag.action}
            extra["nargs"] = flag.nargs
            extra |= {"metavar": flag.metavar, "choices": flag.choices}
            kwargs = {k: v for k, v in extra.items() if v is not None}
            group.add_argument(*flag.names, default=flag.default_value(), help=flag.help, **kwargs)


def apply_env(
    parser: argparse.ArgumentParser, flags: Iterable[Flag], environ: Mapping[str, str]
) -> None:
    """Turn ``PDPROXY_*`` variables into parser defaults, so flags still override them."""
    defaults: dict[str, Any] = {}
    for flag in flags:
        raw = environ.get(flag.env)
        if raw is not None:
            defaults[flag.dest] = _from_env(parser, flag, raw)
    parser.set_defaults(**defaults)


def _from_env(parser: argparse.ArgumentParser, flag: Flag, raw: str) -> Any:
    if flag.nargs == "+":
        return raw.replace(",", " ").split()
    if flag.is_switch:
        return raw.strip().lower() in _TRUE
    try:
        value = flag.type(raw) if flag.type is not None else raw
    except ValueError:
        parser.error(f"{flag.env}={raw!r} is not valid")
    if flag.choices is not None and value not in flag.choices:
        parser.error(f"{flag.env} must be one of {sorted(flag.choices)}")
    return value


def build_config(
    flags: Iterable[Flag], args: argparse.Namespace, environ: Mapping[str, str]
) -> ProxyConfig:
    """The config the parsed flags set, each section built (and validated) by its class; an
    environment-only value not given as ``PDPROXY_<DEST>`` is read from its aliases."""
    flags = tuple(flags)
    args = argparse.Namespace(**vars(args))
    for flag in flags:
        for alias in flag.env_aliases:
            if getattr(args, flag.dest, None) is None:
                setattr(args, flag.dest, environ.get(alias) or None)
    values = {f.field: f.config_value(args) for f in flags if f.field is not None}
    config: ProxyConfig = _build(ProxyConfig, values)
    return config


def _build(cls: Any, values: Mapping[str, Any]) -> Any:
    fields: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            sections.setdefault(head, {})[rest] = value
        else:
            fields[head] = value
    for name, section in sections.items():
        fields[name] = _build(_section(cls, name), section)
    return cls(**fields)
