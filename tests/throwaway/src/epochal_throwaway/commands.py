"""A module plugin adding a subcommand to the epochal CLI."""

import click

from epochal import hookimpl


@hookimpl
def register_commands(cli: click.Group) -> None:
    @cli.command(name="tw-hello")
    @click.argument("who", default="world")
    def hello(who: str) -> None:
        """Say hello (added by the throwaway plugin)."""
        click.echo(f"hello {who} from epochal-throwaway")
