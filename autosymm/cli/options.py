"""The registered ops' command-line options (autosymm.spec.kinds.Option records) as click options.

A command made with :class:`RegistryCommand` takes, besides its own options, those of every
registered op for its use, read off the registry when it runs (so an op registered after import
brings its options): `explain` one call's (``OpSpec.call_options``), `tune` a sweep's
(``OpSpec.sweep_options``). :func:`parsed` turns their texts into the values the ops' records read
(flag -> value); a text an option's parser refuses is a usage error naming the option.
"""

from __future__ import annotations

from typing import Any, Callable

import click

from .. import spec
from ..spec import Option, OpSpec

#: Which options of an op a command takes (OpSpec.call_options or OpSpec.sweep_options).
OptionsOf = Callable[[OpSpec], tuple[Option, ...]]


def registry_options(options_of: OptionsOf) -> dict[str, tuple[Option, list[str]]]:
    """flag -> (its option, the registered ops taking it), in registry order."""
    out: dict[str, tuple[Option, list[str]]] = {}
    for record in spec.registered():
        for option in options_of(record):
            out.setdefault(option.flag, (option, []))[1].append(record.name)
    return out


def _click_option(option: Option, ops: list[str]) -> click.Option:
    text = f"{option.help} ({', '.join(ops)})"
    if option.parse is None:
        return click.Option([option.flag], is_flag=True, default=False, help=text)
    kind = click.Choice(option.choices) if option.choices else str
    return click.Option([option.flag], type=kind, default=option.default, show_default=option.default is not None,
                        help=text)


class RegistryCommand(click.Command):
    """A click command that also takes the registered ops' options ``options_of`` each op."""

    def __init__(self, *args, options_of: OptionsOf, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.options_of = options_of

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        own = {param.name for param in self.params}
        extra = []
        for option, ops in registry_options(self.options_of).values():
            if option.dest in own:
                raise click.ClickException(f"{', '.join(ops)}'s option {option.flag} takes the name of "
                                           f"`autosymm {self.name}`'s own option {option.dest!r}")
            extra.append(_click_option(option, ops))
        return params[:len(self.params)] + extra + params[len(self.params):]


def parsed(opts: dict[str, Any], options_of: OptionsOf) -> dict[str, Any]:
    """flag -> parsed value of every registered op's option given in ``opts`` (click's values by
    name; a switch given is True); a text its option refuses is a usage error naming it."""
    values = {}
    for option, _ in registry_options(options_of).values():
        text = opts.get(option.dest)
        if text is None or text is False:
            continue
        try:
            values[option.flag] = True if option.parse is None else option.parse(text)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=option.flag) from None
    return values


def call_options(record: OpSpec) -> tuple[Option, ...]:
    return record.call_options


def sweep_options(record: OpSpec) -> tuple[Option, ...]:
    return record.sweep_options
