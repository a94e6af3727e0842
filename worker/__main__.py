import sys

from worker.proc import run_worker

sys.exit(run_worker())
