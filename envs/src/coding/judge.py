# troupe's judge, run in its own sandboxed process after wire.py (python3 -I -S -B -c ...).
#
# It alone holds the problem's tests, reads its job on stdin (invisible to other processes),
# and reports on file descriptor 3, which no other process holds. The generated code runs in
# separate processes (party.py): the main program answers calls of the function under test on
# descriptors 4/5, the helper agent's program (when there is one) calls of the helper on 6/7.
# They send back only plain values (wire.py), so every comparison in the tests is made here,
# on objects of the exact builtin types, and no object of theirs ever runs code in this one.
#
#   1. parse the programs with `ast` and report how main uses the helper (cooperation schemes),
#      running nothing;
#   2. wait until the parties have loaded their programs;
#   3. run the prompt's own definitions (imports, given functions; not the stub) and the test
#      code here, with the function under test replaced by a proxy that calls the main party;
#   4. run the test's `check(candidate)` body statement by statement, so that each assert
#      passes or fails on its own; count the helper calls the main party makes through this
#      process while the tests run (a call in dead code is never made, so never counted).
import ast
import builtins
import signal
import sys

try:  # Not dumpable: a process of the same user cannot open /proc/<this pid>/fd or mem.
    import ctypes

    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass

_channel = _os.fdopen(3, "w", buffering=1)


def report(**event):
    _channel.write(_json.dumps(event) + "\n")
    _channel.flush()


class AssertTimeout(BaseException):
    pass


class PartyGone(Exception):
    pass


class CallTimeout(BaseException):
    """A party's own time limit stopped a call (unlike AssertTimeout, this process's alarm)."""


def _on_alarm(signum, frame):
    raise AssertTimeout()


def _bound_names(args):
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if args.vararg:
        names.append(args.vararg.arg)
    if args.kwarg:
        names.append(args.kwarg.arg)
    return names


def _walk_with_fields(node, chain):
    """Yields (node, chain) for every descendant; chain lists (ancestor, field) from the top."""
    for field, value in ast.iter_fields(node):
        children = value if isinstance(value, list) else [value]
        for index, child in enumerate(children):
            if isinstance(child, ast.AST):
                link = chain + [(node, field, index)]
                yield child, link
                yield from _walk_with_fields(child, link)


LOOP_CALLS = {"map", "sorted", "min", "max", "sum", "any", "all", "reduce", "starmap"}
FILTER_CALLS = {"filter", "filterfalse", "takewhile", "dropwhile"}


def analyze(tree, entry, helper):
    result = {
        "defines_entry": False,
        "defines_helper": False,
        "helper_called": False,
        "helper_shadowed": False,
        "wrapper": False,
        "ignored_result": False,
        "schemes": {"fallback": 0, "decorator": 0, "coordinator": 0, "strategy_filter": 0},
    }
    main = None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == entry:
                main = node
            if helper and node.name == helper:
                result["defines_helper"] = True
    result["defines_entry"] = main is not None
    if main is None or not helper or not result["defines_helper"]:
        return result
    if helper in _bound_names(main.args):
        result["helper_shadowed"] = True
    for node, _ in _walk_with_fields(main, []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == helper:
            result["helper_shadowed"] = True
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and helper in _bound_names(node.args):
            result["helper_shadowed"] = True
        elif isinstance(node, ast.Name) and node.id == helper and isinstance(node.ctx, (ast.Store, ast.Del)):
            result["helper_shadowed"] = True
        elif isinstance(node, ast.alias) and (node.asname or node.name) == helper:
            result["helper_shadowed"] = True
    if result["helper_shadowed"]:
        return result
    body = [s for s in main.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))]
    uses = []
    for node, chain in _walk_with_fields(main, []):
        if not (isinstance(node, ast.Name) and node.id == helper and isinstance(node.ctx, ast.Load)):
            continue
        parent, field, _ = chain[-1]
        if isinstance(parent, ast.Call) and field == "func":
            uses.append(("call", parent, chain[:-1]))
        else:
            uses.append(("reference", node, chain))
    if not uses:
        return result
    result["helper_called"] = True
    if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call):
        func = body[0].value.func
        result["wrapper"] = isinstance(func, ast.Name) and func.id == helper
    schemes = result["schemes"]
    for kind, node, chain in uses:
        in_try = in_loop = in_condition = False
        first_generator = True
        for ancestor, field, index in chain:
            if isinstance(ancestor, (ast.Try,) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())):
                if field in ("body", "handlers", "orelse"):
                    in_try = True
            elif isinstance(ancestor, (ast.For, ast.AsyncFor)) and field == "body":
                in_loop = True
            elif isinstance(ancestor, ast.While):
                if field == "body":
                    in_loop = True
                if field == "test":
                    in_loop = in_condition = True
            elif isinstance(ancestor, (ast.If, ast.IfExp)) and field == "test":
                in_condition = True
            elif isinstance(ancestor, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                if field in ("elt", "key", "value"):
                    in_loop = True
            elif isinstance(ancestor, ast.comprehension):
                if field == "ifs":
                    in_loop = in_condition = True
                elif field == "iter" and not first_generator:
                    in_loop = True
            if isinstance(ancestor, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)) and field == "generators":
                first_generator = index == 0
        if kind == "reference":
            parent = chain[-1][0]
            if isinstance(parent, (ast.Call, ast.keyword)):
                call = parent if isinstance(parent, ast.Call) else (chain[-2][0] if len(chain) > 1 else None)
                name = None
                if isinstance(call, ast.Call):
                    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
                if name in FILTER_CALLS:
                    in_condition = True
                elif name in LOOP_CALLS or (isinstance(parent, ast.keyword) and parent.arg == "key"):
                    in_loop = True
        if in_try:
            schemes["fallback"] += 1
        if in_loop:
            schemes["coordinator"] += 1
        if in_condition:
            schemes["strategy_filter"] += 1
        if kind == "call":
            parent = chain[-1][0] if chain else None
            if isinstance(parent, ast.Expr):
                result["ignored_result"] = True
            elif not (in_try or in_loop or in_condition) and not result["wrapper"]:
                schemes["decorator"] += 1
    return result


def _segment(source, node):
    text = ast.get_source_segment(source, node) or ast.dump(node)
    text = " ".join(text.split())
    return text if len(text) <= 200 else text[:197] + "..."


def _error_text(error):
    if isinstance(error, (AssertTimeout, CallTimeout)):
        return "timed out"
    text = type(error).__name__
    message = str(error)
    return f"{text}: {message}"[:300] if message else text


def _raised(name, message):
    """The exception a party reported, as one of Python's own (never a class it could define)."""
    if name == "timed out":
        return CallTimeout()
    kind = getattr(builtins, name, None) if type(name) is str else None
    text = str(message)[:300] if type(message) is str else ""
    if isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins":
        try:
            return kind(text)
        except Exception:
            pass
    return RuntimeError(f"{str(name)[:60]}: {text}")


class State:
    in_tests = False
    helper_calls = 0


class Party:
    """A process running generated code: the calls it answers, the helper calls it makes."""

    def __init__(self, read_fd, write_fd, label):
        self.link = Link(read_fd, write_fd)
        self.label = label
        self.next_id = 0
        self.serves_helper = None

    def wait_ready(self):
        """None once loaded, else (error type, message)."""
        while True:
            message = self._next()
            kind = message.get("k")
            if kind == "ready":
                return None
            if kind == "load_error":
                return (str(message.get("type")), str(message.get("message"))[:300])
            if kind == "helper":
                self._serve_helper(message)

    def _next(self):
        try:
            message = self.link.receive()
        except NotPlain as error:
            raise PartyGone(f"the {self.label} sent a malformed message ({error})")
        except RecursionError:
            raise PartyGone(f"the {self.label} sent a message nested too deeply")
        except ValueError as error:
            raise PartyGone(f"the {self.label} sent a malformed message ({error})")
        if message is None:
            raise PartyGone(f"the {self.label} process ended")
        return message

    def _serve_helper(self, message):
        helper = self.serves_helper
        if helper is None:
            self.link.send({"k": "helper_reply", "ok": False, "type": "NameError", "message": "no helper agent"})
            return
        if State.in_tests:
            State.helper_calls += 1
        try:
            value = helper.call(wire_decode(message.get("args")), wire_decode(message.get("kwargs") or {"d": []}))
            reply = {"k": "helper_reply", "ok": True, "value": wire_encode(value)}
        except AssertTimeout:
            raise
        except CallTimeout:
            reply = {"k": "helper_reply", "ok": False, "type": "TimeoutError", "message": "the helper timed out"}
        except BaseException as error:
            reply = {"k": "helper_reply", "ok": False, "type": type(error).__name__, "message": str(error)[:300]}
        self.link.send(reply)

    def call(self, args, kwargs):
        if type(args) is not list or type(kwargs) is not dict:
            raise TypeError("malformed call")
        self.next_id += 1
        ident = self.next_id
        try:
            self.link.send({"k": "call", "id": ident, "args": wire_encode(list(args)), "kwargs": wire_encode(dict(kwargs))})
        except NotPlain as error:
            raise TypeError(f"the test passes a value the {self.label} cannot receive: {error}")
        except OSError:
            raise PartyGone(f"the {self.label} process ended")
        while True:
            message = self._next()
            kind = message.get("k")
            if kind == "helper":
                self._serve_helper(message)
                continue
            if message.get("id") != ident:
                continue  # a late answer to a call that timed out
            if kind == "return":
                try:
                    return wire_decode(message.get("value"))
                except (NotPlain, RecursionError, ValueError, TypeError) as error:
                    raise TypeError(f"the {self.label} returned no plain value ({error})")
            if kind == "raise":
                raise _raised(message.get("type"), message.get("message"))
            raise PartyGone(f"the {self.label} sent an unknown message")


class Candidate:
    """What the tests call instead of the generated function."""

    def __init__(self, party, name):
        self._party = party
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        return self._party.call(list(args), dict(kwargs))


def main():
    job = _json.loads(sys.stdin.read())
    program = job["program"]
    helper_program = job.get("helper_program")
    entry = job["entry_point"]
    helper = job.get("helper")
    joint = program if helper_program is None else helper_program.rstrip() + "\n\n\n" + program
    try:
        tree = ast.parse(joint)
    except SyntaxError as error:
        report(event="syntax_error", message=f"{error.msg} (line {error.lineno})")
        report(event="done")
        return
    except (ValueError, MemoryError, RecursionError) as error:
        report(event="syntax_error", message=_error_text(error))
        report(event="done")
        return
    report(event="analysis", **analyze(tree, entry, helper))
    if job.get("analyze_only"):
        report(event="done")
        return
    main_party = Party(5, 4, "candidate")
    if helper_program is not None:
        helper_party = Party(7, 6, "helper")
        try:
            failure = helper_party.wait_ready()
        except PartyGone as error:
            failure = ("", str(error))
        if failure is None:
            main_party.serves_helper = helper_party
    try:
        failure = main_party.wait_ready()
    except PartyGone as error:
        failure = ("", str(error))
    if failure is not None:
        if failure[0] == "MemoryError":
            report(event="memory")
        report(event="load_error", message=": ".join(part for part in failure if part))
        report(event="done")
        return
    candidate = Candidate(main_party, entry)
    scope = {"__name__": "judge", "__builtins__": builtins}
    preamble = job.get("preamble") or ""
    test = job.get("test") or ""
    try:
        if preamble:
            pre_tree = ast.parse(preamble)
            pre_tree.body = [n for n in pre_tree.body if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry)]
            exec(compile(pre_tree, "<prompt>", "exec"), scope)
        scope[entry] = candidate
        test_tree = ast.parse(test)
        exec(compile(test_tree, "<test>", "exec"), scope)
    except BaseException as error:
        report(event="load_error", message="the test code failed: " + _error_text(error))
        report(event="done")
        return
    check = None
    for node in test_tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            check = node
    units = []
    if check is not None and check.args.args:
        scope[check.args.args[0].arg] = candidate
        try:
            for statement in check.body:
                has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(statement))
                module = ast.Module(body=[statement], type_ignores=[])
                units.append((statement, has_assert, compile(module, "<test>", "exec")))
        except SyntaxError:
            units = []
        if not units:
            call = ast.parse(f"check({entry})").body[0]
            units = [(call, True, compile(ast.Module(body=[call], type_ignores=[]), "<test>", "exec"))]
    if not any(has_assert for _, has_assert, _ in units):
        report(event="plan", asserts=0)
        report(event="done")
        return
    report(event="plan", asserts=sum(1 for _, has_assert, _ in units if has_assert))
    limit = float(job.get("assert_timeout_s") or 0)
    signal.signal(signal.SIGALRM, _on_alarm)
    index = 0
    State.in_tests = True
    for statement, has_assert, code in units:
        source = _segment(test, statement)
        error = None
        try:
            if limit > 0:
                # The party stops its own call at the limit; this is the backstop.
                signal.setitimer(signal.ITIMER_REAL, limit + 0.5)
            exec(code, scope)
        except MemoryError as caught:
            error = caught
            report(event="memory")
        except BaseException as caught:
            error = caught
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if has_assert:
            report(event="assert", index=index, line=statement.lineno, source=source, passed=error is None,
                   error=None if error is None else _error_text(error))
            index += 1
        elif error is not None:
            report(event="setup_error", line=statement.lineno, source=source, error=_error_text(error))
    State.in_tests = False
    report(event="helper_calls", count=State.helper_calls)
    report(event="done")


main()
