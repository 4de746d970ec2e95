"""PyTorch as a first-class citizen (the ``torch`` extra): the model adapter, streams, state.

- :class:`TorchModel`: a module, its optimizer and loss as an epochal model, with devices,
  precision, gradient accumulation and clipping, and whole-stream metrics.
- :class:`LoaderStream`: a ``torch.utils.data.DataLoader`` as a resumable stream (the loop wraps
  DataLoaders in it by itself).
- :func:`to_plain` / :func:`from_plain`: tensors of every dtype as numpy arrays and JSON values,
  the form in which checkpoints hold them.
- :func:`full_weights`: a model's full weights on rank 0, for a plugin (under FSDP a collective
  that every rank calls).

Importing this package imports torch; the rest of epochal never does.
"""

from epochal.torch.data import LoaderStream
from epochal.torch.model import TorchModel, is_stream_metric
from epochal.torch.state import from_plain, to_plain
from epochal.torch.weights import full_weights

__all__ = ["LoaderStream", "TorchModel", "from_plain", "full_weights", "is_stream_metric", "to_plain"]
