"""Modules built on the meta device, and pretrained weights: materialised where they train.

A ``[model]`` factory may build its module under ``torch.device("meta")`` (shapes, no memory)::

    with torch.device("meta"):
        net = Transformer(args)
    return TorchModel(net, torch.optim.AdamW(net.parameters()), loss_fn, strategy="fsdp")

:class:`Materializer` gives such a module memory where it trains:

- under ``strategy = "fsdp"`` on several processes, after FSDP2 sharded it (``fully_shard`` on
  a meta module makes meta shards): ``to_empty`` then allocates only this rank's shards, and the
  initialiser writes them. No rank ever holds the whole module;
- on one process and under DDP, the whole module when the model is made (DDP then broadcasts
  rank 0's values, as for any module).

The initialiser is torch's convention (FSDP1's, Lightning's): every submodule that holds
parameters or buffers of its own gets its ``reset_parameters()`` called (``nn.Linear``,
``nn.LayerNorm``, ``nn.Embedding``... define one), so a ``reset_parameters`` of the root that
forgets some blocks (pytorch/examples' FSDP2 example) still leaves nothing uninitialised. Or a
function the user names, ``TorchModel(init_weights=fn)``: ``fn(module)`` once per meta module,
after ``to_empty`` (torchtitan's ``init_weights``); under FSDP its parameters are then the
rank's ``DTensor`` shards, which ``torch.nn.init`` functions fill like whole tensors.

DTensor draws each shard's part of one random stream on CUDA (its offset-based generator); on a
CPU mesh (gloo) it draws on each rank alone, so ranks seeded alike would fill every shard with
the same numbers. There each rank initialises from a generator of its own (seeded from one draw
of the global generator, the same on every rank, plus the rank), and the buffers, which FSDP2
does not shard, are then made rank 0's on every rank.

``TorchModel(pretrained=PATH)`` reads weights into the materialised module: a ``.safetensors``
file, a directory of them (Hugging Face's shards), or a ``torch.distributed.checkpoint`` (DCP)
directory. Under FSDP each rank reads only the rows of its shards (a safetensors slice of each
tensor, the file opened per tensor so that at most one tensor's slice of the mapped file is
resident; DCP reads and reshards the saved shards itself): no rank holds a full copy. The
submodules whose tensors the weights cover need no initialiser; the others are initialised
first.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from epochal.errors import ConfigError, EpochalError

__all__ = ["Materializer", "has_meta"]

#: ``init_weights``: a function given each meta module after ``to_empty``.
InitWeights = Callable[[torch.nn.Module], Any]


def has_meta(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of *module* is on the meta device."""
    return any(t.is_meta for t in _tensors(module, recurse=True))


def _tensors(module: torch.nn.Module, recurse: bool) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


def _own(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers *module* holds itself (not its children's), by name."""
    own: dict[str, torch.Tensor] = {n: t for n, t in module._parameters.items() if t is not None}
    own.update((n, t) for n, t in module._buffers.items() if t is not None)
    return own


@contextlib.contextmanager
def _swapping() -> Iterator[None]:
    """``Module._apply`` swaps each tensor in place (``torch.utils.swap_tensors``): the
    parameter objects stay (the optimizer made on the meta module keeps them) and so do tied
    weights (``to_empty`` would give each module a parameter of its own)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _is_dcp(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


class Materializer:
    """What :class:`~epochal.torch.TorchModel` does with meta modules and pretrained weights.

    :param modules: the model's modules by name (each inside its wrappers).
    :param root: their root (the one module, or an ``nn.ModuleDict`` of several): its
        ``state_dict`` names are the names in *pretrained*.
    :param several: whether *root* is the ``nn.ModuleDict`` of several modules (their names
        prefix the state's names).
    :param init_weights: the initialiser of the meta modules (None: each submodule's
        ``reset_parameters``).
    :param pretrained: weights to read into the modules once they have memory.
    :raises ConfigError: one line naming the culprit, before anything is allocated: a meta
        submodule with tensors of its own, no ``reset_parameters`` and no *init_weights* (and not
        all of its tensors in *pretrained*); a *pretrained* path that is no safetensors file,
        directory of them or DCP directory, or whose tensors do not fit the modules.
    """

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module],
        root: torch.nn.Module,
        several: bool,
        init_weights: InitWeights | None,
        pretrained: str | Path | None,
    ) -> None:
        self.root = root
        self.several = several
        #: whether :meth:`finish` ran.
        self.done = False
        self.init_weights = init_weights
        #: the names of the modules on the meta device, still to materialise.
        self.pending = [name for name, module in modules.items() if has_meta(module)]
        self.modules = dict(modules)
        self.pretrained = None if pretrained is None else Path(pretrained)
        #: where each name of the safetensors weights is (empty for DCP).
        self.files: dict[str, Path] = {}
        #: the root's state names the weights hold.
        self.covered: set[str] = set()
        if self.pretrained is not None:
            self._check_pretrained(self.pretrained)
        if self.pending and init_weights is None:
            self._check_initialisers()

    # -- checks -------------------------------------------------------------------------------

    def _check_pretrained(self, path: Path) -> None:
        where = f"TorchModel pretrained {str(path)!r}"
        live = self.root.state_dict(keep_vars=True)
        if _is_dcp(path):  # DCP checks its names and shapes when it loads (every rank)
            self.covered = set(live)
            return
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))
        elif path.is_file() and path.suffix == ".safetensors":
            files = [path]
        else:
            raise ConfigError(
                f"{where}: not a .safetensors file, a directory of them, or a "
                "torch.distributed.checkpoint directory (with a .metadata file)"
                + ("" if path.exists() else " (the path does not exist)")
            )
        if not files:
            raise ConfigError(f"{where}: the directory holds no .safetensors file")
        from safetensors import SafetensorError, safe_open

        for file in files:
            try:
                with safe_open(str(file), "pt") as reader:  # the header only
                    shapes = {k: reader.get_slice(k).get_shape() for k in reader.keys()}  # noqa: SIM118 (no __iter__)
            except (SafetensorError, OSError) as error:
                raise ConfigError(f"{where}: cannot read {file.name}: {error}") from None
            for key, shape in shapes.items():
                if key in self.files:
                    raise ConfigError(f"{where}: {key!r} is in {self.files[key].name} and in {file.name}")
                target = live.get(key)
                if not isinstance(target, torch.Tensor):
                    names = ", ".join(list(live)[:5])
                    raise ConfigError(
                        f"{where}: {file.name} holds {key!r}, which the model has not "
                        f"(its names: {names}{', ...' if len(live) > 5 else ''})"
                    )
                if list(shape) != list(target.shape):
                    raise ConfigError(
                        f"{where}: {key!r} has shape {list(shape)} in {file.name}, "
                        f"the model's {list(target.shape)}"
                    )
                self.files[key] = file
        self.covered = set(self.files)

    def _check_initialisers(self) -> None:
        for name in self.pending:
            for path, sub, own in self._to_initialise(self.modules[name], name):
                if not callable(getattr(sub, "reset_parameters", None)):
                    which = f"module {name!r}" + (f" (its submodule {path!r})" if path else "")
                    raise ConfigError(
                        f"TorchModel {which}: {type(sub).__name__} is on the meta device, holds "
                        f"{', '.join(own)} and has no reset_parameters() to initialise them; define "
                        "one, or give TorchModel init_weights=fn (fn(module) after to_empty)"
                    )

    def _prefix(self, name: str) -> str:
        """The prefix of module *name*'s tensors in the root's names."""
        return f"{name}." if self.several else ""

    def _to_initialise(
        self, module: torch.nn.Module, name: str
    ) -> list[tuple[str, torch.nn.Module, list[str]]]:
        """``(path, submodule, its tensors' names)`` of every submodule holding meta tensors of
        its own that the pretrained weights do not all cover (a module on the meta device)."""
        prefix = self._prefix(name)
        found = []
        for path, sub in module.named_modules():
            own = [n for n, t in _own(sub).items() if t.is_meta]
            full = [f"{prefix}{path}.{n}" if path else f"{prefix}{n}" for n in own]
            if own and not all(key in self.covered for key in full):
                found.append((path, sub, own))
        return found

    # -- materialising ------------------------------------------------------------------------

    def finish(
        self, device: torch.device, sharded: Sequence[str] = (), mesh: Any = None, rank: int = 0
    ) -> None:
        """Materialise the meta modules on *device* (those named in *sharded* as this rank's
        shards over *mesh*, the others whole), then read the pretrained weights. Once."""
        if self.done:
            return
        self.done = True
        if sharded:
            self.materialize(list(sharded), device, mesh, rank)
        self.materialize(list(self.modules), device)
        self.load()

    def materialize(self, names: list[str], device: torch.device, mesh: Any = None, rank: int = 0) -> None:
        """Give the meta modules among *names* memory on *device* and initialise them.

        :param mesh: the ``DeviceMesh`` the modules are sharded over (None: whole modules).
        """
        meta = [name for name in names if name in self.pending]
        if not meta:
            return
        with torch.no_grad():
            todo = {name: self._to_initialise(self.modules[name], name) for name in meta}
            # to_empty gives every tensor new memory: the ones not on the meta device keep their values
            real = [
                (sub, n, t.detach().clone())
                for name in meta
                for sub in self.modules[name].modules()
                for n, t in _own(sub).items()
                if not t.is_meta
            ]
            for name in meta:
                with _swapping():
                    self.modules[name].to_empty(device=device)
            with _rank_generator(mesh, rank):
                for name in meta:
                    if self.init_weights is not None:
                        self.init_weights(self.modules[name])
                    else:
                        for _, sub, _ in todo[name]:
                            sub.reset_parameters()  # type: ignore[operator]
            for sub, n, value in real:
                _own(sub)[n].copy_(value)
            if mesh is not None and mesh.size() > 1:
                for name in meta:  # FSDP2 shards parameters only: the ranks agree on buffers
                    for buffer in self.modules[name].buffers():
                        torch.distributed.broadcast(buffer, src=0)
        self.pending = [name for name in self.pending if name not in meta]

    def load(self) -> None:
        """Read the pretrained weights (if any) into the modules, once they all have memory:
        under FSDP each rank its shards' rows. Every rank calls it (DCP: a collective).

        :raises EpochalError: one line naming the path, when DCP cannot read it into the model.
        """
        path = self.pretrained
        if path is None:
            return
        if not self.files:  # a DCP directory: DCP reads this rank's shards of each tensor
            from torch.distributed.checkpoint.api import CheckpointException

            from epochal.torch.sharded_state import load_from

            try:
                load_from(self.root, [], path, model_only=True)
            except CheckpointException as error:  # a BaseException: DCP's own, not Exception
                why = [line.strip() for line in str(error).splitlines() if line.strip()][-1]
                raise EpochalError(
                    f"TorchModel pretrained {str(path)!r}: DCP cannot load it: {why:.300}"
                ) from None
            return
        from safetensors import safe_open

        live = self.root.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, file in self.files.items():
                with safe_open(str(file), "pt") as reader:  # mapped per tensor: its pages leave with it
                    _read_into(live[key], reader, key)
                del reader


@contextlib.contextmanager
def _rank_generator(mesh: Any, rank: int) -> Iterator[None]:
    """Where DTensor cannot give each shard its part of one random stream (a CPU mesh), draw
    this rank's initial values from a generator of its own (see the module's docstring)."""
    if mesh is None or mesh.size() < 2:
        yield
        return
    try:  # torch's private module: where it moves, the device type decides
        from torch.distributed.tensor._random import is_rng_supported_mesh
    except ImportError:  # pragma: no cover - another torch

        def is_rng_supported_mesh(device_mesh: Any) -> bool:  # type: ignore[misc]
            return bool(device_mesh.device_type != "cpu")

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DTensor random operators may not", UserWarning)
        if is_rng_supported_mesh(mesh):
            yield
            return
        base = int(torch.randint(0, 2**62, (1,)).item())  # the same on every rank
        with torch.random.fork_rng(devices=[]):  # the host's generator only: a CPU mesh draws there
            torch.random.default_generator.manual_seed(base + rank)
            yield


def _read_into(target: torch.Tensor, reader: Any, key: str) -> None:
    """Copy this rank's part of the stored tensor *key* into *target*: the rows of its shard
    (a slice, read from the mapped file alone) for a ``DTensor``, else the whole tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(target, DTensor) or target.dim() == 0:
        target.copy_(reader.get_tensor(key))
        return
    local = target.to_local()
    if local.numel() == 0:
        return
    index = [slice(None)] * target.dim()
    mesh = target.device_mesh
    for axis, placement in enumerate(target.placements):
        if isinstance(placement, Shard):  # torch.chunk's split, as DTensor's and FSDP2's
            dim, ranks = placement.dim, mesh.size(axis)
            step = -(-target.shape[dim] // ranks)
            start = (index[dim].start or 0) + step * mesh.get_local_rank(axis)
            index[dim] = slice(start, start + local.shape[dim])
    local.copy_(reader.get_slice(key)[tuple(index)])
