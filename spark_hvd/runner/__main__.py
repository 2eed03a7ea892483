"""``python -m spark_hvd.runner``: the same as ``spark-hvd-run``."""

import sys

from spark_hvd.runner.launch import main

sys.exit(main())
