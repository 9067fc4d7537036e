"""The shape of the package, as the code reads: no module over 500 lines (nor a test or a benchmark), no
import circle (counting imports made inside functions, which only hide one; among the benchmarks too), the
job's mode asked in one place, and the roles handed their specs, not the whole job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "prefect_elastic"
MOST_LINES = 500
# Beside the package, held to its length and (the benchmarks, a package of their own) to no import circle.
TESTS, BENCHMARKS = PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks"


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its code but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_module_is_longer_than_500_lines() -> None:
    """Nor a test module or a benchmark: they grow with the package, and are split by concern as it is."""
    found = modules() | modules(TESTS) | modules(BENCHMARKS)
    assert len(found) > len(modules()) + 60, sorted(found)  # (the scan finds the tests and benchmarks)
    long = {n: len(p.read_text().splitlines()) for n, p in found.items()}
    assert not {n: k for n, k in long.items() if k > MOST_LINES}, "split these by concern"


def circles_in(package: Path) -> list[list[str]]:
    """The import circles among the modules of `package`, each as the modules round it."""
    mods = modules(package)
    graph = {n: imports_of(n, p, set(mods)) for n, p in mods.items()}
    # (A package's __init__ re-exporting its own modules is not a circle: its modules import siblings, not
    # the package.)
    graph = {n: {t for t in ts if not (n.startswith(t + ".") and t in graph)} for n, ts in graph.items()}
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return circles


def test_no_import_circle() -> None:
    """In the package, and among the benchmarks' modules."""
    circles = circles_in(PACKAGE) + circles_in(BENCHMARKS)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_no_two_classes_share_a_name() -> None:
    """One name, one concept: a newcomer who greps for a class lands on one definition (nested classes
    and `TYPE_CHECKING` stand-ins included)."""
    where: dict[str, list[str]] = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert len(where) > 100, len(where)  # (the scan finds the package's classes)
    assert not {name: at for name, at in where.items() if len(at) > 1}, "name one of each pair apart"


def test_the_mode_is_asked_in_one_place() -> None:
    # (A comparison with the mode's name, or of a `.mode`: not other modes, such as a partition's.)
    asked = re.compile(r"""(==|!=)\s*["']a?sync["']|["']a?sync["']\s*(==|!=|in\b)|\.mode\s*(==|!=|in\b)""")
    where = [
        f"{path.relative_to(PACKAGE.parent)}:{i}"
        for name, path in modules().items()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if asked.search(line.split("#")[0]) and name != "prefect_elastic.modes"
    ]
    assert not where, where


# The roles that are handed their slice of the job (`job/specs.py`): none of them may reach for the rest.
HANDED_A_SPEC = ("data_server", "compute", "checkpoint")


def names_the_whole_job(node: ast.AST) -> bool:
    """Whether `node` names `ElasticJob`, or imports the module that defines it."""
    if isinstance(node, ast.Name):
        return node.id == "ElasticJob"
    if isinstance(node, ast.Attribute):
        return node.attr == "ElasticJob"
    if isinstance(node, ast.alias):
        return "ElasticJob" in (node.name, node.asname) or node.name.endswith("settings")
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").endswith("settings")
    return False


def test_the_roles_handed_a_spec_never_see_the_whole_job() -> None:
    """A data server, a compute loop, the shard optimizer and the checkpoint writer get a `ShardSpec`, a
    `LoopSpec`, a `ModelSpec` or a `CheckpointSpec`: none of their modules imports or names `ElasticJob`,
    or imports the module that defines it."""
    scanned = {n: p for n, p in modules().items() if n.split(".")[1:2] and n.split(".")[1] in HANDED_A_SPEC}
    assert len(scanned) > 20, sorted(scanned)  # (every module of the four: the scan finds them)
    where = [
        f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
        for path in scanned.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if names_the_whole_job(node)
    ]
    assert not where, where


# The private attributes of other libraries the engine must touch, each for a reason of its own.
THIRD_PARTY_PRIVATE = {
    # distributed.Client: `_run` is `run`'s coroutine (awaited under a timeout of the engine's own, which
    # `run` does not take), `_scatter` `scatter`'s (raced against the worker's leave), `_gather_future` the
    # shared gather task a timeout can jam (`calls._unjam_gather`).
    "_run", "_scatter", "_gather_future",
    # distributed.Actor: a handle rebuilt as the controller's (`calls.controller_handle`), and one made anew
    # for another worker (`messages`).
    "_cls", "_address", "_future",
    # torch.Tensor's version counter: whether an optimizer changed a parameter in place.
    "_version",
    # distributed.deploy.SpecCluster's own bookkeeping, which `StaticAwareAdaptive` must keep in step.
    "_update_worker_status", "_correct_state", "_i",
}  # fmt: skip
# The standard library's: a forked child's exit without the parent's handlers.
STDLIB_PRIVATE = {("os", "_exit"), ("threading", "_shutdown"), ("atexit", "_run_exitfuncs")}


def test_no_module_reads_or_writes_another_objects_private_attribute() -> None:
    """An object's state has an owner: no module of the package reaches into another object's private
    fields (`run._told_lost`), only into its own (`self._x`, `cls._x`); dunder names and the few private
    attributes of other libraries the engine must touch (`THIRD_PARTY_PRIVATE`) aside."""
    where = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            own = owner in ("self", "cls")
            if own or node.attr in THIRD_PARTY_PRIVATE or (owner, node.attr) in STDLIB_PRIVATE:
                continue
            where.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not where, where


def test_only_dask_failures_reads_an_errors_text() -> None:
    """Dask's failures are recognised in one module (`dask_failures.py`): nowhere else is an exception's
    text matched."""
    reads = re.compile(r"""in str\((exc|error|e)\)|in repr\((exc|error|e)\)""")
    where = [
        f"{path.relative_to(PACKAGE.parent)}:{i}"
        for name, path in modules().items()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if reads.search(line.split("#")[0]) and name != "prefect_elastic.dask_failures"
    ]
    assert not where, where


def test_every_name_the_flows_examples_and_benchmarks_import_from_the_package_is_there() -> None:
    """The deployable flows, the examples and the benchmarks import the package by name: a name that moved
    fails here, not in a container at deploy time."""
    import importlib

    root = PACKAGE.parent
    missing = []
    for path in sorted(
        [*root.glob("flows/**/*.py"), *root.glob("examples/**/*.py"), *root.glob("benchmarks/*.py")]
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefect_elastic"):
                module = importlib.import_module(node.module or "")
                missing += [
                    f"{path.relative_to(root)}: {node.module}.{a.name}"
                    for a in node.names
                    if not hasattr(module, a.name) and not _is_module(f"{node.module}.{a.name}")
                ]
    assert not missing, missing


def _is_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


STEP_MESSAGES = "prefect_elastic.wire.step_messages"


def reads_or_builds_an_op(node: ast.AST) -> bool:
    """A header's op, built (`{"op": ...}`, `dict(op=...)`) or read (`header["op"]`, `.get("op")`)."""
    if isinstance(node, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value == "op" for k in node.keys)
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "op"
    if isinstance(node, ast.Call):
        if any(k.arg == "op" for k in node.keywords) and ast.unparse(node.func) == "dict":
            return True
        method = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        return method in {"get", "pop"} and any(
            isinstance(a, ast.Constant) and a.value == "op" for a in node.args[:1]
        )
    return False


def test_a_step_message_is_built_and_read_in_the_protocol_module_only() -> None:
    """Every message of the step channel is a class of `wire/step_messages.py`, which alone reads or writes
    a header's op: a loop builds the message, the shard dispatches on its type."""
    mods = modules()
    assert any(reads_or_builds_an_op(n) for n in ast.walk(ast.parse(mods[STEP_MESSAGES].read_text())))
    where = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for name, path in mods.items()
        if name != STEP_MESSAGES
        for node in ast.walk(ast.parse(path.read_text()))
        if reads_or_builds_an_op(node)
    ]
    assert not where, "build a message of wire/step_messages.py instead: " + ", ".join(where)


# A header's fields read beneath the messages, by module (with why): the frame's own, which the transport
# adds to a header and takes out of it around a message. All a message or an answer says is read through
# its class of `wire/step_messages.py`.
HEADER_READS_ALLOWED: dict[str, tuple[set[str], str]] = {
    "prefect_elastic.wire.codec": (
        {"error", "got", "current", "what", "step", "version", "index", "batch_ids", "batch_id", "message"},
        "an error's own header, the frame's encoding of an exception (`error_header`, `error_of`)",
    ),
    "prefect_elastic.wire.channel": ({"tensors"}, "the body's size, read off a header before the body"),
    "prefect_elastic.wire.sockets": ({"tensors"}, "likewise, on the shard's end of a connection"),
    "prefect_elastic.wire.inbox": (
        {"inbox", "slot", "reads", "published"},
        "the shared memory's fields, taken out of a header before the frame is decoded",
    ),
}
# Modules that make a `Frame` of a header other than a message's: codec's `decode`, the frame of a header
# read off the wire.
FRAMES_BUILT_ALLOWED = {"prefect_elastic.wire.codec"}


def _is_header(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "header") or (
        isinstance(node, ast.Attribute) and node.attr == "header"
    )


def _key(node: ast.AST | None) -> str:
    return str(node.value) if isinstance(node, ast.Constant) else "?"


def header_use(node: ast.AST) -> str | None:
    """A header built or read by hand: a `Frame(...)` made by hand (`Frame({...})`: a frame is a message's
    or an answer's `frame`), a key read (`header["k"]`, `frame.header.get("k")`, `.pop`, `"k" in header`),
    or a frame's header taken aside to read later (`h = frame.header`). Returns what it is (the key read),
    None where the node is none of those."""
    if isinstance(node, ast.Call):
        func = node.func
        if (isinstance(func, ast.Name) and func.id == "Frame") or (
            isinstance(func, ast.Attribute) and func.attr == "Frame"
        ):
            return "a Frame built"
        if (
            isinstance(func, ast.Attribute)
            and func.attr in {"get", "pop", "setdefault"}
            and _is_header(func.value)
        ):
            return _key(node.args[0] if node.args else None)
    if isinstance(node, ast.Subscript) and _is_header(node.value):
        return _key(node.slice)
    if isinstance(node, ast.Compare) and any(_is_header(c) for c in node.comparators):
        return _key(node.left) if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) else None
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "header":
        return "a header taken aside"
    return None


def test_a_step_answer_is_built_and_read_in_the_protocol_module_only() -> None:
    """What a shard answers is a class of `wire/step_messages.py` too: the shard builds it, the loop reads it
    (`Next.of(frame.header)`); no other module builds a header dict or reads a header's key, but the
    transport's own fields (`HEADER_READS_ALLOWED`, each with its reason)."""
    mods = modules()
    assert any(header_use(n) for n in ast.walk(ast.parse(mods[STEP_MESSAGES].read_text())))
    where = []
    for name, path in mods.items():
        if name == STEP_MESSAGES:
            continue
        allowed = HEADER_READS_ALLOWED.get(name, (set(), ""))[0]
        for node in ast.walk(ast.parse(path.read_text())):
            use = header_use(node)
            if use is None or use in allowed or (use == "a Frame built" and name in FRAMES_BUILT_ALLOWED):
                continue
            where.append(f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}: {use}")
    assert not where, "build or read an answer of wire/step_messages.py instead: " + ", ".join(where)


def test_the_header_reads_allowed_are_still_made() -> None:
    """Each key allowed beneath the messages is still read where it is allowed (the allowlist stays small)."""
    mods = modules()
    for name, (keys, reason) in HEADER_READS_ALLOWED.items():
        used = {header_use(n) for n in ast.walk(ast.parse(mods[name].read_text()))}
        assert keys <= used, f"{name} reads no more {sorted(keys - used)} ({reason}): drop them from the list"
