import sys

from worker import backend_env

backend_env.apply()  # before MLX is imported

from worker.proc import run_worker  # noqa: E402

sys.exit(run_worker())
