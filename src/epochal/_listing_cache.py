"""A cache of what ``epochal plugins`` lists, so that listing the installed plugins imports none.

Listing the plugins imports and builds every one of them (for its hooks, where it runs, its
place in the call order): most of the command's start-up. The cache keeps the listing's data
(not its text: the table is fitted to the terminal at each call) with what it was made from:

* a key: the interpreter (``sys.executable``, ``sys.version``), ``sys.path`` and every
  ``EPOCHAL_*`` environment variable (``EPOCHAL_PLUGINS`` and
  ``EPOCHAL_DISABLE_PLUGIN_AUTOLOAD`` choose plugins; the others may reach their constructors);
* stamps (modification time in ns and size, or missing) of each ``sys.path`` entry
  (installing or removing a distribution adds or removes its metadata folder there; the idea
  of stevedore's entry-point cache), of each distribution's ``entry_points.txt``, and of every
  module file outside the standard library that building the listing imported, with the
  folders holding them (a plugin installed editable whose code is edited or gains a module).

A hit costs these ``stat`` calls and one small JSON read: no plugin, pluggy, stevedore or
``importlib.metadata`` is imported. A listing is not stored when a plugin failed to load or a
warning was shown while building it (the cause may be what the key cannot see), nor when a
stamped file changed while it was being built.

Files: ``$XDG_CACHE_HOME/epochal/plugins-<key hash>.json`` (else ``~/.cache/epochal``, or the
platform's cache folder), the :data:`KEEP` newest kept. ``EPOCHAL_NO_CACHE=1`` (or ``epochal
plugins --no-cache``) neither reads nor writes it. A cache file that cannot be read, parsed or
written is ignored: the listing is built as without a cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import zlib
from typing import Any

ENV_NO_CACHE = "EPOCHAL_NO_CACHE"
#: the layout of a cache file; a file of another format is a miss.
FORMAT = 1
#: cache files kept (one per interpreter, ``sys.path`` and environment seen).
KEEP = 32
#: every field of a listed plugin (``PluginInfo.as_dict()``) and the JSON types it may hold.
FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "distribution": (str, type(None)),
    "version": (str, type(None)),
    "entry_point": (str, type(None)),
    "status": (str,),
    "error": (str, type(None)),
    "hooks": (list,),
    "position": (int, type(None)),
    "parent": (str, type(None)),
    "offered_by": (list,),
    "rank": (str, type(None)),
    "autoload": (bool, type(None)),
}
#: a file changed this close to (or after) the start of a build may have changed during it.
_SETTLE_NS = 20_000_000

Listing = dict[str, Any]
Stamp = list[int]


def disabled() -> bool:
    """Whether ``EPOCHAL_NO_CACHE`` is set to a true value."""
    return os.environ.get(ENV_NO_CACHE, "").strip().lower() not in ("", "0", "false", "no")


def cache_dir() -> str | None:
    """epochal's cache folder: ``$XDG_CACHE_HOME/epochal`` if set, else the platform's (None
    when there is no home folder to put it in)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(base):
        folder = os.path.join(base, "epochal")
    elif sys.platform == "darwin":
        folder = os.path.expanduser("~/Library/Caches/epochal")
    elif os.name == "nt":
        local = os.environ.get("LOCALAPPDATA") or os.path.expanduser("~\\AppData\\Local")
        folder = os.path.join(local, "epochal", "Cache")
    else:
        folder = os.path.join(os.path.expanduser("~/.cache"), "epochal")
    return folder if os.path.isabs(folder) else None  # "~" left as is: no home


def _entries() -> list[str]:
    """``sys.path`` as folders ("" is the working directory)."""
    return [str(e) if e else os.getcwd() for e in sys.path if isinstance(e, (str, os.PathLike))]


def _key() -> dict[str, Any]:
    return {
        "format": FORMAT,
        "executable": sys.executable,
        "python": sys.version,
        "path": _entries(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("EPOCHAL_")},
    }


def _file(key: dict[str, Any]) -> str | None:
    folder = cache_dir()
    if folder is None:
        return None
    digest = zlib.crc32(json.dumps(key, sort_keys=True).encode("utf-8", "surrogateescape"))
    return os.path.join(folder, f"plugins-{digest:08x}.json")


def _stamp(path: str) -> Stamp:
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return [-1, -1]
    return [status.st_mtime_ns, status.st_size]


def _path_stamps() -> dict[str, Stamp]:
    return {entry: _stamp(entry) for entry in _entries()}


def _metadata_files() -> list[str]:
    """Every distribution's ``entry_points.txt`` (present or not) in the ``sys.path`` folders."""
    files = []
    for entry in _entries():
        try:
            with os.scandir(entry) as found:
                names = [e.name for e in found if e.name.endswith((".dist-info", ".egg-info"))]
        except (OSError, ValueError):
            continue
        files += [os.path.join(entry, name, "entry_points.txt") for name in sorted(names)]
    return files


def _module_files() -> list[str]:
    """The files of every imported module outside the standard library, and their folders."""
    stdlib = os.path.dirname(os.__file__) + os.sep
    files: set[str] = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not os.path.isabs(path):
            continue
        if path.startswith(stdlib) and not any(p in path for p in ("site-packages", "dist-packages")):
            continue
        files.update((path, os.path.dirname(path)))
    return sorted(files)


def _valid(listing: Any) -> bool:
    """Whether *listing* has the shape :func:`store` writes (else the file is not trusted)."""
    if not isinstance(listing, dict) or set(listing) != {"infos", "order", "warnings"}:
        return False
    infos, order, lines = listing["infos"], listing["order"], listing["warnings"]
    if not (isinstance(infos, list) and isinstance(order, dict) and isinstance(lines, list)):
        return False
    for info in infos:
        if not isinstance(info, dict) or set(info) != set(FIELDS):
            return False
        if not all(isinstance(info[name], types) for name, types in FIELDS.items()):
            return False
        if not all(isinstance(item, str) for item in (*info["hooks"], *info["offered_by"])):
            return False
    for names in order.values():
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            return False
    return all(isinstance(line, str) for line in lines)


def load() -> Listing | None:
    """The cached listing if it is still true of what is installed, else None."""
    if disabled():
        return None
    try:
        key = _key()
        path = _file(key)
        if path is None:
            return None
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if data["key"] != key:
            return None
        for path, stamp in data["stamps"]:
            if _stamp(path) != stamp:
                return None
        listing = data["listing"]
    except Exception:  # unreadable, not JSON, another layout: a miss, never an error
        return None
    return listing if _valid(listing) else None


class Build:
    """What :func:`store` compares with: the time a listing started being built and the stamps
    of ``sys.path`` then (an install during the build must not be cached as the old listing)."""

    def __init__(self) -> None:
        self.started_ns = time.time_ns()
        try:
            self.paths: dict[str, Stamp] | None = _path_stamps()
        except (OSError, ValueError):  # no working directory left, say: nothing to cache
            self.paths = None


def store(listing: Listing, build: Build) -> None:
    """Write *listing* for the next :func:`load`, unless it must not be trusted later.

    Never raises for the cache's sake: a cache that cannot be written is no cache.
    """
    if disabled() or build.paths is None or not _valid(listing):
        return
    if any(info["status"] == "failed" for info in listing["infos"]):
        return  # a failure may be transient or come from the environment: not cached
    with contextlib.suppress(OSError, ValueError, TypeError):
        _write(listing, build, build.paths)


def _write(listing: Listing, build: Build, paths: dict[str, Stamp]) -> None:
    if _path_stamps() != paths:
        return
    stamps = [[path, stamp] for path, stamp in paths.items()]
    for path in [*_metadata_files(), *_module_files()]:
        stamp = _stamp(path)
        if stamp[0] > build.started_ns - _SETTLE_NS:
            return  # changed while the listing was being built: maybe not what was imported
        stamps.append([path, stamp])
    key = _key()
    target = _file(key)
    if target is None:
        return
    temporary = f"{target}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # readable by this user only: the key holds the EPOCHAL_* variables' values
        with open(
            os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8"
        ) as handle:
            json.dump({"key": key, "stamps": stamps, "listing": listing}, handle)
        os.replace(temporary, target)  # readers see the old file or the whole new one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _prune(os.path.dirname(target))


def _prune(folder: str) -> None:
    """Delete all but the :data:`KEEP` most recently written cache files."""
    files = []
    with os.scandir(folder) as found:
        for entry in found:
            if entry.name.startswith("plugins-") and entry.name.endswith(".json"):
                files.append((entry.stat().st_mtime_ns, entry.path))
    for _, path in sorted(files, reverse=True)[KEEP:]:
        with contextlib.suppress(OSError):
            os.unlink(path)
