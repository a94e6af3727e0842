"""bench/slab_writes.py: the three ways of writing attention slabs side by side; on the CPU every
way is MLX's scatter, and each repeat's joint runs must equal plain's tokens."""

from bench import slab_writes
from worker.kernels import kv_write


def test_each_way_prints_a_repeat_line_with_its_ratios_and_the_served_way_is_restored(capsys):
    assert slab_writes.main(["--small", "--n", "2", "--repeats", "1", "--tokens", "12"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("repeat 0")]
    assert [l.split()[2].rstrip(":") for l in lines] == list(slab_writes.MODES)
    for line in lines:
        assert "plain " in line and " = " in line and "over 3x" in line, line
    assert kv_write.mode() == "wide"


def test_a_way_that_is_not_one_is_refused_by_name():
    import pytest

    with pytest.raises(ValueError, match="slab write mode 'all'"):
        kv_write.set_mode("all")
