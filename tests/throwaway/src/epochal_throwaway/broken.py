"""A plugin module that fails to import."""

raise ImportError("epochal_throwaway.broken is broken on purpose")
