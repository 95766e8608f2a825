"""``python -m trioserve.workers FD``: a front-end worker process (``_worker``)."""

import sys

from ._worker import main

main(sys.argv[1:])
