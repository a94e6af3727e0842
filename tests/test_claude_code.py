"""Claude Code (the real CLI, when installed: `npm install -g @anthropic-ai/claude-code`) pointed at a
real stack on a tiny random model: every request it sends is taken by /v1/messages' schema (its
fields accepted, none refused by name) and answered. The random model's text is garbage; what is
proven is that strictness does not lock the client out. docs/agents.md records a run on the
embedded model."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from stack import Stack

CLAUDE = shutil.which("claude")
pytestmark = pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed")
NAME = "claude-test-model"  # served as an alias: Claude Code's ANTHROPIC_MODEL


@pytest.fixture(scope="module")
def stack(tiny_llama):
    with Stack(str(tiny_llama), "--served-model-name", NAME, "--api-key", "cc-key", "--max-tokens-cap", "64") as s:
        yield s
    assert s.exit_code == 0, s.log()


def claude(stack, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(HOME=str(tmp_path), ANTHROPIC_BASE_URL=stack.url, ANTHROPIC_API_KEY="cc-key", ANTHROPIC_MODEL=NAME,
               ANTHROPIC_SMALL_FAST_MODEL=NAME, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               CLAUDE_CODE_MAX_OUTPUT_TOKENS="16")
    return subprocess.run([CLAUDE, "-p", "Say hello.", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=240)


def refusals(log: str) -> list[str]:
    return re.findall(r"refused POST /v1/messages: (\d+ \w+)", log)


def test_the_default_request_is_taken_and_only_too_long(stack, tmp_path):
    """Claude Code's full request (25 tools, thinking, context_management, cache_control, a system
    turn mid-conversation) decodes; the tiny model's 2,048-token context is all that refuses it."""
    before = len(refusals(stack.log()))
    r = claude(stack, tmp_path)
    assert r.returncode != 0 and "context limit" in r.stdout + r.stderr
    assert set(refusals(stack.log())[before:]) == {"400 context_length_exceeded"}


def test_a_bare_one_shot_is_served(stack, tmp_path):
    """With a prompt that fits, each request is admitted and answered (the random model runs to
    max_tokens, so Claude Code asks it to go on, then gives up: not a refusal)."""
    log = stack.log()
    admitted, refused = len(re.findall(r"admitted \(messages", log)), len(refusals(log))
    r = claude(stack, tmp_path, "--bare", "--system-prompt", "Be brief.", "--tools", "Read")
    log = stack.log()
    assert len(re.findall(r"admitted \(messages", log)) > admitted and refusals(log)[refused:] == [], r.stdout + r.stderr
    assert "API Error: 4" not in r.stdout + r.stderr
