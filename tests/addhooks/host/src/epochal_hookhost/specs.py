"""The hook epochal-hookhost adds: other plugins report extra numbers for the epoch's row."""

from epochal import hookspec


@hookspec
def hh_extra_metrics(loop, epoch):
    """Return a dict of numbers to log in the epoch's row under ``extra.``."""
