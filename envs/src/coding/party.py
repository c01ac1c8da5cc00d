# troupe's party: runs one agent's generated code in its own sandboxed process (after wire.py;
# python3 -I -S -B -c ...) and answers the judge's calls of one function with plain values.
#
# Its job (the program, the prompt's definitions, which function it serves) comes on stdin;
# it never sees the tests. Requests come on file descriptor 3, answers go on 4 (wire.py's
# messages). Where the judge links a helper agent, the name of the helper is bound to a proxy
# whose calls go through the judge to the helper's own process, where the judge counts them.
#
# Nothing here is trusted: the code it runs can replace any of it. The judge decodes whatever
# arrives strictly and decides everything itself.
import builtins
import signal
import sys


class CallTimeout(BaseException):
    pass


class CallAbandoned(BaseException):
    pass


def _on_alarm(signum, frame):
    raise CallTimeout()


_link = Link(3, 4)
_pending = []


def _make_helper_proxy(name):
    def proxy(*args, **kwargs):
        _link.send({"k": "helper", "args": wire_encode(list(args)), "kwargs": wire_encode(dict(kwargs))})
        while True:
            message = _link.receive()
            if message is None:
                raise SystemExit(0)
            if message.get("k") == "helper_reply":
                break
            # The judge gave up on the call in progress and sent the next one.
            _pending.append(message)
            raise CallAbandoned()
        if message.get("ok"):
            return wire_decode(message.get("value"))
        kind = getattr(builtins, str(message.get("type")), None)
        text = str(message.get("message"))
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(text)
        raise RuntimeError(text)

    proxy.__name__ = name
    return proxy


def _strip_stub(source, entry):
    import ast

    tree = ast.parse(source)
    tree.body = [n for n in tree.body if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry)]
    return compile(tree, "<prompt>", "exec")


def main():
    job = _json.loads(sys.stdin.read())
    serves = job["serves"]
    # Not "__main__": generated code often has a demo block that reads stdin.
    scope = {"__name__": "solution", "__builtins__": builtins}
    if job.get("helper"):
        scope[job["helper"]] = _make_helper_proxy(job["helper"])
    try:
        preamble = job.get("preamble") or ""
        if preamble:
            exec(_strip_stub(preamble, job.get("entry_point") or serves), scope)
        exec(compile(job["program"], "<solution>", "exec"), scope)
        function = scope.get(serves)
        if not callable(function):
            raise NameError(f"no function {serves!r} after running the code")
    except BaseException as error:
        _link.send({"k": "load_error", "type": type(error).__name__, "message": str(error)[:300]})
        return
    _link.send({"k": "ready"})
    limit = float(job.get("call_timeout_s") or 0)
    signal.signal(signal.SIGALRM, _on_alarm)
    while True:
        message = _pending.pop(0) if _pending else _link.receive()
        if message is None:
            return
        if message.get("k") != "call":
            continue
        ident = message.get("id")
        try:
            args = wire_decode(message.get("args"))
            kwargs = wire_decode(message.get("kwargs"))
            if limit > 0:
                signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                value = function(*args, **kwargs)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            reply = {"k": "return", "id": ident, "value": wire_encode(value)}
        except CallTimeout:
            reply = {"k": "raise", "id": ident, "type": "timed out", "message": ""}
        except NotPlain as error:
            reply = {"k": "raise", "id": ident, "type": "TypeError", "message": f"{serves} returned {error}"}
        except BaseException as error:
            reply = {"k": "raise", "id": ident, "type": type(error).__name__, "message": str(error)[:300]}
        try:
            _link.send(reply)
        except (NotPlain, RecursionError, ValueError):
            _link.send({"k": "raise", "id": ident, "type": "TypeError", "message": "the result could not be sent"})


main()
