"""Horovod's ``horovod.runner.elastic.settings.ElasticSettings``: the elastic arguments of a
launch, as one object (``horovod.run`` builds one; so may code written for Horovod)."""


class ElasticSettings:
    def __init__(self, discovery, min_num_proc, max_num_proc, elastic_timeout, reset_limit,
                 cooldown_range=None, num_proc=None, **kwargs):
        self.discovery = discovery
        self.min_num_proc = min_num_proc
        self.max_num_proc = max_num_proc
        self.elastic_timeout = elastic_timeout
        self.reset_limit = reset_limit
        self.cooldown_range = cooldown_range
        self.num_proc = num_proc
        self.elastic = True
        for name, value in kwargs.items():
            setattr(self, name, value)
