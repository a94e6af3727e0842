"""Distillation of the embedded draft: its training code, prompt lists and cost measurements."""
