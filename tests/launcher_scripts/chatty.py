"""Writes many long lines fast, to both streams, to check lines never get mixed."""
import os
import sys

rank = os.environ["SPARK_HVD_RANK"]
line = (rank * 3000) + "\n"
for i in range(200):
    sys.stdout.write(line)
    sys.stderr.write(line)
sys.stdout.write("no newline at the end")
