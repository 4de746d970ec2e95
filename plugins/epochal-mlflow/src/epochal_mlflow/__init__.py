"""epochal-mlflow: every epochal run as an MLflow run (the ``mlflow`` plugin,
:class:`epochal_mlflow.plugin.MLflow`); the sending thread is :mod:`epochal_mlflow.tracker`."""

from epochal_mlflow.plugin import MLflow

__all__ = ["MLflow"]
