"""The pluggy markers of the ``epochal`` project."""

import pluggy

PROJECT = "epochal"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
