"""Allgathers its rank through the launcher's rendezvous server (twice) and prints the result."""
import os

from spark_hvd.common._rendezvous import rendezvous_from_env

rdv = rendezvous_from_env()
rank = int(os.environ["SPARK_HVD_RANK"])
first = rdv.allgather(str(rank).encode())
second = rdv.allgather(f"r{rank * 10}".encode())
print("allgather", ",".join(v.decode() for v in first), ",".join(v.decode() for v in second))
rdv.client.close()
