"""A module plugin adding a subcommand to the epochal CLI (declared in ``epochal.commands`` too)."""

import click

from epochal import hookimpl


@click.command(name="tw-hello")
@click.argument("who", default="world")
def hello(who: str) -> None:
    """Say hello (added by the throwaway plugin)."""
    click.echo(f"hello {who} from epochal-throwaway")


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(hello)
