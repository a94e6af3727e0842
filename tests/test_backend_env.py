"""worker/backend_env.py: the settings MLX's GPU backends read at start-up, each kept where the
user set it."""

import os

from worker import backend_env


def test_apply_sets_each_setting_the_user_left_unset(monkeypatch):
    for name in backend_env.CUDA_GRAPH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLX_CUDA_GRAPH_CACHE_SIZE", "512")  # the user's own
    backend_env.apply()
    assert os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"] == "512"
    # a long-lived server must not die of MLX's lifetime count of graph-cache misses
    assert os.environ["MLX_ENABLE_CACHE_THRASHING_CHECK"] == "0"
    for name, value in backend_env.CUDA_GRAPH_ENV.items():
        if name != "MLX_CUDA_GRAPH_CACHE_SIZE":
            assert os.environ[name] == value
