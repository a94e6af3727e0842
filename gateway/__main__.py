import sys

from gateway.main import run_gateway

sys.exit(run_gateway())
