"""The built-in commands of ``epochal`` other than ``run``, one module per command or group.

:func:`register_commands` adds them to the ``epochal`` group, as a plugin's
``register_commands`` adds its own; every module imports what a command needs only when it runs,
so that ``epochal --help`` stays fast.
"""

from __future__ import annotations

import click

__all__ = ["register_commands"]


def register_commands(cli: click.Group) -> None:
    """Add the built-in commands (``plugins``, ``check-resume``, ``new-plugin``, ``schema``,
    ``hooks``) to *cli*."""
    from epochal.commands.check_resume import check_resume_command
    from epochal.commands.plugins import plugins_command
    from epochal.commands.reference import hooks, new_plugin_command, schema

    for command in (plugins_command, check_resume_command, new_plugin_command, schema, hooks):
        cli.add_command(command)
