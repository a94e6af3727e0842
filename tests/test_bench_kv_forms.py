"""bench/kv_forms.py: both attention forms over a quantized slab, timed, each checked against a
float32 reference computed on the CPU from the same packed values."""

from bench import kv_forms


def test_both_forms_are_timed_and_near_the_float32_reference_on_this_machine():
    out = kv_forms.row(kv_forms.SMALL, ctx=64, rows=2, width=3, reps=2)
    for bits in (4, 8):
        for form in ("quantized", "dequantized"):
            assert out[f"q{bits}_{form}_ms"] > 0
            # bf16 inputs and scores: a few per cent of the largest output at most, not a wrong result
            assert 0 <= out[f"q{bits}_{form}_error"] < 0.1, (bits, form, out)
    assert out["q4_dequantized_error"] < 0.03  # unpacked, MLX's attention keeps float32 inside
