"""Horovod's ``ElasticSampler`` for ``torch.utils.data.DataLoader``; the index arithmetic is
framework-free (:mod:`spark_hvd.common._elastic_sampler`).

Within an epoch every sample is processed exactly once with respect to the committed model,
however ranks are removed or added, the samples a lost rank had committed included: every rank
knows what every rank processed, because they advance in lockstep. Padding borrows samples from
the next epoch instead of repeating this epoch's.
"""

import torch.utils.data

from ...common._elastic_sampler import ElasticSamplerCore
from ...common.basics import rank, size


def _placement():
    return rank(), size()


class ElasticSampler(ElasticSamplerCore, torch.utils.data.Sampler):
    """Sampler that splits a dataset over the ranks and splits what is left again after every
    reset (Horovod's ``ElasticSampler``, made exact).

    Use it as Horovod's:

    1. Put it in the ``TorchState`` (``TorchState(model, optimizer, sampler=sampler)``).
    2. Call ``sampler.record_batch(batch_idx, batch_size)`` after every step, on every rank,
       with the same ``batch_size``.
    3. Call ``sampler.set_epoch(epoch + 1)`` at the end of each epoch (calling
       ``set_epoch(epoch)`` at its start, as with ``DistributedSampler``, is harmless).

    Args:
        dataset: the dataset (its length must not change, and be the same on every rank).
        shuffle: a new order every epoch (default True).
        seed: the shuffling seed, the same on every rank (default 0).

    ``len(sampler)`` is the number of samples this rank gets in the current split;
    ``processed_num`` the number of this epoch's samples processed by all ranks together.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        ElasticSamplerCore.__init__(self, len(dataset), shuffle=shuffle, seed=seed,
                                    placement=_placement)
