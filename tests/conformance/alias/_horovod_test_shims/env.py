"""``horovod.runner.common.util.env.get_env_rank_and_size``: the process-set test files size
their process sets with it before ``hvd.init()``."""

import os


def get_env_rank_and_size():
    """(rank, size) from the first launcher variables present, as Horovod reads them; (0, 1)
    when none are."""
    for rank_var, size_var in (("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of "
                               f"{rank_var} and {size_var} found in environment")
    return 0, 1
