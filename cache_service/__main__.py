import sys

from cache_service.service import run_cache_service

sys.exit(run_cache_service())
