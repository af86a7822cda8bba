#!/usr/bin/env python3
"""Smoke test of the built components (target/plugins/*.wasm) under a real
wasmtime (the `wasmtime` package from PyPI), independent of Pagoda's host.

It links the `pagoda:plugin/host` imports and WASI p2, instantiates every
component once per "request" as the host does, and checks each plugin's
metadata and hooks, and that the hostile fixtures fail the way the host's
tests expect (trap, out of memory, endless loop stopped by an epoch
deadline, 10 MB outputs).

Run by `scripts/build-plugins.sh --smoke`, or directly:
    python3 plugins/smoke_test.py [target/plugins]
"""

import json
import os
import sys
import threading
import time

import wasmtime
from wasmtime import component as wc

PLUGINS = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "target", "plugins")

engine_config = wasmtime.Config()
engine_config.epoch_interruption = True
ENGINE = wasmtime.Engine(engine_config)

failures = []
passed = 0


def check(name, cond, detail=""):
    global passed
    if cond:
        passed += 1
    else:
        failures.append(f"{name}: {detail}")
        print(f"FAIL {name}: {detail}")


class Request:
    """One instance of one component, with the host state of a request."""

    def __init__(self, component, config="{}", memory_limit=None):
        self.config = config
        self.logs = []
        self.store = wasmtime.Store(ENGINE)
        self.store.set_epoch_deadline(1_000_000)
        if memory_limit is not None:
            self.store.set_limits(memory_size=memory_limit)
        self.store.set_wasi(wasmtime.WasiConfig())
        linker = wc.Linker(ENGINE)
        linker.add_wasip2()
        with linker.root() as root:
            with root.add_instance("pagoda:plugin/host@0.1.0") as host:
                host.add_func("log", self._log)
                host.add_func("config", lambda store: self.config)
                host.add_func("facts", self._facts)
        self.instance = linker.instantiate(self.store, component)

    def _log(self, store, level, message):
        self.logs.append((level, message))

    def _facts(self, store):
        f = wc.Record()
        for k, v in {"tenant-id": "t1", "request-id": "r1", "models": ["smol", "big"],
                     "prompt-tokens": 0, "completion-tokens": 0}.items():
            setattr(f, k, v)
        return f

    def call(self, name, *args):
        func = self.instance.get_func(self.store, name)
        assert func is not None, f"no export {name}"
        out = func(self.store, *args)
        func.post_return(self.store)
        return out


def decision(d):
    """A route-decision as (case, payload). wasmtime-py represents this
    variant untagged, by payload type: None, a Record or a str."""
    if d is None:
        return "continue", None
    if isinstance(d, str):
        return "modify", d
    return "reject", d


def ok(result):
    """The payload of a result that must be `ok`."""
    assert isinstance(result, wc.Variant) and result.tag == "ok", result
    return result.payload


def load(name):
    return wc.Component.from_file(ENGINE, os.path.join(PLUGINS, f"{name}.wasm"))


def hooks_of(meta):
    return sorted(str(h) for h in meta.hooks)


def test_metadata(components):
    expected = {
        "tag-v1": ("tag", "1.0.0", ["on-chunk", "post-process"]),
        "tag-v2": ("tag", "2.0.0", ["on-chunk", "post-process"]),
        "router": ("router", "0.1.0", ["route"]),
        "redact": ("redact", "0.1.0", ["on-chunk", "post-process"]),
        "chat-template": ("chat-template", "0.1.0", ["render-prompt"]),
        "starter": ("starter", "0.1.0", ["route"]),
        "loop": ("loop", "0.1.0", ["route"]),
        "oom": ("oom", "0.1.0", ["route"]),
        "trap": ("trap", "0.1.0", ["route"]),
        "big-output": ("big-output", "0.1.0", ["on-chunk", "post-process"]),
    }
    for file, (name, version, hooks) in expected.items():
        r = Request(components[file])
        check(f"{file} abi", r.call("abi-version") == 1)
        m = r.call("metadata")
        got = (m.name, m.version, hooks_of(m))
        check(f"{file} metadata", got == (name, version, hooks), got)
        if m.__dict__["config-schema"]:
            json.loads(m.__dict__["config-schema"])  # must be JSON


def test_tag(components):
    for file, tag in [("tag-v1", " [v1]"), ("tag-v2", " [v2]")]:
        r = Request(components[file])
        out = ok(r.call("post-process", 0, "hello"))
        check(f"{file} post-process", out == "hello" + tag, out)
        pieces = [r.call("on-chunk", 0, "a", False), r.call("on-chunk", 0, "b", True)]
        check(f"{file} on-chunk", pieces == ["a", "b" + tag], pieces)
    r = Request(components["tag-v1"], config='{"tag": " <x>"}')
    check("tag config", ok(r.call("post-process", 0, "hi")) == "hi <x>")


def route(component, body, config="{}", endpoint="/v1/chat/completions"):
    r = Request(component, config=config)
    d = r.call("route", json.dumps({"endpoint": endpoint, "body": body}))
    return decision(d), r


def test_router(components):
    config = json.dumps({"aliases": {"fast": "smol"}, "allowed_models": ["smol"],
                         "max_tokens_limit": 256, "temperature_max": 1.0,
                         "reject_message": "Nope.", "blocked_words": ["forbidden"]})
    msgs = [{"role": "user", "content": "hello"}]
    d, _ = route(components["router"], {"model": "smol", "messages": msgs, "max_tokens": 5}, config)
    check("router continue", d[0] == "continue", d)
    d, _ = route(components["router"], {"model": "fast", "messages": msgs, "max_tokens": 999,
                                        "temperature": 3}, config)
    body = json.loads(d[1]) if d[0] == "modify" else None
    check("router modify", body == {"model": "smol", "messages": msgs, "max_tokens": 256,
                                    "temperature": 1.0}, d)
    d, _ = route(components["router"], {"model": "big", "messages": msgs}, config)
    check("router 403", d[0] == "reject" and d[1].status == 403, d)
    d, _ = route(components["router"], {"model": "nope", "messages": msgs}, config)
    check("router 404", d[0] == "reject" and d[1].status == 404, d)
    d, _ = route(components["router"], {"model": "smol", "prompt": "a forbidden word"}, config,
                 endpoint="/v1/completions")
    check("router blocked", d[0] == "reject" and (d[1].status, d[1].message) == (400, "Nope."), d)


def test_starter(components):
    d, r = route(components["starter"], {"model": "smol", "messages": [{"role": "user", "content": "hi"}]})
    body = json.loads(d[1]) if d[0] == "modify" else {}
    check("starter modify", body.get("messages", [{}])[0].get("role") == "system", d)
    check("starter log", len(r.logs) == 1 and "smol" in r.logs[0][1], r.logs)
    d, r = route(components["starter"], {"model": "smol", "messages": []}, config='{"system_prompt": 5}')
    check("starter bad config -> 500", d[0] == "reject" and d[1].status == 500, d)
    check("starter bad config logged", any("route failed" in m for _, m in r.logs), r.logs)


def test_chat_template(components):
    r = Request(components["chat-template"], config=json.dumps({"system_prompt": "Be brief."}))
    tmpl = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    out = ok(r.call("render-prompt", json.dumps({"messages": [{"role": "user", "content": "Hi"}]}), tmpl))
    check("chat-template render", out == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>", out)
    r = Request(components["chat-template"], config=json.dumps(
        {"template": "{{ raise_exception('bad conversation') }}"}))
    out = r.call("render-prompt", json.dumps({"messages": []}), None)
    check("chat-template raise", out == wc.Variant("err", "bad conversation"), out)


def test_redact(components):
    r = Request(components["redact"])
    out = ok(r.call("post-process", 0, "mail a@b.org or call +1 555 123 4567"))
    check("redact post-process", out == "mail [REDACTED] or call [REDACTED]", out)
    streamed = "".join(r.call("on-chunk", 0, p, False) for p in ["write to jo", "hn@exam", "ple.com now"])
    streamed += r.call("on-chunk", 0, "", True)
    check("redact stream", streamed == "write to [REDACTED] now", streamed)


def expect_trap(name, fn, what):
    try:
        fn()
        check(name, False, "no trap")
    except Exception as e:
        check(name, what(str(e)), e)


def test_hostile(components):
    body = json.dumps({"endpoint": "/v1/completions", "body": {"model": "smol", "prompt": "x"}})
    r = Request(components["trap"])
    expect_trap("trap traps", lambda: r.call("route", body), lambda e: "unreachable" in e or "trap" in e.lower())

    r = Request(components["oom"], memory_limit=64 << 20)
    expect_trap("oom traps", lambda: r.call("route", body), lambda e: True)

    r = Request(components["loop"])
    r.store.set_epoch_deadline(1)
    ticker = threading.Timer(0.5, ENGINE.increment_epoch)
    ticker.start()
    started = time.time()
    expect_trap("loop interrupted", lambda: r.call("route", body), lambda e: "interrupt" in e.lower())
    check("loop interrupted in time", time.time() - started < 10)

    r = Request(components["big-output"])
    check("big-output post-process", len(ok(r.call("post-process", 0, "a"))) == 10_000_000)
    check("big-output on-chunk", len(r.call("on-chunk", 0, "a", False)) == 10_000_000)


def main():
    names = ["tag-v1", "tag-v2", "router", "redact", "chat-template", "starter",
             "loop", "oom", "trap", "big-output"]
    components = {n: load(n) for n in names}
    for test in [test_metadata, test_tag, test_router, test_starter, test_chat_template,
                 test_redact, test_hostile]:
        try:
            test(components)
        except Exception as e:  # a crash in one test is a failure, not the end
            check(test.__name__, False, repr(e))
    print(f"{passed} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
