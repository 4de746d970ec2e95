"""epochal-monitor: the ``monitor`` plugin (per-epoch aggregates of the train step's metrics)."""

from epochal_monitor.plugin import AGGREGATIONS, Monitor, NonFiniteMetricWarning

__all__ = ["AGGREGATIONS", "Monitor", "NonFiniteMetricWarning"]
