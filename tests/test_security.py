"""Security: who may reach the server (Host, Origin, API key), what other local users can touch
(runtime directory, sockets, spilled cache files), what the wire and the logs carry."""

from __future__ import annotations

import inspect
import os
import re
import stat
import subprocess
import uuid
from pathlib import Path

import aiohttp
import pytest

from gateway import app as gateway_app
from gateway.guard import Guard, Refused, exposure_warning, is_loopback, split_host
from reliability import ROOT, launch_stack_has, runtime_dir_of, stack_pids
from stack import Stack, until
from test_stack import chat_body

APP_ORIGIN = "http://app.example:5173"
KEY = "sec-key-789"


@pytest.fixture(scope="module")
def plain(tiny_llama, tmp_path_factory):
    """Defaults (loopback, no key, no --log-prompts), spilling cache snapshots to a directory."""
    cache_dir = tmp_path_factory.mktemp("spill") / "cache"
    spill = ("--cache-dir", str(cache_dir)) if launch_stack_has("--cache-dir") else ()
    with Stack(str(tiny_llama), *spill) as s:
        s.cache_dir = cache_dir
        yield s


@pytest.fixture(scope="module")
def open_to_app(tiny_llama):
    with Stack(str(tiny_llama), "--api-key", KEY, "--allow-origin", APP_ORIGIN, "--log-prompts") as s:
        yield s


async def get(url: str, path: str, headers: dict, method: str = "GET", json=None) -> tuple[int, dict, "CIMultiDict"]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url + path, headers=headers, json=json) as r:
            body = await r.json() if r.content_type == "application/json" else {}
            return r.status, body, r.headers.copy()  # case-insensitive


async def test_without_max_active_the_gateway_holds_the_workers_cap(plain):
    """Left out, --max-active is the worker's per-device default, told the gateway in its READY."""
    from worker.memory import default_max_active

    status, info, _ = await get(plain.url, "/v1/verity/info", {})
    assert status == 200 and info["ready"]
    assert (info["max_active"], info["capacity"]) == (default_max_active(), default_max_active() + 16)
    assert "--max-active" not in plain.argv


# ---- Host: DNS rebinding ----


async def test_host_header_must_name_this_server(plain, reliability):
    port = int(plain.url.rsplit(":", 1)[1])
    allowed = [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.1", "LOCALHOST:" + str(port)]
    refused = [f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", f"localhost.evil.example:{port}",
               f"127.0.0.1.nip.io:{port}", f"0.0.0.0:{port}", f"192.168.1.10:{port}", f"[::1]x:{port}", "",
               f"127.0.0.1:{port}:{port}"]
    for host in allowed:
        status, body, _ = await get(plain.url, "/v1/models", {"Host": host})
        assert status == 200, (host, body)
    for host in refused:
        for path in ("/v1/models", "/", "/health", "/metrics", "/openapi.json"):
            status, body, _ = await get(plain.url, path, {"Host": host})
            assert status == 403, (host, path, status)
            assert body["error"]["code"] == "host_not_allowed" and "DNS-rebinding" in body["error"]["message"] \
                or "malformed" in body["error"]["message"], body
    status, body, _ = await get(plain.url, "/v1/chat/completions", {"Host": f"evil.example:{port}"}, "POST",
                                chat_body())
    assert status == 403 and "--allow-host" in body["error"]["message"]
    reliability.record(
        "security", "Host header checked (DNS rebinding)",
        "Requests whose Host is not 127.0.0.1, localhost, [::1] or the bound host (with this server's port, "
        "or none) are refused with 403 `host_not_allowed` on every route: the API, the web UI, /health, "
        "/metrics, /openapi.json.",
        answered=", ".join(allowed), refused=", ".join(h or "(empty)" for h in refused))


def test_guard_rules():
    g = Guard("127.0.0.1", 8000)
    g.check_host("127.0.0.1:8000")
    g.check_host(None)  # not a browser
    with pytest.raises(Refused):
        g.check_host("evil.example:8000")
    wild = Guard("0.0.0.0", 8000, allow_hosts=("myhost.lan",))
    for host in ("192.168.1.5:8000", "[fe80::1]:8000", "myhost.lan:8000", "localhost:8000"):
        wild.check_host(host)  # bound to every interface: IP literals and named hosts
    with pytest.raises(Refused):
        wild.check_host("rebind.evil.example:8000")
    assert split_host("[::1]:80") == ("[::1]", 80) and split_host("LocalHost") == ("localhost", None)
    for bad in ("::1", "a:b:c", "host:", "host:99999", "[::1"):
        with pytest.raises(ValueError):
            split_host(bad)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.9.9.9")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("myhost")


def test_binding_elsewhere_without_a_key_is_loud(reliability):
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    for host in ("0.0.0.0", "::", "192.168.1.2", "myhost.lan"):
        assert "WITHOUT an API key" in exposure_warning(host, None)
    src = inspect.getsource(__import__("cli.launch", fromlist=["main"]).main)
    assert "exposure_warning(" in src and "log.warning" in src
    reliability.record(
        "security", "Loopback by default; a loud warning otherwise",
        "launch-stack binds 127.0.0.1 unless told otherwise; bound to another address or every interface "
        "without an API key, launch-stack and the gateway log a warning framed in `!` (tested on the rule; "
        "the suite binds nothing but loopback).",
        default_host="127.0.0.1")


def test_api_key_is_compared_in_constant_time():
    src = inspect.getsource(gateway_app.errors_and_auth)
    assert "hmac.compare_digest(" in src and "== key" not in src and "key ==" not in src


# ---- Origin: cross-site requests ----


async def test_origins_other_than_the_server_are_refused(plain, open_to_app, reliability):
    same = plain.url
    status, _, _ = await get(plain.url, "/v1/chat/completions", {"Origin": same}, "POST", chat_body())
    assert status == 200  # the web UI at / posts from its own origin
    async with aiohttp.ClientSession() as http:
        async with http.get(plain.url + "/", headers={"Origin": same}) as r:
            assert r.status == 200 and "<html" in (await r.text()).lower()
    refused = ["http://evil.example", "null", "http://localhost:" + plain.url.rsplit(":", 1)[1],
               "https://" + plain.url.split("//")[1], APP_ORIGIN]
    for origin in refused:
        status, body, headers = await get(plain.url, "/v1/chat/completions", {"Origin": origin}, "POST", chat_body())
        assert status == 403 and body["error"]["code"] == "origin_not_allowed", (origin, body)
        assert "--allow-origin" in body["error"]["message"] and "Access-Control-Allow-Origin" not in headers
    status, body, _ = await get(plain.url, "/v1/chat/completions", {"Origin": "http://evil.example",
                                                                    "Access-Control-Request-Method": "POST"}, "OPTIONS")
    assert status == 403
    await until(plain.idle, 10, "idle")
    # --allow-origin: that page may call the API (with the key), CORS headers included
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, headers = await get(open_to_app.url, "/v1/chat/completions",
                                   {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "authorization, content-type"}, "OPTIONS")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert "Authorization" in headers["Access-Control-Allow-Headers"] and "POST" in headers["Access-Control-Allow-Methods"]
    status, body, headers = await get(open_to_app.url, "/v1/chat/completions", {"Origin": APP_ORIGIN, **auth},
                                      "POST", chat_body(stream=False))
    assert status == 200 and headers["Access-Control-Allow-Origin"] == APP_ORIGIN, body
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"]
    status, _, headers = await get(open_to_app.url, "/v1/chat/completions", {"Origin": APP_ORIGIN}, "POST", chat_body())
    assert status == 401 and headers["Access-Control-Allow-Origin"] == APP_ORIGIN  # the page can read why
    status, _, _ = await get(open_to_app.url, "/v1/models", {"Origin": "http://evil.example", **auth})
    assert status == 403  # the key does not make another origin welcome
    reliability.record(
        "security", "Cross-site requests refused (Origin)",
        "A request carrying an Origin other than the server's own (the web UI) or an --allow-origin one is "
        "refused with 403 `origin_not_allowed`, preflights too; allowed origins get CORS headers.",
        refused=", ".join(refused), same_origin_ui="served", allowed_with_flag=APP_ORIGIN)


# ---- what other local users can touch ----


async def test_runtime_dir_sockets_and_cache_files_are_private(plain, reliability):
    pids = stack_pids(plain.proc.pid)
    rdir = Path(runtime_dir_of(pids["worker"]))
    assert f"runtime directory {rdir}" in plain.log()  # launch-stack names it
    for body in (chat_body("the quick brown fox"), chat_body("the quick brown fox")):
        assert (await get(plain.url, "/v1/chat/completions", {}, "POST", body))[0] == 200
    st = rdir.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    socks = sorted(rdir.glob("*.sock"))
    assert {p.name for p in socks} >= {"jobs.sock", "control.sock", "events.sock", "supervisor.sock"}
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in socks}
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 and p.stat().st_uid == os.getuid() for p in socks), modes
    cache_files = [p for p in plain.cache_dir.rglob("*")] if plain.cache_dir.exists() else []
    loose = [str(p) for p in cache_files if stat.S_IMODE(p.stat().st_mode) & 0o077]
    assert not loose, loose
    reliability.record(
        "security", "Runtime directory, sockets and cache files private",
        "While a stack runs: its runtime directory (named in launch-stack's log) is mode 0700 and owned by "
        "the user; every ipc socket in it and every file under --cache-dir has no group or other "
        "permission bits (launch-stack sets umask 077 for the whole stack).",
        runtime_dir="0o700", sockets=modes, cache_dir_entries_checked=len(cache_files))


def test_no_pickle_on_the_wire():
    pattern = re.compile(r"\b(c?pickle|dill|cloudpickle|marshal|shelve|jsonpickle)\b|allow_pickle\s*=\s*True")
    hits = []
    for folder in ("protocol", "gateway", "worker", "cache_service", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, hits


# ---- the logs ----


async def test_prompts_stay_out_of_the_log_unless_asked(plain, open_to_app, reliability):
    marker = f"secret-{uuid.uuid4().hex}"
    body = chat_body(f"my password is {marker}")
    status, _, headers = await get(plain.url, "/v1/chat/completions", {}, "POST", body)
    assert status == 200
    rid = headers["X-Request-Id"]
    status, _, _ = await get(plain.url, "/v1/completions", {}, "POST", {"prompt": marker, "max_tokens": 2})
    assert status == 200
    status, _, _ = await get(plain.url, "/v1/chat/completions", {}, "POST", {**body, "temperature": 7})
    assert status == 400
    await until(lambda: f"[{rid}] finished" in plain.log(), 10, "the request's last log line")
    assert marker not in plain.log()
    status, _, _ = await get(open_to_app.url, "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}, "POST", body)
    assert status == 200
    await until(lambda: marker in open_to_app.log(), 10, "the prompt in the log of a --log-prompts stack")
    assert KEY not in open_to_app.log()
    reliability.record(
        "security", "No prompt text in logs unless --log-prompts",
        "A unique marker sent as a chat message, as a completion prompt and in a refused request never appears "
        "in the stack's whole log (launch-stack, gateway, worker, cache service); with --log-prompts it does. "
        "The API key never appears.",
        marker_in_default_log=False, marker_in_log_prompts_log=True)


async def test_request_id_follows_the_request_through_every_process(plain, reliability):
    status, body, headers = await get(plain.url, "/v1/chat/completions", {}, "POST", chat_body())
    rid = headers["X-Request-Id"]
    assert status == 200 and body["id"] == rid
    await until(lambda: f"[{rid}] finished" in plain.log(), 10, "the gateway's last line for the request")
    lines = [line for line in plain.log().splitlines() if rid in line]
    processes = {line.split()[2] for line in lines}
    assert {"gateway", "worker"} <= processes, lines
    reliability.record(
        "security", "A request id through every process's log",
        "The id the client gets (X-Request-Id and the response's `id`) is the id the worker is sent; the log "
        "has it in the gateway's and the worker's lines, and no prompt text.",
        lines_with_the_id=len(lines), processes=", ".join(sorted(processes)))


def test_launch_stack_help_names_the_limits():
    out = subprocess.run([str(Path(os.sys.executable).parent / "launch-stack"), "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    for flag in ("--max-body-bytes", "--max-tokens-cap", "--request-timeout-s", "--allow-origin", "--allow-host",
                 "--log-prompts", "--api-key"):
        assert flag in out


def test_repeatable_flags_from_a_config_file(tmp_path):
    from cli.launch import parse_args

    conf = tmp_path / "v.toml"
    conf.write_text('allow-origin = ["http://a.example:1", "http://b.example:2"]\nallow-host = "myhost.lan"\n'
                    'log-prompts = true\nrequest-timeout-s = 30\n')
    a = parse_args(["--config", str(conf), "--allow-origin", "http://c.example:3"])
    assert a.allow_origin == ["http://a.example:1", "http://b.example:2", "http://c.example:3"]
    assert (a.allow_host, a.log_prompts, a.request_timeout_s) == (["myhost.lan"], True, 30.0)
    conf.write_text("allow-origin = [1]\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(conf)])
