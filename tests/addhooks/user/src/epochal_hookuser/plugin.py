from epochal import hookimpl


class User:
    @hookimpl
    def hh_extra_metrics(self, epoch):
        return {"double_epoch": 2 * epoch}


class Typo:
    @hookimpl
    def hh_extra_metrics(self, epoc):
        return {}
