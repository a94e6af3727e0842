"""Fault injection for tests that spawn real processes (monkeypatching cannot reach them).

VERITY_FAULT_STEP_DELAY_S  seconds each engine step is slowed by (a slow worker)
VERITY_FAULT_EXIT_ON_JOB   exit code the worker dies with when a job arrives (a crashing worker)
VERITY_FAULT_SUBMIT_DELAY_S  seconds each job's submission is slowed by (a long prompt's tokenizing)
VERITY_FAULT_LONG_SUBMIT_DELAY_S  the same for jobs whose prompts are long (worker/proc.py LONG_PROMPT_BYTES)
VERITY_FAULT_AFTER_QUEUE_DELAY_S  seconds the jobs thread is held once a job is queued (the engine may run it meanwhile)
"""

from __future__ import annotations

import os
import time

STEP_DELAY_S = float(os.environ.get("VERITY_FAULT_STEP_DELAY_S", "0") or 0)
EXIT_ON_JOB = int(os.environ.get("VERITY_FAULT_EXIT_ON_JOB", "0") or 0)
SUBMIT_DELAY_S = float(os.environ.get("VERITY_FAULT_SUBMIT_DELAY_S", "0") or 0)
LONG_SUBMIT_DELAY_S = float(os.environ.get("VERITY_FAULT_LONG_SUBMIT_DELAY_S", "0") or 0)
AFTER_QUEUE_DELAY_S = float(os.environ.get("VERITY_FAULT_AFTER_QUEUE_DELAY_S", "0") or 0)


def after_step() -> None:
    if STEP_DELAY_S:
        time.sleep(STEP_DELAY_S)


def on_job() -> None:
    if EXIT_ON_JOB:
        os._exit(EXIT_ON_JOB)


def before_submit(long_prompt: bool = False) -> None:
    delay = SUBMIT_DELAY_S + (LONG_SUBMIT_DELAY_S if long_prompt else 0.0)
    if delay:
        time.sleep(delay)


def after_queue() -> None:
    if AFTER_QUEUE_DELAY_S:
        time.sleep(AFTER_QUEUE_DELAY_S)
