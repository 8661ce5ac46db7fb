"""The house rules of the layout (ARCHITECTURE.md), checked on the source: the Redis keyspace has one owner, the
library never imports its consumers, and the pipeline's shape is read from the contract by everyone."""

from __future__ import annotations

import ast
from pathlib import Path

from eagle3q.celery.app import make_app
from eagle3q.config import Settings
from eagle3q.contract import PIPELINE, QUEUES, ROLES, ROUTES, SAMPLE_STAGES

PKG = Path(__file__).resolve().parents[2] / "eagle3q"


def _modules(exclude: str | None = None) -> list[Path]:
    return [p for p in PKG.rglob("*.py") if not (exclude and p.relative_to(PKG).parts[0] == exclude)]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_only_the_control_plane_builds_keys_or_touches_the_ledgers_client():
    offenders = []
    for path in _modules(exclude="control"):
        text = path.read_text()
        imports = _imports(path)
        if '"e3q:' in text or "'e3q:" in text or "eagle3q.control.keys" in imports:
            offenders.append(f"{path.name}: builds a key")
        if ".client" in text and "ledger" in text.lower() and "ledger.client" in text:
            offenders.append(f"{path.name}: uses the ledger's client")
        if "register_script" in text:
            offenders.append(f"{path.name}: runs its own Lua on Redis")
    assert not offenders, offenders


def test_the_library_never_imports_its_consumers_and_reconcile_has_no_celery():
    assert len(_modules()) > 50 and len(list((PKG / "control").glob("*.py"))) >= 5
    for path in _modules():
        assert not any(m == "workers" or m.startswith("workers.") for m in _imports(path)), path
    for path in (PKG / "control").glob("*.py"):
        assert not any(m == "celery" or m.startswith("celery.") for m in _imports(path)), path


def test_the_worker_app_serves_every_stage_of_the_contract():
    app = make_app(Settings(), worker=True)
    assert {s.task for s in PIPELINE} <= set(app.tasks)
    assert {q.name for q in app.conf.task_queues} == set(QUEUES)  # declared: Flower knows them before a worker
    assert app.conf.task_routes == ROUTES and {r.queue for r in ROLES.values()} == set(QUEUES)
    assert tuple(s.name for s in PIPELINE if s.per_sample) == SAMPLE_STAGES
    assert make_app(Settings()).tasks.keys().isdisjoint({s.task for s in PIPELINE})  # a producer's app only sends


def _module_name(path: Path) -> str:
    parts = ("eagle3q", *path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_package_has_no_import_cycles_lazy_imports_included():
    """An import inside a function is still a dependency: a circle through one is a circle (issue 24). Each shared
    piece lives where both sides import it (`celery.transport.broker_key`, `eagle3.collectives`)."""
    names = {_module_name(p): p for p in _modules()}
    graph = {m: {i for i in _imports(p) if i in names and i != m} for m, p in names.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n):], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


# Modules that open files, and why none of them is a run's file: those go through eagle3q.store only.
FILE_IO_ALLOWED = {
    "cli.py": "eval-draft's scratch directory (a fetched export)",
    "dev/demo.py": "the tiny target's config",
    "dev/local.py": "worker and server logs",
    "dev/s3_local.py": "the local S3 server's log and its front's refuse flag",
    "dev/speculators_cpu.py": "the peer trainer's own directory and log",
    "dev/tiny.py": "builds the tiny target model",
    "dev/vllm_cpu_connector.py": "vLLM's connector lock files, on vLLM's disk",
    "dev/vllm_engine.py": "vLLM's log",
    "extraction/estimate.py": "the target's config",
    "evaluation/offline.py": "a data set's prompts, and eval-draft --out (a directory the user names)",
    "draft/export.py": "load_exported reads a draft directory as vLLM does",
    "interop/peer_formats.py": "a peer trainer's layout, in the local directory that trainer reads",
    "target.py": "the target model's files",
    "draft/training.py": "TensorBoard's local scratch directory (copied to the store each epoch)",
    "extraction/vllm_backend.py": "the connector's files on vLLM's machine: read, put in the store, deleted",
    "sim/hidden_states.py": "the simulator writes connector files where vLLM would",
    "sources.py": "data sets",
    "status.py": "the connector's directory (its backlog)",
}
IO_CALLS = {"open", "safe_open", "load_file", "save_file", "write_atomic", "read_bytes", "write_bytes", "read_text",
            "write_text", "unlink", "rmtree", "copytree", "mkstemp", "rglob", "glob", "iterdir"}
STORE_LOCATION = {"store_dir", "store_url", "store_location", "blobs"}


def _file_io(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name in IO_CALLS or (owner, name) in {("torch", "save"), ("torch", "load"), ("os", "replace")}:
                out.add(f"{owner}.{name}" if owner in ("torch", "os") else name)
    return out


def test_nothing_outside_the_store_opens_a_runs_files():
    """The store is the one seam (issue 36): no module but eagle3q.store (and the settings that define them) reads
    where the store is, or reaches its byte layer, so none can build a run's path; and only modules with a reason
    here open files at all."""
    modules = {p.relative_to(PKG).as_posix(): p for p in _modules(exclude="store")}
    assert len(modules) > 50 and "stages/hidden_states.py" in modules
    locating, opening = [], []
    for rel, path in sorted(modules.items()):
        tree = ast.parse(path.read_text())
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} & STORE_LOCATION
        if attrs and rel != "config.py":
            locating.append(f"{rel}: {sorted(attrs)}")
        if "eagle3q.store.blobs" in _imports(path) and rel != "config.py":
            locating.append(f"{rel}: imports the byte layer")
        io = _file_io(tree)
        if io and rel not in FILE_IO_ALLOWED:
            opening.append(f"{rel}: {sorted(io)}")
    assert not locating, f"only eagle3q.store knows where the store is: {locating}"
    assert not opening, f"file I/O outside the store, with no reason in FILE_IO_ALLOWED: {opening}"
    stale = [m for m in FILE_IO_ALLOWED if m not in modules or not _file_io(ast.parse(modules[m].read_text()))]
    assert not stale, f"allowed but no longer opening files: {stale}"
