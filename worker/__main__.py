import sys

from worker import backend_env

backend_env.apply()  # before MLX is imported

from worker.distributed import rank  # noqa: E402
from worker.proc import run_worker  # noqa: E402

sys.exit(rank.run_rank(sys.argv[1:]) if rank.requested(sys.argv[1:]) else run_worker())
