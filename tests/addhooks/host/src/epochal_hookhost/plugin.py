import json
import os

from epochal import hookimpl
from epochal_hookhost import specs


class Host:
    """Calls hh_extra_metrics after every epoch and logs what the implementations return."""

    epochal_hookspecs = specs

    @hookimpl
    def after_epoch(self, loop):
        results = loop.plugin_set.hook.hh_extra_metrics(loop=loop, epoch=loop.epoch)
        for result in results:
            for key, value in result.items():
                loop.log.current_row[f"extra.{key}"] = value
        with open(os.environ["EPOCHAL_HH_OUT"], "a") as out:
            out.write(json.dumps({"epoch": loop.epoch, "results": results}) + "\n")
