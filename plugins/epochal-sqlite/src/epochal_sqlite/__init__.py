"""epochal-sqlite: the training log of every run in a SQLite file (the ``sqlite_log`` plugin).

The plugin class is :class:`epochal_sqlite.plugin.SQLiteLog`; reading a database from Python:
:class:`epochal_sqlite.reader.Reader`. The ``epochal log`` commands are in
:mod:`epochal_sqlite.commands`.
"""

from epochal_sqlite.plugin import SQLiteLog
from epochal_sqlite.reader import Reader
from epochal_sqlite.store import SQLiteLogError

__all__ = ["Reader", "SQLiteLog", "SQLiteLogError"]
