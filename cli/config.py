"""`launch-stack --config FILE`: a TOML file holding values for launch-stack's flags.

Keys are the flag names without the dashes (`max-active = 2`; `max_active` works too). Flags on
the command line override the file. Unknown keys and values of the wrong type are refused with
a message that names them: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass
from typing import Any

EXIT_USAGE = 1  # launch-stack's "the start failed"; argparse's usual 2 means "the worker kept dying" here


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in --help (a flag unset by default, None, says what that means itself)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


@dataclass(frozen=True)
class Flag:
    """A flag a config file may set: its action, and whether it is repeatable (`action="append"`)."""

    action: argparse.Action
    repeatable: bool


class ArgumentParser(argparse.ArgumentParser):
    """argparse with usage errors exiting 1, so launch-stack's exit codes keep their meaning, and
    every flag's default shown by --help; `flags` holds each flag added, for a config file."""

    def __init__(self, *args, **kwargs):
        self.flags: list[Flag] = []  # before argparse adds its own --help
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if "help" not in kwargs and any(a.startswith("--") for a in args):
            kwargs["help"] = "(default: %(default)s)"  # the formatter shows defaults only beside help text
        action = super().add_argument(*args, **kwargs)
        self.flags.append(Flag(action, kwargs.get("action") == "append"))
        return action

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _flags(parser: ArgumentParser) -> dict[str, Flag]:
    """Long flag name without dashes -> its flag, for every flag a file may set."""
    out = {}
    for flag in parser.flags:
        long = [o for o in flag.action.option_strings if o.startswith("--")]
        if long and flag.action.dest not in ("help", "config"):
            out[long[0][2:]] = flag
    return out


def _value(key: str, flag: Flag, value: Any) -> Any:
    """The value checked against the flag's type and choices; ValueError names what is wrong."""
    action = flag.action
    want = action.type
    if flag.repeatable:  # a list of strings (or one)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ValueError(f"`{key}` must be a string or a list of strings, not {type(value).__name__} {value!r}")
        return items
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        ok, kind = isinstance(value, bool), "true or false"
    elif want is int:
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif want is float:
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    else:
        ok, kind = isinstance(value, str), "a string"
        if ok and want is not None:
            value = want(value)
    if not ok:
        raise ValueError(f"`{key}` must be {kind}, not {type(value).__name__} {value!r}")
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"`{key}` must be one of {', '.join(map(str, action.choices))}, not {value!r}")
    return value


def load_config(parser: ArgumentParser, path: str) -> dict[str, Any]:
    """{dest: value} from the file, for parser.set_defaults; ValueError on any problem."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from None
    flags = _flags(parser)
    unknown = sorted(k for k in data if k.replace("_", "-") not in flags)
    if unknown:
        raise ValueError(f"{path}: unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(flags))})")
    out = {}
    for key, value in data.items():
        flag = flags[key.replace("_", "-")]
        if flag.action.dest in out:
            raise ValueError(f"{path}: `{key}` is set twice")
        try:
            out[flag.action.dest] = _value(key, flag, value)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return out


def parse_with_config(parser: ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parses argv; values from --config FILE stand in for the defaults, so flags override them."""
    parser.add_argument("--config", metavar="FILE",
                        help="a TOML file of these flags' values (max-active = 2, ...); flags given here override it")
    known, _ = parser.parse_known_args(argv)
    if known.config:
        try:
            parser.set_defaults(**load_config(parser, known.config))
        except ValueError as e:  # the message says it all: no usage text
            parser.exit(EXIT_USAGE, f"{parser.prog}: error: {e}\n")
    return parser.parse_args(argv)
