"""`verity generate` and `verity chat`: clients of a running stack over HTTP (stdlib urllib)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Optional

from rich.console import Console

DEFAULT_URL = "http://127.0.0.1:8000"
CHAT_PATH = "/v1/chat/completions"
TIMEOUT_S = 300.0  # per socket read; the gateway sends keep-alives while a request waits

err = Console(stderr=True, highlight=False)


class ServerError(Exception):
    """An OpenAI error object from the server, or a failure to reach it."""

    def __init__(self, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 status: Optional[int] = None):
        super().__init__(message)
        self.message, self.code, self.param, self.status = message, code, param, status

    @classmethod
    def from_body(cls, body: object, status: Optional[int] = None) -> "ServerError":
        e = body.get("error") if isinstance(body, dict) else None
        if not isinstance(e, dict):
            return cls(f"unexpected response: {str(body)[:200]}", status=status)
        return cls(str(e.get("message")), e.get("code"), e.get("param"), status)

    def __str__(self) -> str:
        where = f" {self.status}" if self.status else ""
        extra = ", ".join(f"{k} `{v}`" if k == "param" else f"{k} {v}"
                          for k, v in (("code", self.code), ("param", self.param)) if v)
        return f"error{where}: {self.message}" + (f" ({extra})" if extra else "")


@dataclass
class StreamResult:
    text: str = ""
    reasoning: str = ""  # a thinking model's think block
    finish_reason: Optional[str] = None
    metrics: dict = field(default_factory=dict)
    t_sent: float = 0.0  # perf_counter when the request was sent
    t_first: float = 0.0  # arrival of the first chunk with text
    t_last: float = 0.0  # arrival of the chunk that carried finish_reason


def _post(url: str, body: dict, api_key: Optional[str]):
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream" if body.get("stream") else "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + CHAT_PATH, json.dumps(body).encode(), headers, method="POST")
    try:
        return urllib.request.urlopen(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            raise ServerError.from_body(json.loads(raw), e.code) from None
        except ValueError:
            raise ServerError(f"HTTP {e.code}: {raw[:200].decode(errors='replace')}", status=e.code) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"cannot reach {url}: {reason}") from None


def complete(url: str, body: dict, api_key: Optional[str] = None) -> dict:
    """One non-streamed request; returns the response JSON."""
    with _post(url, {**body, "stream": False}, api_key) as resp:
        return json.loads(resp.read())


def stream_chat(url: str, body: dict, api_key: Optional[str] = None,
                on_text: Callable[[str], None] = lambda s: None,
                on_thinking: Callable[[str], None] = lambda s: None) -> StreamResult:
    """One streamed chat request: calls on_text for each text delta (on_thinking for each of a
    thinking model's reasoning); raises ServerError."""
    out, parts = StreamResult(t_sent=time.perf_counter()), []
    with _post(url, {**body, "stream": True}, api_key) as resp:
        for raw in resp:
            if not raw.startswith(b"data: "):
                continue  # blank separators, ": keep-alive" comments
            data = raw[6:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError.from_body(chunk)
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta", {})
                thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
                if thought:
                    out.reasoning += thought
                    on_thinking(thought)
                text = delta.get("content") or choice.get("text") or ""
                if text:
                    if not parts:
                        out.t_first = now
                    parts.append(text)
                    on_text(text)
                if choice.get("finish_reason"):
                    out.finish_reason, out.t_last = choice["finish_reason"], now
            if "metrics" in chunk:
                out.metrics = chunk["metrics"]
    out.text = "".join(parts)
    if out.finish_reason is None:
        raise ServerError("the stream ended without a finish_reason")
    return out


def format_metrics(mx: dict, finish_reason: Optional[str] = None) -> str:
    if not mx:
        return ""
    parts = [mx.get("mode", "?") + (f" ({mx['draft']})" if mx.get("draft") else ""),
             f"{mx.get('prompt_tokens', 0)} prompt + {mx.get('completion_tokens', 0)} tokens"]
    if mx.get("reused_tokens"):
        parts.append(f"{mx['reused_tokens']} reused")
    parts += [f"ttft {mx.get('ttft_s', 0.0) * 1000:.0f} ms", f"{mx.get('decode_tps', 0.0):.1f} tok/s"]
    if mx.get("drafted"):
        parts.append(f"accepted {mx.get('accepted', 0)}/{mx['drafted']} ({mx.get('accepted', 0) / mx['drafted']:.0%}), "
                     f"budget {mx.get('budget_mean', 0.0):.2f}/cycle over {mx.get('cycles', 0)} cycles, "
                     f"{mx.get('rollbacks', 0)} rollbacks")
    if finish_reason:
        parts.append(f"finish {finish_reason}")
    return " · ".join(parts)


def request_body(args: argparse.Namespace, messages: list[dict]) -> dict:
    body: dict = {"messages": messages}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "mode", "thinking",
                 "max_thinking_tokens"):
        value = getattr(args, name, None)
        if value is not None:
            body[name] = value
    if getattr(args, "ignore_eos", False):
        body["ignore_eos"] = True
    return body


def _api_key(args: argparse.Namespace) -> Optional[str]:
    return args.api_key or os.environ.get("VERITY_API_KEY") or None


def _print_error(e: ServerError) -> None:
    err.print(f"[bold red]{e}[/]", markup=True, soft_wrap=True)


def _print_metrics(result: StreamResult) -> None:
    err.print(format_metrics(result.metrics, result.finish_reason), style="dim", soft_wrap=True, markup=False)


# ---- verity generate ----


def prompt_text(arg: Optional[str]) -> str:
    """The prompt: the argument, or standard input for `-` or when it is omitted and stdin is piped."""
    if arg == "-" or (arg is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if arg is None:
        raise ServerError("no prompt: give it as an argument, or `-` (or a pipe) to read standard input")
    return arg


def run_generate(args: argparse.Namespace) -> int:
    try:
        prompt = prompt_text(args.prompt)
    except ServerError as e:
        _print_error(e)
        return 2
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": prompt}]
    body = request_body(args, messages)
    try:
        if args.json:
            print(json.dumps(complete(args.url, body, _api_key(args)), indent=2, ensure_ascii=False))
            return 0
        result = stream_chat(args.url, body, _api_key(args), on_text=_write, on_thinking=_write_thinking)
    except ServerError as e:
        _end_line()
        _print_error(e)
        return 1
    except KeyboardInterrupt:
        _end_line()
        return 130
    _end_line()
    _print_metrics(result)
    return 0


_wrote = [False]  # whether stdout's last text left the cursor mid-line
_thinking = [False]  # whether a think block is being printed
DIM, UNDIM = "\x1b[2m", "\x1b[22m"


def _write(text: str) -> None:
    if _thinking[0]:  # the answer starts on its own line
        _end_line()
    sys.stdout.write(text)
    sys.stdout.flush()
    _wrote[0] = not text.endswith("\n")


def _write_thinking(text: str) -> None:
    """A thinking model's reasoning: dimmed on a terminal; to stderr when stdout is not one (a pipe
    or a file gets the answer alone)."""
    _thinking[0] = True
    if not sys.stdout.isatty():
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    sys.stdout.write(DIM + text + UNDIM)
    sys.stdout.flush()
    _wrote[0] = not text.endswith("\n")


def _end_line() -> None:
    if _thinking[0] and not sys.stdout.isatty():  # the think block's line, on stderr
        sys.stderr.write("\n")
        sys.stderr.flush()
    _thinking[0] = False
    if _wrote[0]:
        sys.stdout.write("\n")
        sys.stdout.flush()
        _wrote[0] = False


# ---- verity chat ----

CHAT_HELP = "/reset clears the conversation · /mode joint|baseline · /quit (or Ctrl-D) exits · end a line with \\ to continue it"


def _read_message() -> Optional[str]:
    """One user message (lines ending with a backslash continue it); None at EOF."""
    lines, prompt = [], "you> "
    tty = sys.stdin.isatty()
    while True:
        line = input(prompt if tty else "")
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = "...> "
            continue
        lines.append(line)
        return "\n".join(lines)


def joint_available(args: argparse.Namespace) -> Optional[bool]:
    """The server's `joint_available` (/v1/verity/info); None when it cannot be asked."""
    headers = {"Authorization": f"Bearer {_api_key(args)}"} if _api_key(args) else {}
    req = urllib.request.Request(args.url.rstrip("/") + "/v1/verity/info", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return bool(json.loads(r.read()).get("joint_available"))
    except (OSError, ValueError):
        return None


def _switch_mode(args: argparse.Namespace, mode: str) -> None:
    if mode == "joint" and joint_available(args) is False:
        err.print("this server has no draft model: joint mode needs launch-stack --draft", style="dim")
    elif mode in ("joint", "baseline"):
        args.mode = mode
        err.print(f"mode: {mode}", style="dim")
    else:
        err.print(f"mode is {args.mode or 'baseline'}; use /mode joint|baseline", style="dim")


def run_chat(args: argparse.Namespace) -> int:
    """Exits 1 when any request failed (a script can tell), else 0."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    failed = 0
    err.print(CHAT_HELP, style="dim", markup=False)
    while True:
        try:
            text = _read_message()
        except EOFError:
            _end_line()
            print()
            return 1 if failed else 0
        except KeyboardInterrupt:
            print()
            continue
        cmd = text.strip()
        if not cmd:
            continue
        if cmd in ("/quit", "/exit"):
            return 1 if failed else 0
        if cmd == "/reset":
            history = list(system)
            err.print("conversation cleared", style="dim")
            continue
        if cmd.startswith("/mode"):
            _switch_mode(args, cmd[5:].strip())
            continue
        if cmd.startswith("/") and " " not in cmd:
            err.print(f"unknown command {cmd}; {CHAT_HELP}", style="dim", markup=False)
            continue
        history.append({"role": "user", "content": text})
        try:
            result = stream_chat(args.url, request_body(args, history), _api_key(args), on_text=_write,
                                 on_thinking=_write_thinking)
        except ServerError as e:
            _end_line()
            _print_error(e)
            history.pop()
            failed += 1
            continue
        except KeyboardInterrupt:  # closing the connection cancels the request on the server
            _end_line()
            err.print("[interrupted]", style="dim", markup=False)
            history.pop()
            continue
        _end_line()
        history.append({"role": "assistant", "content": result.text})
        _print_metrics(result)


# ---- arguments ----


def _common(p: argparse.ArgumentParser) -> None:
    server = "the server's default (launch-stack's flag, or the model's)"
    p.add_argument("--url", default=os.environ.get("VERITY_URL", DEFAULT_URL), help="the stack ($VERITY_URL)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $VERITY_API_KEY)")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--max-tokens", type=int, default=None, help=f"default: {server}")
    p.add_argument("--temperature", type=float, default=None, help=f"default: {server}")
    p.add_argument("--top-p", type=float, default=None, help=f"default: {server}")
    p.add_argument("--top-k", type=int, default=None, help=f"default: {server}")
    p.add_argument("--min-p", type=float, default=None, help=f"default: {server}")
    p.add_argument("--seed", type=int, default=None, help="default: a random seed")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--mode", choices=("baseline", "joint"), default=None, help="default: baseline")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="ask a thinking model to think (or not); its thinking prints dimmed")
    p.add_argument("--max-thinking-tokens", type=int, default=None, help=f"close the think block after this many tokens (default: {server})")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def add_commands(sub) -> None:
    from cli.config import DefaultsFormatter as fmt
    g = sub.add_parser("generate", help="stream one answer from a running stack", formatter_class=fmt)
    g.add_argument("prompt", nargs="?", default=None, help="the prompt; `-` or a pipe: read standard input")
    _common(g)
    g.add_argument("--json", action="store_true", help="print the whole (non-streamed) response JSON")
    g.set_defaults(run=run_generate)
    c = sub.add_parser("chat", help="interactive chat with a running stack (exits 1 after a failed request)",
                       formatter_class=fmt)
    _common(c)
    c.set_defaults(run=run_chat)
