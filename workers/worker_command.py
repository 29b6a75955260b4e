"""Moved to workers/commands/worker.py; `workers/cli.py` names this module until the commands
room's cli.py lands (delete at merge)."""

from workers.commands.worker import add_command, run, settings_from_args

__all__ = ["add_command", "run", "settings_from_args"]
